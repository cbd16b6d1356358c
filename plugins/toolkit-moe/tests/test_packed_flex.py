"""Routed MoE blocks with packed rows through FlexAttention: the same step as with the masked SDPA path."""

from __future__ import annotations

import pytest
import torch

from toolkit.contracts import StepContext
from toolkit.testing import packed_batch

pytest.importorskip("torch.nn.attention.flex_attention")


def step(packed: str) -> tuple[float, float, dict[str, torch.Tensor]]:
    from toolkit.builtins.losses import SFTLoss
    from toolkit.builtins.strategies import LocalConfig, LocalEngine
    from toolkit.builtins.tuners import FullTuner
    from toolkit.models import resolve_model
    from toolkit.recipe import resolve_recipe

    recipe = resolve_recipe({"model": "tiny-qwen3-moe", "lr": 1e-3, "precision": "fp32", "packing": True,
                             "router_z_loss_coef": 0.01, "moe": {"enabled": True, "experts_backend": "loop"}})
    engine = LocalEngine(resolve_model("tiny-qwen3-moe"), FullTuner(), SFTLoss(), recipe, LocalConfig(packed_attention=packed))
    assert engine.packed_attention == packed
    assert type(engine.model.model.layers[0].mlp).__module__.startswith("toolkit_moe")
    engine.set_total_steps(2)
    batch = packed_batch([[7, 9, 5], [24], [15]], 24, engine.model.config.vocab_size)
    grads = {}
    for name, param in engine.model.named_parameters():
        param.register_post_accumulate_grad_hook(lambda p, name=name: grads.__setitem__(name, p.grad.detach().clone()))
    result = engine.train_step([batch], SFTLoss(), StepContext(label_tokens=int((batch["labels"] != -100).sum()),
                                                               sequences=5, examples=5))
    return result.loss, result.metrics["aux_loss"], grads


def test_moe_step_with_flex_equals_masked_sdpa(cpu_flex_backward, flex_calls):
    loss_m, aux_m, grads_m = step("sdpa-mask")
    assert not flex_calls
    loss_f, aux_f, grads_f = step("flex")
    assert flex_calls
    assert loss_f == pytest.approx(loss_m, rel=1e-6) and aux_f == pytest.approx(aux_m, rel=1e-6)
    assert grads_f.keys() == grads_m.keys() and grads_m
    for name, grad in grads_m.items():
        torch.testing.assert_close(grads_f[name], grad, rtol=1e-4, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
