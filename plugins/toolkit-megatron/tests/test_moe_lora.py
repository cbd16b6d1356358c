"""LoRA on mixture-of-experts models under --strategy megatron equals PEFT's LoRA under --strategy local, with
toolkit-peft's default targets (``all-linear``: the attention, the routed experts, Qwen3-MoE's router ``mlp.gate``,
Qwen2-MoE's shared expert and its ``shared_expert_gate``): Qwen3-MoE at EP1 with two data-parallel ranks, EP2,
TP2+SP and TP2+SP+ETP2 (stopped after step 2 and resumed), and Qwen2-MoE at TP2+SP train step for step alike and end
with the same adapters, their merged exports (also from the megatron checkpoint, reloaded at TP1) give local's logits,
and the adapter-only export (PEFT's own files, read from the megatron checkpoint) loads onto the HF model with PEFT and
gives those logits too. The LoRA'd experts run grouped (GroupedExperts; a fallback to SequentialMLP warns, which fails
the run), at ETP2 too, where the replicated ``A`` of fc1 and ``B`` of fc2 sum their gradients over the group. Router
losses are off (their definitions differ between the engines, test_moe_training.py)."""

from __future__ import annotations

import pytest
import torch
from test_strategy import COMMON, assert_same_steps, metrics, toolkit

pytestmark = pytest.mark.slow

LORA = ["--tuner", "lora", "--lora-rank", "4", "--lora-alpha", "8", "--max-steps", "3"]
GATES = {"tiny-qwen3-moe": "mlp.gate.", "tiny-qwen2-moe": "mlp.shared_expert_gate."}
"""The gate each preset's default targets adapt, by its HF module name."""
GROUPED_ONLY = "ignore,error:toolkit-megatron"
"""PYTHONWARNINGS of the megatron runs: GroupedExperts' fallback to SequentialMLP (or to its per-expert loop where
the grouped kernel fails) warns ``toolkit-megatron: ...``, which fails the run."""


@pytest.fixture(scope="module")
def local_runs(tmp_path_factory):
    """(model dir, local run dir) of each preset, trained once."""
    pytest.importorskip("toolkit_peft", reason="LoRA comes from toolkit-peft")
    from toolkit.models import materialize_preset

    runs = {}

    def run(preset: str):
        if preset not in runs:
            root = tmp_path_factory.mktemp(preset)
            model = materialize_preset(preset, root / "model", router_aux_loss_coef=0.0)
            toolkit("sft", "--model", str(model), *COMMON[2:], *LORA, "--output", str(root / "local"), "--export", "hf")
            runs[preset] = (model, root / "local")
        return runs[preset]

    return run


def _adapters(run) -> dict[str, torch.Tensor]:
    """The last checkpoint's adapters under PEFT's names (both engines write them so)."""
    from safetensors.torch import load_file

    return load_file(sorted((run / "checkpoints").glob("step-*"))[-1] / "model.safetensors")


def _logits(directory, ids) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        return AutoModelForCausalLM.from_pretrained(directory)(ids).logits


@pytest.mark.parametrize(("preset", "layout"), [
    ("tiny-qwen3-moe", []),
    ("tiny-qwen3-moe", ["--ep", "2"]),
    ("tiny-qwen3-moe", ["--tp", "2", "--sequence-parallel"]),
    ("tiny-qwen3-moe", ["--tp", "2", "--sequence-parallel", "--etp", "2"]),
    ("tiny-qwen2-moe", ["--tp", "2", "--sequence-parallel"]),
], ids=["qwen3_moe-ep1-dp2", "qwen3_moe-ep2", "qwen3_moe-tp2-sp", "qwen3_moe-tp2-sp-etp2", "qwen2_moe-shared-tp2-sp"])
def test_moe_lora_equals_local_lora_and_exports(preset, layout, local_runs, tmp_path):
    model, local = local_runs(preset)
    run = tmp_path / "run"
    args = ["sft", "--model", str(model), *COMMON[2:], *LORA, "--output", str(run), "--strategy", "megatron", *layout]
    if "--etp" in layout:  # saved after step 2 with the experts' gate_up B split over expert-TP, resumed at ETP2
        toolkit(*args, "--stop-after", "2", nproc=2, warnings=GROUPED_ONLY)
        assert len(metrics(run)) == 2
        args += ["--resume", "auto"]
    toolkit(*args, "--export", "hf", nproc=2, warnings=GROUPED_ONLY)
    assert_same_steps(metrics(local), metrics(run))
    trained, got = _adapters(local), _adapters(run)
    gates = [name for name in trained if GATES[preset] in name and ".lora_B." in name]
    assert len(gates) == 2 and all(trained[name].abs().max() > 1e-4 for name in gates), gates  # one per layer, trained
    assert set(got) == set(trained)
    for name, tensor in trained.items():  # a detached adapter would keep its initial value
        torch.testing.assert_close(got[name], tensor, rtol=1e-3, atol=1e-4, msg=name)
    ids = torch.arange(5, 40)[None]
    expected = _logits(local / "export", ids)
    assert (expected - _logits(model, ids)).abs().max() > 1e-3  # the adapters trained
    torch.testing.assert_close(_logits(run / "export", ids), expected, rtol=1e-4, atol=1e-4)
    if preset == "tiny-qwen3-moe" and "--sequence-parallel" in layout:  # merged again from the sharded checkpoint
        toolkit("export", str(run), "--to", "hf", "--output", str(tmp_path / "from-checkpoint"))
        # at ETP2 the experts' fused gate_up B is split over expert-TP: its saved rows must read as [gate; up] at TP1
        torch.testing.assert_close(_logits(tmp_path / "from-checkpoint", ids), expected, rtol=1e-4, atol=1e-4)
    if "--ep" in layout:  # PEFT's adapter files from the megatron checkpoint, loaded by PEFT itself
        import json

        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        toolkit("export", str(run), "--to", "hf", "--adapter-only", "--output", str(tmp_path / "adapter"))
        config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
        assert set(config["target_parameters"]) == {"gate_up_proj", "down_proj", "gate.weight"}, config  # experts, router
        with torch.no_grad():
            adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model), tmp_path / "adapter")(ids).logits
        torch.testing.assert_close(adapted, expected, rtol=1e-4, atol=1e-4)
