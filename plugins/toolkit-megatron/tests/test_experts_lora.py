"""GroupedExperts with LoRA on its experts (each expert's linears wrapped in LoRALinear, as apply_lora does) against
Megatron-Core's SequentialMLP with the same wrappers, which runs each expert's LoRALinear.forward in its loop: outputs
and the gradients of the input, of every base weight and of every adapter factor, fp32 on CPU, with an expert that
gets no token, through the grouped kernel and the per-expert loop; the grouped path must run (no fallback warning).
Expert tensor parallelism (the replicated factors' gradient sums) is held to PEFT in test_moe_lora.py."""

from __future__ import annotations

import warnings

import pytest
import torch

from toolkit_megatron import experts as grouped_module
from toolkit_megatron.lora import LoRALinear

pytestmark = pytest.mark.usefixtures("tp1")

HIDDEN, FFN, EXPERTS = 32, 24, 4
COUNTS = torch.tensor([5, 0, 7, 3])  # expert 1 gets no token


class _ColumnMask(torch.nn.Module):
    """A deterministic stand-in for the adapters' dropout: the same mask on every row, however the rows are split."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * (torch.arange(x.shape[-1]) % 3 != 0) * 1.5


def _pair(bias: bool, expert_comm: bool):
    """(Megatron's SequentialMLP, GroupedExperts) with the same weights."""
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, ffn_hidden_size=48,
                               moe_ffn_hidden_size=FFN, num_moe_experts=EXPERTS, moe_router_topk=2, add_bias_linear=bias,
                               gated_linear_unit=True, activation_func=torch.nn.functional.silu, use_cpu_initialization=True,
                               perform_initialization=True,
                               # 2: the expert linears leave the exchange to the dispatcher (LoRALinear's _Replicated* path),
                               # as at EP > 1; SequentialMLP's bias path needs it too (test_experts.py)
                               expert_model_parallel_size=2 if expert_comm else 1)
    provider = LocalSpecProvider()
    submodules = MLPSubmodules(linear_fc1=provider.column_parallel_linear(), linear_fc2=provider.row_parallel_linear())
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    torch.manual_seed(1)
    reference = SequentialMLP(EXPERTS, config, submodules, pg_collection=pgs)
    ours = grouped_module.GroupedExperts(EXPERTS, config, submodules, pg_collection=pgs)
    ours.load_state_dict(reference.state_dict())
    return reference, ours


def _adapters(fc1_parts: tuple[str, ...], dora: bool = False) -> list[dict]:
    """Per expert: (fc1 parts, fc2 parts) as apply_lora hands them to LoRALinear, B non-zero (trained, not initial)."""
    generator = torch.Generator().manual_seed(2)

    def part(rank: int, fan_in: int, fan_out: int, scale: float) -> dict:
        tensors = {"A": torch.randn(rank, fan_in, generator=generator) * 0.2,
                   "B": torch.randn(fan_out, rank, generator=generator) * 0.2, "scale": scale}
        if dora:
            tensors["M"] = torch.rand(fan_out, generator=generator) + 0.5
        return tensors

    widths = {"gate_up": 2 * FFN, "gate": FFN, "up": FFN}  # gate_up: [gate; up] rows, Megatron's order at TP 1
    return [({p: part(4, HIDDEN, widths[p], 2.0 + i) for i, p in enumerate(fc1_parts)}, {"row": part(3, FFN, HIDDEN, 0.5)})
            for _ in range(EXPERTS)]


def _wrap(module, adapters: list, dropout: float = 0.0, dropout_module: torch.nn.Module | None = None) -> None:
    for expert, (fc1, fc2) in zip(module.local_experts, adapters, strict=True):
        expert.linear_fc1 = LoRALinear(expert.linear_fc1, "gate_up", fc1, None, dropout)
        expert.linear_fc2 = LoRALinear(expert.linear_fc2, "row", fc2, None, dropout)
        if dropout_module is not None:
            expert.linear_fc1.dropout = expert.linear_fc2.dropout = dropout_module


def _assert_equal(got: torch.Tensor, expected: torch.Tensor, name: str) -> None:
    """Equal to fp32 rounding: the same products, summed in another order."""
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * max(1.0, float(expected.abs().max())),
                               msg=lambda message: f"{name}: {message}")


def _run(module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The output and the gradients (input and every parameter) of a weighted sum of it."""
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(int(COUNTS.sum()), HIDDEN, generator=generator).requires_grad_(True)
    probs = torch.rand(int(COUNTS.sum()), generator=generator)
    out, out_bias = module(x, COUNTS, probs)
    assert out_bias is None
    (out * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
    return out.detach(), {"input": x.grad, **{name: p.grad for name, p in module.named_parameters()}}


@pytest.mark.parametrize(("fc1_parts", "bias", "expert_comm", "path", "dropout"), [
    (("gate_up",), False, False, "kernel", False),  # what apply_lora builds for routed experts
    (("gate_up",), True, True, "loop", False),
    (("gate", "up"), False, True, "kernel", False),  # two parts placed in the fused rows by _fused_delta
    (("up",), True, False, "kernel", False),  # no gate adapter: zeros in its rows
    (("gate_up",), False, True, "kernel", True),  # the adapters' dropout module on their input only
], ids=["gate_up", "gate_up-bias-expert_comm-loop", "gate+up-expert_comm", "up-only-bias", "dropout"])
def test_grouped_lora_experts_equal_sequential_mlp(fc1_parts, bias, expert_comm, path, dropout, monkeypatch):
    reference, ours = _pair(bias, expert_comm)
    adapters = _adapters(fc1_parts)
    stand_in = _ColumnMask() if dropout else None
    for module in (reference, ours):
        _wrap(module, adapters, dropout_module=stand_in)
    assert list(ours.state_dict()) == list(reference.state_dict())
    # the base weights are still slices of one tensor (the zero-copy read), under the wrappers
    assert grouped_module._are_slices_of(ours._bases["linear_fc1.weight"], tuple(ours._weights("linear_fc1")))
    assert ours._weights("linear_fc1", "bias")[0] is (ours.local_experts[0].linear_fc1.base.bias if bias else None)
    assert ours._unsupported() is None
    expected, expected_grads = _run(reference)
    if path == "loop":
        monkeypatch.setattr(grouped_module, "grouped_mm_function", lambda: None)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="toolkit-megatron")  # no fallback, no broken kernel
        got, grads = _run(ours)
    _assert_equal(got, expected, "output")
    assert set(grads) == set(expected_grads)
    factors = [name for name in grads if ".lora_" in name]
    assert len(factors) == EXPERTS * 2 * (len(fc1_parts) + 1), factors
    for name, grad in grads.items():
        assert grad is not None, name
        _assert_equal(grad, expected_grads[name], name)
        if name.startswith("local_experts.1.") and ".lora_" in name:  # no token: a zero gradient, not None
            assert grad.abs().max() == 0, name
        elif ".lora_" in name:
            assert grad.abs().max() > 0, name


def test_dora_experts_fall_back_with_the_reason():
    """DoRA's per-expert row norms have no grouped form: the layer runs as SequentialMLP, and says why."""
    reference, ours = _pair(False, False)
    adapters = _adapters(("gate_up",), dora=True)
    for module in (reference, ours):
        _wrap(module, adapters)
    assert "DoRA" in ours._unsupported()
    expected, _ = _run(reference)
    with pytest.warns(UserWarning, match="DoRA on the experts"):
        got, _ = _run(ours)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
