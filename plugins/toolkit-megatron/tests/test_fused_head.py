"""The fused output head (--megatron-fused-loss) equals the logits path: the fused functions against plain
autograd through full logits (padded vocabulary, no rows), and three SFT steps with the head on and off
at TP1 (one process, and DP2), TP2 (padded vocabulary), TP2+SP and PP2 with tied embeddings, CP2 and LoRA under TP2;
a loss without a uniform token gradient keeps the logits path."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import run_worker, torchrun


def reference(hidden, labels, weight, real_vocab, scale):
    logits = hidden @ weight[:real_vocab].t()
    picked = torch.log_softmax(logits, dim=-1).gather(-1, labels[:, None]).squeeze(-1)
    (picked * scale).sum().backward()
    return picked.detach()


@pytest.mark.parametrize("path", ["core", "vocab-parallel"])
@pytest.mark.parametrize("real_vocab", [40, 37])
def test_fused_logps_and_gradients_equal_autograd(tp1, path, real_vocab):
    """Values, the input gradient and the weight gradient (zero on padded rows) under a uniform incoming gradient."""
    from toolkit_megatron.fused_head import TorchShardOps, VocabParallelFusedLogps, fused_label_logps

    generator = torch.Generator().manual_seed(0)
    hidden0 = torch.randn(23, 16, generator=generator)
    weight0 = torch.randn(40, 16, generator=generator)
    labels = torch.randint(0, real_vocab, (23,), generator=generator)
    scale = -0.37  # what token-averaged cross-entropy sends every label log-prob
    expected = [t.clone().requires_grad_() for t in (hidden0, weight0)]
    picked_ref = reference(*expected[:1], labels, expected[1], real_vocab, scale)
    hidden, weight = (t.clone().requires_grad_() for t in (hidden0, weight0))
    if path == "core":
        picked = fused_label_logps(hidden, labels, weight, real_vocab, chunk=7)
    else:
        picked = VocabParallelFusedLogps.apply(hidden, labels, weight, 0, real_vocab, None, 7, TorchShardOps)
    (picked * scale).sum().backward()
    torch.testing.assert_close(picked, picked_ref, rtol=0, atol=2e-6)
    torch.testing.assert_close(hidden.grad, expected[0].grad, rtol=0, atol=2e-6)
    torch.testing.assert_close(weight.grad, expected[1].grad, rtol=0, atol=2e-6)
    assert torch.all(weight.grad[real_vocab:] == 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_shard_direction_equals_the_eager_one(dtype):
    """The pointwise form compiled on CUDA gives what the in-place eager ops give (labels on and off this shard)."""
    from toolkit_megatron.fused_head import TorchShardOps, _shard_lse, shard_direction_pointwise

    generator = torch.Generator().manual_seed(1)
    logits = (3 * torch.randn(9, 33, generator=generator)).to(dtype)
    index = torch.randint(0, 33, (9,), generator=generator)
    local = torch.rand(9, generator=generator) > 0.4
    lse, _ = TorchShardOps.shard_stats(logits, index, local)
    torch.testing.assert_close(_shard_lse(logits), lse, rtol=0, atol=1e-6)
    lse = lse + 0.25  # a global log-sum-exp (other shards add mass)
    eager = TorchShardOps.shard_direction(logits.clone(), lse, index, local)
    torch.testing.assert_close(shard_direction_pointwise(logits, lse, index, local), eager, rtol=0, atol=0)
    assert eager.dtype == dtype and bool((eager[local].gather(1, index[local, None]) > 0).all())


def test_fused_head_with_no_rows_gives_zero_gradients(tp1):
    """A micro-batch (or CP slice) without trained labels: no rows, zero gradients, never 0/0."""
    from toolkit_megatron.fused_head import fused_label_logps

    hidden = torch.randn(0, 8, requires_grad=True)
    weight = torch.randn(12, 8, requires_grad=True)
    picked = fused_label_logps(hidden, torch.zeros(0, dtype=torch.long), weight, 12)
    (picked.sum() + 0.0).backward()
    assert picked.shape == (0,) and torch.equal(weight.grad, torch.zeros_like(weight))


def test_fused_loss_resolves_per_device_and_loss(capsys):
    from toolkit.builtins.losses import SFTLoss
    from toolkit.errors import ConfigError
    from toolkit_megatron.strategy import MegatronConfig, _speed_levers

    class Weighted(SFTLoss):  # overrides __call__ without re-declaring the promise
        name = "weighted"

        def __call__(self, out, ctx):
            return super().__call__(out, ctx)

    cpu, gpu, sft = torch.device("cpu"), torch.device("cuda"), SFTLoss(SFTLoss.Config())
    none = MegatronConfig(kernels="none", compile_elementwise=False, logps_kernel="chunked")
    assert _speed_levers(none, cpu, sft).fused_loss is False  # auto: the CPU keeps the logits path
    assert _speed_levers(none, gpu, sft).fused_loss is True
    capsys.readouterr()
    forced = MegatronConfig(kernels="none", fused_loss=True)
    assert _speed_levers(forced, cpu, sft).fused_loss is True
    assert "fused output head" in capsys.readouterr().err
    assert _speed_levers(forced, cpu, Weighted(SFTLoss.Config())).fused_loss is False
    assert "--megatron-fused-loss is off for the weighted loss" in capsys.readouterr().err
    assert _speed_levers(MegatronConfig(kernels="none"), gpu, Weighted(SFTLoss.Config())).fused_loss is False
    assert "off for" not in capsys.readouterr().err  # auto: silently the logits path
    # soft-capped logits (Gemma 2/3): the fused head makes no logits to cap, so auto is off and forcing it is refused
    assert _speed_levers(none, gpu, sft, logit_softcap=30.0).fused_loss is False
    with pytest.raises(ConfigError, match="final_logit_softcapping=30.0"):
        _speed_levers(forced, cpu, sft, logit_softcap=30.0)


def test_planner_reads_the_megatron_section():
    from toolkit.plan.auto import local_speed
    from toolkit.recipe import resolve_recipe

    assert local_speed(resolve_recipe({"model": "m"}, source="test"))["megatron_fused_loss"] is True
    off = resolve_recipe({"model": "m", "megatron": {"fused_loss": False}}, source="test")
    assert local_speed(off)["megatron_fused_loss"] is False and local_speed(off)["fused_loss"] is True


CASES = ["llama:tp1:full:sft", "llama:tp2:full:sft", "qwen3:tp2+sp:full:sft", "qwen3:pp2:full:sft", "llama:cp2:full:sft",
         "llama:tp2:lora:sft", "llama:tp2:full:non-uniform"]


@pytest.mark.slow
def test_fused_head_training_equals_logits_path(tiny_models, tmp_path):
    """Three SFT steps with --megatron-fused-loss on and off: same losses, gradient norms and weights (fp32)."""
    cases = [c for c in CASES if ":lora:" not in c or _has_peft()]
    root = str(tiny_models["llama"].parent)
    results = run_worker("_fused_head_worker.py", tmp_path, root, ",".join(cases))  # 2 processes (TP1: DP2)
    torchrun("_fused_head_worker.py", root, str(tmp_path / "one.json"), "llama:tp1:full:sft", nproc=1)
    results["one process"] = json.loads((tmp_path / "one.json").read_text())["llama:tp1:full:sft"]
    for case in [*cases, "one process"]:
        got = results[case]
        uniform = not case.endswith("non-uniform")
        assert got["head_on"] is uniform and got["calls_off"] == 0, (case, got)
        assert (got["calls_on"] > 0) is uniform, (case, got)  # the head really ran (never for the other loss)
        assert got["loss_diff"] <= 2e-5 and got["norm_diff"] <= 2e-5 * max(1.0, max(got["losses"])), (case, got)
        assert got["weights"] > 0 and got["weight_diff"] <= 2e-6, (case, got["worst"], got)
        assert got["weight_change"] > 1e-3, (case, got)  # the steps trained: the comparison can fail


def _has_peft() -> bool:
    try:
        import toolkit_peft  # noqa: F401
    except ImportError:
        return False
    return True
