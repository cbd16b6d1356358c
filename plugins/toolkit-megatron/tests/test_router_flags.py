"""The router-loss coefficients under --strategy megatron: the core's flags, the deprecated --megatron-moe-* aliases,
and a coefficient for a model without a router (one process, nothing trains)."""

from __future__ import annotations

import pytest

from toolkit.errors import ConfigError
from toolkit.recipe import resolve_recipe


def test_deprecated_megatron_coefficients_move_to_the_router_flags(capsys):
    recipe = resolve_recipe({"strategy": "megatron", "megatron": {"moe_aux_loss_coef": 0.1, "moe_z_loss_coef": 0.01}})
    assert (recipe.router_aux_loss_coef, recipe.router_z_loss_coef) == (0.1, 0.01)
    assert recipe.options["megatron"]["moe_aux_loss_coef"] is None
    lines = [line for line in capsys.readouterr().err.splitlines() if "deprecated" in line]
    assert lines == ["toolkit: --megatron-moe-aux-loss-coef (YAML megatron: moe_aux_loss_coef) is deprecated; use "
                     "--router-aux-loss-coef 0.1 (YAML router_aux_loss_coef: 0.1)",
                     "toolkit: --megatron-moe-z-loss-coef (YAML megatron: moe_z_loss_coef) is deprecated; use "
                     "--router-z-loss-coef 0.01 (YAML router_z_loss_coef: 0.01)"]
    with pytest.raises(ConfigError, match="--megatron-moe-aux-loss-coef 0.1 \\(deprecated\\) and --router-aux-loss-coef "
                                          "0.2 disagree: give --router-aux-loss-coef only"):
        resolve_recipe({"router_aux_loss_coef": 0.2, "megatron": {"moe_aux_loss_coef": 0.1}})


def test_two_deprecated_spellings_must_agree():
    """toolkit-moe's and megatron's old flags both feed --router-aux-loss-coef: the same value is one setting,
    different values are refused, naming both."""
    pytest.importorskip("toolkit_moe")
    same = resolve_recipe({"moe": {"aux_loss_coef": 0.1}, "megatron": {"moe_aux_loss_coef": 0.1}})
    assert same.router_aux_loss_coef == 0.1
    with pytest.raises(ConfigError) as info:
        resolve_recipe({"moe": {"aux_loss_coef": 0.1}, "megatron": {"moe_aux_loss_coef": 0.3}})
    text = str(info.value)
    assert "(deprecated) and" in text and "--moe-aux-loss-coef" in text and "--megatron-moe-aux-loss-coef" in text
    assert "give --router-aux-loss-coef only" in text


def test_a_coefficient_for_a_dense_model_is_refused(tmp_path):
    from toolkit.train.runner import run_training

    recipe = resolve_recipe({"model": "tiny-llama", "strategy": "megatron", "router_z_loss_coef": 0.01, "max_steps": 1,
                             "seq_len": 32, "max_samples": 4, "output": str(tmp_path / "run")})
    with pytest.raises(ConfigError, match="--router-z-loss-coef 0.01: model type 'llama' has no MoE router"):
        run_training(recipe)
