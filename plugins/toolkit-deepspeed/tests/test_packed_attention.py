"""``--deepspeed-packed-attention``: packed rows through FlexAttention under ZeRO give the masked-SDPA step.

One process, on CPU, where ``cpu_flex_backward`` (toolkit.testing) lifts torch's refusal of FlexAttention's
backward there; ``auto`` resolves to flex on CUDA only (tested in the core's tests/test_packed_attention.py).
"""

from __future__ import annotations

import pytest

from toolkit.contracts import StepContext
from toolkit.testing import packed_batch

pytest.importorskip("torch.nn.attention.flex_attention")

ROWS, LENGTH = [[7, 9, 5], [24], [15]], 24  # three samples packed + padding; one filling its row; one padded


def zero_engine(packed: str, stage: int):
    from toolkit.builtins.losses import SFTLoss
    from toolkit.builtins.tuners import FullTuner
    from toolkit.models import resolve_model
    from toolkit.plugins import get_plugin_manager
    from toolkit.recipe import resolve_recipe

    recipe = resolve_recipe({"model": "tiny-llama", "lr": 1e-3, "precision": "fp32", "packing": True,
                             "strategy": "deepspeed", "zero": stage, "deepspeed": {"packed_attention": packed}})
    cls = get_plugin_manager().get("strategy", "deepspeed")
    strategy = cls(cls.Config(packed_attention=packed))
    engine = strategy.build(resolve_model("tiny-llama"), FullTuner(), SFTLoss(), recipe)
    engine.set_total_steps(2)
    return engine, SFTLoss()


@pytest.mark.parametrize("stage", [2, 3])
def test_a_zero_step_with_flex_equals_masked_sdpa(cpu_flex_backward, flex_calls, stage):
    results = {}
    for packed in ("sdpa-mask", "flex"):
        engine, loss = zero_engine(packed, stage)
        try:
            assert engine.packed_attention == packed
            batch = packed_batch(ROWS, LENGTH, 768)
            ctx = StepContext(label_tokens=int((batch["labels"] != -100).sum()), sequences=5, examples=5)
            step = engine.train_step([batch], loss, ctx)
            results[packed] = step.loss, step.grad_norm
        finally:
            engine.close()
    assert flex_calls, "the flex engine never ran FlexAttention"
    (loss_m, norm_m), (loss_f, norm_f) = results["sdpa-mask"], results["flex"]
    assert loss_f == pytest.approx(loss_m, rel=1e-6) and norm_f == pytest.approx(norm_m, rel=1e-5)


def test_auto_stays_on_masked_sdpa_on_cpu_and_forced_flex_there_is_refused():
    from toolkit.errors import ConfigError

    engine, _ = zero_engine("auto", 2)
    try:
        assert engine.packed_attention == "sdpa-mask"
    finally:
        engine.close()
    with pytest.raises(ConfigError, match="--deepspeed-packed-attention flex: torch .* has no FlexAttention backward on cpu"):
        zero_engine("flex", 2)
