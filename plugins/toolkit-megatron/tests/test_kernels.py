"""The engine's speed kernels equal the plain paths they replace: chunked label log-probs (value and
gradient, padded vocabulary, fp32 and bf16), the pointwise gradient torch.compile fuses, foreach
gradient clipping against Megatron's local fallbacks, fused AdamW against torch's default AdamW."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("real_vocab", [50, 43])
def test_chunked_logps_equal_reference(tp1, monkeypatch, dtype, real_vocab):
    from toolkit_megatron import logps

    monkeypatch.setattr(logps, "CHUNK_TOKENS", 7)  # 30 tokens: four full chunks and a short one
    generator = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 10, 50, generator=generator) * 4).to(dtype)
    labels = torch.randint(0, real_vocab, (3, 10), generator=generator)
    weights = torch.randn(3, 10, generator=generator)
    results = {}
    for kernel in ("reference", "chunked"):
        leaf = logits.clone().requires_grad_(True)
        out = logps.vocab_parallel_logps(leaf * 1, labels, real_vocab, kernel)  # `* 1`: the kernel writes its input's grad in place
        (out * weights).sum().backward()
        results[kernel] = out.detach(), leaf.grad.float()
    assert results["chunked"][0].dtype == torch.float32
    torch.testing.assert_close(results["chunked"][0], results["reference"][0], rtol=0, atol=2e-6)
    torch.testing.assert_close(results["chunked"][1], results["reference"][1], rtol=0, atol=1e-5 if dtype == torch.float32 else 1e-2)
    assert torch.all(results["chunked"][1][..., real_vocab:] == 0), "padded vocabulary entries got a gradient"
    expected = torch.log_softmax(logits.float()[..., :real_vocab], dim=-1).gather(-1, labels[..., None]).squeeze(-1)
    torch.testing.assert_close(results["chunked"][0], expected, rtol=0, atol=2e-6)


def test_pointwise_gradient_equals_inplace_gradient():
    from toolkit_megatron.logps import _chunk_grad, _chunk_grad_pointwise, _chunk_lse

    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(9, 40, generator=generator).bfloat16()
    index = torch.randint(0, 40, (9,), generator=generator)
    local = torch.rand(9, generator=generator) > 0.3
    grad = torch.randn(9, generator=generator)
    lse = _chunk_lse(logits, 37)
    torch.testing.assert_close(_chunk_grad_pointwise(logits, lse, grad, index, local, 37).float(),
                               _chunk_grad(logits, lse, grad, index, local, 37).float(), rtol=0, atol=1e-2)


def test_foreach_clipping_equals_megatron_local_kernels():
    from megatron.core.utils import local_multi_tensor_l2_norm, local_multi_tensor_scale

    from toolkit_megatron.compat import cpu_compat
    from toolkit_megatron.optim import _l2_norm, _scale

    generator = torch.Generator().manual_seed(2)
    tensors = [torch.randn(shape, generator=generator) for shape in ((5, 3), (7,), (2, 2, 2))]
    with cpu_compat():
        expected, _ = local_multi_tensor_l2_norm(0, None, [tensors], False)
    got, _ = _l2_norm(0, None, [tensors], False)
    torch.testing.assert_close(got, expected.to(got.device), rtol=1e-6, atol=0)
    in_place = [t.clone() for t in tensors]
    _scale(0, None, [in_place, in_place], 0.25)
    copied = [torch.empty_like(t) for t in tensors]
    _scale(0, None, [tensors, copied], 0.25)
    reference = [torch.empty_like(t) for t in tensors]
    local_multi_tensor_scale(0, None, [tensors, reference], 0.25)
    for a, b, c in zip(in_place, copied, reference, strict=True):
        assert torch.equal(a, c) and torch.equal(b, c)


def test_fused_adam_switch_matches_default_adamw():
    from toolkit_megatron.optim import fuse_adam

    class Wrapped:  # the shape of Megatron's optimizer wrappers: the torch optimizer in .optimizer
        def __init__(self, params):
            self.optimizer = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.0)

    generator = torch.Generator().manual_seed(3)
    start = torch.randn(10, 4, generator=generator)
    grads = [torch.randn(10, 4, generator=generator) for _ in range(3)]
    results = []
    for fused in (False, True):
        param = torch.nn.Parameter(start.clone())
        wrapped = Wrapped([param])
        if fused:
            assert fuse_adam(wrapped)
            assert wrapped.optimizer.param_groups[0]["fused"] is True
        for grad in grads:
            param.grad = grad.clone()
            wrapped.optimizer.step()
        results.append(param.detach().clone())
    torch.testing.assert_close(results[1], results[0], rtol=1e-6, atol=1e-7)


def test_kernel_rms_norm_is_every_norm_and_logits_equal_hf(tp1, tiny_models):
    """``--megatron-kernels``: every RMSNorm of the built model (input, pre-MLP, QK and final norms)
    goes through the kernel backend's ``rms_norm``, and the logits still equal HF's."""
    from transformers import AutoModelForCausalLM

    from toolkit.parallel import ParallelLayout
    from toolkit.train.kernels.reference import TorchOps
    from toolkit_megatron.bridge import SafetensorsReader, load_hf_weights
    from toolkit_megatron.model import build_model
    from toolkit_megatron.schedule import gather_logits

    calls = []

    class Recording(TorchOps):
        @staticmethod
        def rms_norm(x, weight, eps):
            calls.append(tuple(x.shape))
            return TorchOps.rms_norm(x, weight, eps)

    hf = AutoModelForCausalLM.from_pretrained(tiny_models["qwen3"], dtype=torch.float32).eval()
    models = build_model(hf.config, ParallelLayout(), kernel_ops=Recording)
    load_hf_weights(models, hf.config, SafetensorsReader.from_directory(tiny_models["qwen3"]))
    ids = torch.randint(0, hf.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(3))
    logits = gather_logits(models, ids)
    with torch.no_grad():
        expected = hf(ids).logits
    layers = hf.config.num_hidden_layers
    assert len(calls) == 4 * layers + 1, "not every norm went through the kernel backend (2 + QK norms per layer, final)"
    assert sum(shape[-1] == hf.config.head_dim for shape in calls) == 2 * layers
    assert (logits - expected).abs().max().item() <= 1e-4


def test_speed_levers_resolve_per_device():
    """``auto`` turns the compiled pieces on for a GPU only; explicit values are kept."""
    from toolkit_megatron.strategy import MegatronConfig, _speed_levers

    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert _speed_levers(MegatronConfig(kernels="none"), cpu) == (False, "chunked", None, False)
    assert _speed_levers(MegatronConfig(kernels="none"), gpu)[:2] == (True, "compiled")
    assert _speed_levers(MegatronConfig(kernels="none", compile_elementwise=False, logps_kernel="reference"), gpu)[:2] == (
        False, "reference")
    assert _speed_levers(MegatronConfig(kernels="auto"), cpu)[2] is None  # no Triton without a GPU: Megatron-side ops
    assert _speed_levers(MegatronConfig(kernels="torch"), cpu)[2].name == "torch"
