"""The plugin as users meet it: registration, the moe: section, and a training run through the runner."""

from __future__ import annotations

import json

import pytest


def test_plugin_registers_the_moe_architecture_without_torch() -> None:
    import subprocess
    import sys

    code = ("import sys; from toolkit.plugins import get_plugin_manager; m = get_plugin_manager(); "
            "print(m.registry('architecture').get('moe').families, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "('qwen2_moe', 'qwen3_moe', 'mixtral') False"


def test_moe_section_is_validated() -> None:
    from toolkit.errors import ConfigError
    from toolkit.recipe import resolve_recipe

    recipe = resolve_recipe({"model": "tiny-qwen3-moe", "moe": {"enabled": True, "capacity_factor": "1.25"}})
    assert recipe.options["moe"]["capacity_factor"] == 1.25
    with pytest.raises(ConfigError) as info:
        resolve_recipe({"moe": {"capacity_factor": -1, "experts_backend": "cuda"}})
    text = str(info.value)
    assert "capacity_factor must be 0" in text and "experts_backend" in text


def _train(tmp_path, name, **values):
    from toolkit.recipe import resolve_recipe
    from toolkit.train.runner import run_training

    recipe = resolve_recipe({"model": "tiny-qwen3-moe", "dataset": ["demo"], "output": str(tmp_path / name), "lr": 1e-3,
                             "seq_len": 64, "max_steps": 3, "micro_batch_size": 2, "max_samples": 8, **values})
    run_dir = run_training(recipe)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_training_with_patched_blocks_follows_hf(tmp_path) -> None:
    """Same first-step loss as transformers' blocks, our aux loss reaches the engine, training proceeds."""
    hf = _train(tmp_path, "hf")
    ours = _train(tmp_path, "ours", moe={"enabled": True, "experts_backend": "loop"})
    assert ours[0]["loss"] == pytest.approx(hf[0]["loss"], rel=1e-5)
    for a, b in zip(hf, ours):
        assert b["loss"] == pytest.approx(a["loss"], rel=2e-3)  # aux losses differ slightly: per layer vs all layers
    assert ours[0]["aux_loss"] == pytest.approx(hf[0]["aux_loss"], rel=0.1)
    # ...but not equal: ours is a mean of per-layer losses, proof that the blocks were replaced
    assert ours[0]["aux_loss"] != hf[0]["aux_loss"]


def test_expert_parallel_is_the_local_strategys_ep_axis_and_refused_elsewhere(tmp_path) -> None:
    """--ep is toolkit-moe's axis under --strategy local only: fsdp is refused before any model loads."""
    from toolkit.errors import LayoutError
    from toolkit.plugins import get_plugin_manager

    manager = get_plugin_manager()
    assert "ep" in manager.parallel_axes(manager.get("strategy", "local"))
    assert "ep" not in manager.parallel_axes(manager.get("strategy", "fsdp"))
    with pytest.raises(LayoutError, match="--ep 2 .*--strategy fsdp splits models along data parallelism only"):
        _train(tmp_path, "ep", strategy="fsdp", expert_parallel=2, moe={"enabled": True})


def test_expert_parallel_without_moe_blocks_is_refused(tmp_path) -> None:
    from toolkit.errors import ConfigError, ModelError

    with pytest.raises(ConfigError, match="add --moe-enabled"):
        _train(tmp_path, "off", expert_parallel=2)
    with pytest.raises(ModelError, match="does not know model type 'llama'"):
        _train(tmp_path, "dense", model="tiny-llama", expert_parallel=2, moe={"enabled": True})


def test_deprecated_moe_expert_parallel_moves_to_ep(capsys) -> None:
    """The old flag still works: one deprecation line, the value lands on the layout's ep axis."""
    from toolkit.errors import ConfigError
    from toolkit.recipe import resolve_recipe

    recipe = resolve_recipe({"model": "tiny-qwen3-moe", "moe": {"enabled": True, "expert_parallel": 2}})
    assert recipe.expert_parallel == 2 and recipe.options["moe"]["expert_parallel"] is None
    lines = [line for line in capsys.readouterr().err.splitlines() if "deprecated" in line]
    assert lines == ["toolkit: --moe-expert-parallel (YAML moe: expert_parallel) is deprecated; use --ep 2 (YAML expert_parallel: 2)"]
    assert resolve_recipe({"expert_parallel": 2, "moe": {"expert_parallel": 2}}).expert_parallel == 2
    with pytest.raises(ConfigError, match="disagree: give --ep only"):
        resolve_recipe({"expert_parallel": 4, "moe": {"expert_parallel": 2}})
