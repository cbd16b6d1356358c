"""Fused linear + cross-entropy head (``--local-fused-loss``) and the other engine speed options, on CPU.

The fused head must give the same loss and gradients as the chunked path and as HF's own
``labels=`` loss; the engine may use it only for losses that declare a uniform token gradient.
"""

from __future__ import annotations

import json
import time

import pytest
import torch
from torch import nn

from toolkit.builtins.losses import SFTLoss
from toolkit.contracts import LossOutput, StepContext
from toolkit.recipe import resolve_recipe
from toolkit.train.fused_head import fused_label_logps
from toolkit.train.logps import CausalLMLogps, label_logps, token_logps
from toolkit.train.runner import run_training


def test_fused_head_with_no_trained_tokens_gives_zero_gradients():
    """A micro-batch (or pipeline chunk) with no trained label: zero gradients, as autograd gives, not 0/0."""
    head = nn.Linear(16, 50, bias=False)
    hidden = torch.randn(0, 16, requires_grad=True)
    out = fused_label_logps(head, hidden, torch.zeros(0, dtype=torch.long), 4)
    (out * 2.0).sum().backward()
    assert out.shape == (0,) and hidden.grad.shape == (0, 16)
    assert torch.equal(head.weight.grad, torch.zeros_like(head.weight))


@pytest.mark.parametrize("chunk", [4, 64])
@pytest.mark.parametrize("trainable", [True, False])
def test_fused_head_equals_chunked_and_full_logits(chunk, trainable):
    torch.manual_seed(0)
    head = nn.Linear(16, 50, bias=False).requires_grad_(trainable)
    hidden = torch.randn(21, 16, requires_grad=True)
    labels = torch.randint(0, 50, (21,))
    scale = -3.0 / 21  # what a token-averaged loss (times a DP factor) sends back to every label log-prob
    results = []
    for path in ("fused", "chunked", "full"):
        if path == "fused":
            out = fused_label_logps(head, hidden, labels, chunk)
        elif path == "chunked":
            out = label_logps(head, hidden, labels, chunk=chunk)
        else:
            out = torch.log_softmax(head(hidden), dim=-1).gather(-1, labels[:, None]).squeeze(-1)
        (out * scale).sum().backward()
        results.append((out.detach(), hidden.grad, head.weight.grad))
        hidden.grad, head.weight.grad = None, None
    for other in results[1:]:
        torch.testing.assert_close(results[0][0], other[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(results[0][1], other[1], rtol=1e-5, atol=1e-6)
        if trainable:
            torch.testing.assert_close(results[0][2], other[2], rtol=1e-5, atol=1e-6)
        else:
            assert other[2] is None and results[0][2] is None


def test_fused_head_under_bf16_autocast_matches_the_chunked_path():
    torch.manual_seed(1)
    head = nn.Linear(32, 64, bias=False)
    hidden = torch.randn(12, 32, requires_grad=True)
    labels = torch.randint(0, 64, (12,))
    results = []
    for fused in (True, False):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = fused_label_logps(head, hidden, labels, 5) if fused else label_logps(head, hidden, labels, chunk=5)
        (out / 12).sum().backward()
        results.append((out.detach(), hidden.grad.clone(), head.weight.grad.clone()))
        hidden.grad, head.weight.grad = None, None
    for fused, chunked in zip(*results):
        torch.testing.assert_close(fused, chunked, rtol=2e-2, atol=2e-2)
    assert results[0][2].dtype == torch.float32


def test_fused_sft_loss_and_gradients_equal_hf_labels_loss(tiny_model_factory):
    model = tiny_model_factory("llama")
    reference = tiny_model_factory("llama")
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)
    labels[0, :5] = -100  # a prompt that is not trained
    batch = {"input_ids": ids, "labels": labels, "position_ids": torch.arange(16).expand(2, 16),
             "sequence_ids": torch.arange(2)[:, None].expand(2, 16).contiguous(), "sequence_meta": {}, "num_sequences": 2}
    module = CausalLMLogps(model)
    from toolkit.train.kernels.reference import TorchOps

    module.fused_ops = TorchOps
    ctx = StepContext(label_tokens=int((labels != -100).sum()), sequences=2, examples=2)
    ours = SFTLoss()(token_logps(module, batch, torch.device("cpu")), ctx).loss
    ours.backward()
    hf_labels = torch.cat([torch.full_like(labels[:, :1], -100), labels[:, :-1]], dim=1)
    expected = reference(input_ids=ids, labels=hf_labels).loss
    expected.backward()
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-6)
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


class WeightedLoss:
    """A loss that weights tokens unequally (as DPO-style losses do): must never take the fused head."""

    name, consumes, needs_reference, example_kinds = "weighted", "logps", False, ("lm",)

    def __call__(self, out, ctx):
        weights = torch.linspace(0.5, 1.5, out.logps.shape[-1])
        return LossOutput(loss=-(out.logps * out.mask * weights).sum() / ctx.label_tokens)


def _engine(**local):
    from toolkit.builtins.strategies import LocalConfig, LocalEngine
    from toolkit.builtins.tuners import FullTuner
    from toolkit.models import resolve_model

    recipe = resolve_recipe({"model": "tiny-llama", "lr": 1e-3, "precision": "fp32"})
    engine = LocalEngine(resolve_model("tiny-llama"), FullTuner(), SFTLoss(), recipe, LocalConfig(**local))
    engine.set_total_steps(3)
    return engine


def _batch():
    ids = torch.randint(0, 500, (2, 16), generator=torch.Generator().manual_seed(3))
    labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)
    batch = {"input_ids": ids, "labels": labels, "position_ids": torch.arange(16).expand(2, 16),
             "sequence_ids": torch.arange(2)[:, None].expand(2, 16).contiguous(), "sequence_meta": {}, "num_sequences": 2}
    return batch, StepContext(label_tokens=30, sequences=2, examples=2)


class ReweightedSFT(SFTLoss):
    """Inherits ``uniform_token_gradient`` but re-weights tokens in its own ``__call__``."""

    __call__ = WeightedLoss.__call__


def test_engine_takes_the_fused_head_only_for_uniform_losses():
    from toolkit.builtins.losses import PTLoss

    engine = _engine(fused_loss=True)
    batch, ctx = _batch()
    for loss, fused in ((SFTLoss(), True), (WeightedLoss(), False), (PTLoss(), True), (ReweightedSFT(), False)):
        engine.train_step([batch], loss, ctx)
        assert (engine.logps_module.fused_ops is not None) == fused, type(loss).__name__


def test_fused_loss_and_kernels_train_like_the_default_path(tmp_path):
    def train(name, **local):
        recipe = resolve_recipe({"model": "tiny-llama", "dataset": ["demo"], "output": str(tmp_path / name), "lr": 1e-3,
                                 "seq_len": 128, "log_every": 1, "max_steps": 3, "micro_batch_size": 2,
                                 "global_batch_size": 4, "local": local})
        run_dir = run_training(recipe)
        return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]

    default = train("default")
    fast = train("fast", fused_loss=True, kernels="torch")
    assert len(default) == len(fast) == 3
    for a, b in zip(default, fast):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)


def test_compiled_decoder_layers_equal_eager(monkeypatch, capsys):
    from torch._dynamo.utils import counters

    from toolkit.train.kernels import patch

    monkeypatch.setattr(patch, "COMPILE_BACKEND", "aot_eager")  # dynamo + AOT autograd, no C++ toolchain on CPU
    counters.clear()
    batch, ctx = _batch()
    eager = _engine()
    compiled = _engine(compile=True)
    assert "decoder layers compile" in capsys.readouterr().err
    start = time.perf_counter()
    for _ in range(2):
        a = eager.train_step([batch], SFTLoss(), ctx)
        b = compiled.train_step([batch], SFTLoss(), ctx)
        assert a.loss == pytest.approx(b.loss, rel=1e-5)
        assert a.grad_norm == pytest.approx(b.grad_norm, rel=1e-4)
    assert time.perf_counter() - start < 60
    assert not compiled.compile_pending
    assert counters["stats"]["unique_graphs"] >= 1  # the layers really went through dynamo


def test_compile_failure_falls_back_to_eager_with_a_message(monkeypatch, capsys):
    from toolkit.train.kernels import patch

    def failing_backend(graph, example_inputs):
        raise RuntimeError("this backend always fails")

    monkeypatch.setattr(patch, "COMPILE_BACKEND", failing_backend)
    batch, ctx = _batch()
    compiled = _engine(compile=True)
    result = compiled.train_step([batch], SFTLoss(), ctx)
    err = capsys.readouterr().err
    assert "torch.compile of the decoder layers failed" in err and "continuing without compilation" in err
    assert result.loss == pytest.approx(_engine().train_step([batch], SFTLoss(), ctx).loss, rel=1e-6)
    second = compiled.train_step([batch], SFTLoss(), ctx)  # eager from now on, no second message
    assert "failed" not in capsys.readouterr().err and second.loss < result.loss


def test_fp8_is_refused_on_cpu_and_with_adapters():
    from toolkit.builtins.strategies import LocalConfig, LocalStrategy
    from toolkit.errors import ConfigError

    with pytest.raises(ConfigError, match="float8 training needs a CUDA GPU"):
        _engine(fp8=True)
    recipe = resolve_recipe({"model": "tiny-llama", "tuner": "freeze"})
    assert LocalStrategy(LocalConfig(fp8=True)).validate(recipe, 1) == []
    lora = resolve_recipe({"model": "tiny-llama"})
    object.__setattr__(lora, "tuner", "lora")
    assert "--local-fp8" in LocalStrategy(LocalConfig(fp8=True)).validate(lora, 1)[0]


def test_attention_preference_trains_like_torchs_choice():
    batch, ctx = _batch()
    default, cudnn_first = _engine(), _engine(attention="cudnn")
    for _ in range(2):
        a = default.train_step([batch], SFTLoss(), ctx)
        b = cudnn_first.train_step([batch], SFTLoss(), ctx)  # no cuDNN on CPU: falls through to the next kernel
        assert a.loss == pytest.approx(b.loss, rel=1e-5)


def test_fp8_engine_path_trains_close_to_bf16(monkeypatch):
    """The float8 conversion inside the engine (master weights, optimizer) on CPU, where torch has fp8 GEMMs."""
    pytest.importorskip("torchao.float8")
    from toolkit.train.kernels import patch

    monkeypatch.setattr(patch, "fp8_problem", lambda device: None)
    batch, ctx = _batch()
    plain, fp8 = _engine(), _engine(fp8=True)
    assert type(fp8.model.model.layers[0].mlp.gate_proj).__name__ == "Float8Linear"
    assert type(fp8.model.lm_head) is nn.Linear  # the output head stays in high precision
    losses = []
    for _ in range(3):
        a = plain.train_step([batch], SFTLoss(), ctx)
        b = fp8.train_step([batch], SFTLoss(), ctx)
        assert b.loss == pytest.approx(a.loss, rel=2e-2)
        losses.append(b.loss)
    assert losses[-1] < losses[0]  # the same batch again: float8 training learns it


# ----------------------------------------------------------------------------- defaults: auto levers


def test_fused_loss_is_auto_by_default_and_takes_true_false_from_flags_and_yaml(probe_manager, cli_runner, captured_runs,
                                                                                 tmp_path):
    from conftest import PROBE_FLAGS
    from toolkit.builtins.strategies import LocalConfig, LocalStrategy
    from toolkit.errors import ConfigError
    from toolkit.recipe import read_yaml, thing_options

    for flags, expected in (((), "auto"), (("--local-fused-loss",), True), (("--no-local-fused-loss",), False)):
        result = cli_runner.invoke("train", *PROBE_FLAGS, *flags)
        assert result.exit_code == 0, result.output
        assert thing_options(captured_runs.pop(), LocalStrategy).fused_loss == expected, flags
    for text, expected in (("auto", "auto"), ("true", True), ("off", False)):
        path = tmp_path / f"{text}.yaml"
        path.write_text(f"model: m\nlocal: {{fused_loss: {text}, kernels: none}}\n")
        options = thing_options(resolve_recipe(read_yaml(path), source=str(path), manager=probe_manager), LocalStrategy)
        assert (options.fused_loss, options.kernels) == (expected, "none")
    with pytest.raises(ConfigError, match="local.fused_loss: expected bool or 'auto', got 'maybe'"):
        resolve_recipe({"model": "m", "local": {"fused_loss": "maybe"}}, manager=probe_manager)
    assert (LocalConfig().kernels, LocalConfig().fused_loss) == ("auto", "auto")


def test_auto_levers_are_off_on_cpu_and_say_nothing(capsys):
    from toolkit.train.speed import resolve_fused_loss

    engine = _engine()
    assert engine.kernel_ops is None and engine.fused_loss is False  # the CPU path is the chunked one, as before
    assert "toolkit:" not in capsys.readouterr().err
    batch, ctx = _batch()
    engine.train_step([batch], SFTLoss(), ctx)
    assert engine.logps_module.fused_ops is None
    assert resolve_fused_loss("auto", torch.device("cuda")) is True
    assert resolve_fused_loss("auto", torch.device("cpu")) is False
    assert resolve_fused_loss(True, torch.device("cpu")) is True and resolve_fused_loss(False, torch.device("cuda")) is False
    assert _engine(fused_loss=True).fused_loss is True


def test_auto_kernels_on_a_gpu_patch_supported_families_and_leave_others(monkeypatch, capsys, tiny_model_factory):
    """What ``auto`` does where Triton runs (the ops stand in for Triton's): llama is patched, an MoE family
    keeps HF's modules instead of being refused, and one line names the levers that are on."""
    import toolkit.train.kernels as kernels
    from toolkit.builtins.strategies import LocalConfig
    from toolkit.train.kernels.patch import restore_rope
    from toolkit.train.kernels.reference import TorchOps
    from toolkit.train.speed import apply_speed_options, report_levers

    monkeypatch.setattr(kernels, "load_ops", lambda backend: TorchOps if backend in ("auto", "torch") else None)
    try:
        llama, moe = tiny_model_factory("llama"), tiny_model_factory("qwen2_moe")
        ops, _ = apply_speed_options(llama, LocalConfig(), torch.device("cpu"))
        assert ops is TorchOps and type(llama.model.norm).__name__.startswith("Fused")
        assert "RMSNorm" in capsys.readouterr().err
        ops, _ = apply_speed_options(moe, LocalConfig(), torch.device("cpu"))
        assert ops is TorchOps and not type(moe.model.norm).__name__.startswith("Fused")
        assert "no fused kernels for the 'qwen2_moe' family" in capsys.readouterr().err
    finally:
        restore_rope()
    report_levers(LocalConfig(), TorchOps, True, SFTLoss())
    line = capsys.readouterr().err
    assert line.count("\n") == 1 and "kernels torch (auto), fused loss (auto); off: --local-compile, --local-fp8" in line
    report_levers(LocalConfig(), TorchOps, True, WeightedLoss())
    assert "fused loss (auto) unused: the weighted loss" in capsys.readouterr().err
    report_levers(LocalConfig(), None, False, SFTLoss())
    assert capsys.readouterr().err == ""
