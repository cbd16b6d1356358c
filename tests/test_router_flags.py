"""--router-aux-loss-coef / --router-z-loss-coef on the HF path: the flag trains like the config key it
overrides, and a coefficient the plain HF model cannot use is refused before training."""

from __future__ import annotations

import json

import pytest

STEPS = {"dataset": ["demo"], "lr": 1e-3, "seq_len": 64, "max_steps": 3, "micro_batch_size": 2, "max_samples": 8}


def _train(tmp_path, name, **values):
    from toolkit.recipe import resolve_recipe
    from toolkit.train.runner import run_training

    recipe = resolve_recipe({"model": "tiny-qwen3-moe", "output": str(tmp_path / name), **STEPS, **values})
    run_dir = run_training(recipe)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_the_aux_flag_trains_like_the_model_config_value(tmp_path) -> None:
    from toolkit.models import materialize_preset

    configured = materialize_preset("tiny-qwen3-moe", tmp_path / "configured", router_aux_loss_coef=0.5)
    by_config = _train(tmp_path, "config", model=str(configured))
    by_flag = _train(tmp_path, "flag", router_aux_loss_coef=0.5)
    default = _train(tmp_path, "default")  # the preset's own coefficient (qwen3_moe: 0.001)
    keys = ("loss", "aux_loss", "grad_norm")
    assert [[m[k] for k in keys] for m in by_flag] == [[m[k] for k in keys] for m in by_config]
    assert by_flag[0]["aux_loss"] == pytest.approx(500 * default[0]["aux_loss"], rel=1e-5)
    assert by_flag[-1]["loss"] != default[-1]["loss"]  # the weight reached the gradients
    off = _train(tmp_path, "off", router_aux_loss_coef=0.0)
    assert "aux_loss" not in off[0]  # 0 turns the preset's own loss off


def test_a_z_loss_the_hf_model_cannot_compute_is_refused_before_training(tmp_path) -> None:
    from toolkit.errors import ConfigError

    with pytest.raises(ConfigError, match=r"--router-z-loss-coef 0.01: .*--moe-enabled.*--strategy megatron") as info:
        _train(tmp_path, "z", router_z_loss_coef=0.01)
    assert info.value.source == "--router-z-loss-coef"
    assert not (tmp_path / "z" / "metrics.jsonl").exists()
    assert _train(tmp_path, "zero", router_z_loss_coef=0.0)  # 0 is "off", which every path can do
    from toolkit.models import materialize_preset

    configured = materialize_preset("tiny-qwen3-moe", tmp_path / "configured", router_z_loss_coef=0.02)
    with pytest.raises(ConfigError, match="the model config's router_z_loss_coef 0.02: .*give --router-z-loss-coef 0"):
        _train(tmp_path, "config-z", model=str(configured))
    assert _train(tmp_path, "config-z-off", model=str(configured), router_z_loss_coef=0.0)
    with pytest.raises(ConfigError, match=r"\(llama\) computes no load-balancing loss"):
        _train(tmp_path, "dense", model="tiny-llama", router_aux_loss_coef=0.1)


def test_negative_coefficients_are_refused() -> None:
    from toolkit.errors import ConfigError
    from toolkit.recipe import resolve_recipe

    with pytest.raises(ConfigError) as info:
        resolve_recipe({"router_aux_loss_coef": -0.1, "router_z_loss_coef": float("nan")})
    assert "router_aux_loss_coef must be 0 (off) or more, got -0.1" in str(info.value)
    assert "router_z_loss_coef must be 0 (off) or more, got nan" in str(info.value)
