"""Fused kernels: the ops that replace HF's modules equal them; Triton kernels equal the references (interpreter).

GPU timing and the GPU-compiled Triton comparison live in bench/speed.py; here every check runs on CPU.
"""

from __future__ import annotations

import copy
import importlib.util
import os
from pathlib import Path

import pytest
import torch

from toolkit.testing import run_python
from toolkit.train.kernels import load_ops
from toolkit.train.kernels.patch import apply_kernels, restore_rope
from toolkit.train.kernels.reference import TorchOps


@pytest.fixture(autouse=True)
def _unpatch_rope():
    yield
    restore_rope()  # the RoPE routing lives in HF's modeling module: leave it as found


def _loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids).logits
    (logits.float() * torch.linspace(-1, 1, logits.shape[-1])).sum().backward()
    return logits.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral", "qwen2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_ops_equal_hf_modules(tiny_model_factory, family, dtype):
    """Outputs and every parameter gradient of the patched model equal HF's, bit for bit (same math)."""
    hf = tiny_model_factory(family).to(dtype)
    ours = copy.deepcopy(hf)
    counts = apply_kernels(ours, TorchOps)
    layers = hf.config.num_hidden_layers
    assert counts["mlp"] == layers and counts["rope"] == 1
    assert counts["rms_norm"] == 2 * layers + 1 + (2 * layers if family == "qwen3" else 0)  # qwen3: q_norm, k_norm
    ids = torch.randint(0, hf.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    restore_rope()
    expected_logits, expected = _loss_and_grads(hf, ids)
    apply_kernels(ours, TorchOps)  # route RoPE again for our model's forward
    logits, grads = _loss_and_grads(ours, ids)
    torch.testing.assert_close(logits, expected_logits, rtol=0, atol=0)
    for name, grad in expected.items():
        torch.testing.assert_close(grads[name], grad, rtol=0, atol=0, msg=name)
    assert type(ours.model.norm).__name__.startswith("Fused")
    assert set(ours.state_dict()) == set(hf.state_dict())  # checkpoints and exports see the HF names


def test_patched_model_calls_every_op(tiny_model_factory):
    """The routing is live: a spy backend sees each RMSNorm, MLP and RoPE call of a forward."""
    calls = {"rms_norm": 0, "swiglu": 0, "rope": 0}

    class Spy(TorchOps):
        @staticmethod
        def rms_norm(x, weight, eps):
            calls["rms_norm"] += 1
            return TorchOps.rms_norm(x, weight, eps)

        @staticmethod
        def swiglu(gate, up):
            calls["swiglu"] += 1
            return TorchOps.swiglu(gate, up)

        @staticmethod
        def rope(q, k, cos, sin):
            calls["rope"] += 1
            return TorchOps.rope(q, k, cos, sin)

    model = tiny_model_factory("llama")
    apply_kernels(model, Spy)
    model(input_ids=torch.tensor([[1, 2, 3]]))
    layers = model.config.num_hidden_layers
    assert calls == {"rms_norm": 2 * layers + 1, "swiglu": layers, "rope": layers}


def test_unsupported_family_is_refused(tiny_model_factory):
    from toolkit.errors import ModelError

    model = tiny_model_factory("qwen2_moe")
    with pytest.raises(ModelError, match="--local-kernels none"):
        apply_kernels(model, TorchOps)


def test_triton_backend_without_a_gpu_falls_back_with_a_message(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert load_ops("triton") is TorchOps
    assert "using the torch reference ops" in capsys.readouterr().err
    assert load_ops("auto") is None and load_ops("none") is None


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_kernels_equal_references_under_the_interpreter(tmp_path):
    """Forward and backward of each Triton kernel vs the torch reference, run by Triton's CPU interpreter."""
    script = Path(__file__).with_name("kernels_interpreted.py")
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    done = run_python([script], env=env, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("OK") == 9, done.stdout
