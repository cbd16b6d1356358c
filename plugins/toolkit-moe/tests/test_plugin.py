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
    """The same --router-aux-loss-coef trains the same objective through transformers' blocks (the plain HF
    path: transformers' load_balancing_loss_func per layer, averaged) and ours: equal losses, router losses and
    gradient norms over the steps, with a weight large enough to move the gradient."""
    hf = _train(tmp_path, "hf", router_aux_loss_coef=0.5)
    ours = _train(tmp_path, "ours", router_aux_loss_coef=0.5, moe={"enabled": True, "experts_backend": "loop"})
    off = _train(tmp_path, "off", router_aux_loss_coef=0.0)
    assert "moe_max_load" in ours[0] and "moe_max_load" not in hf[0]  # the blocks were replaced
    assert abs(hf[0]["grad_norm"] - off[0]["grad_norm"]) > 1e-3 * hf[0]["grad_norm"]  # the aux loss is felt
    for a, b in zip(hf, ours, strict=True):
        for key in ("loss", "aux_loss", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-5), (key, a, b)


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


def test_patched_blocks_take_the_router_flags_like_the_model_config(tmp_path) -> None:
    """--router-aux-loss-coef / --router-z-loss-coef, the deprecated moe: fields and the model config's keys
    (the default) train the patched blocks the same; the flags are not a no-op."""
    from toolkit.models import materialize_preset

    configured = materialize_preset("tiny-qwen3-moe", tmp_path / "configured", router_aux_loss_coef=0.2,
                                    router_z_loss_coef=0.05)
    moe = {"enabled": True, "experts_backend": "loop"}
    by_config = _train(tmp_path, "config", model=str(configured), moe=moe)
    by_flags = _train(tmp_path, "flags", router_aux_loss_coef=0.2, router_z_loss_coef=0.05, moe=moe)
    by_old = _train(tmp_path, "old", moe={**moe, "aux_loss_coef": 0.2, "z_loss_coef": 0.05})
    default = _train(tmp_path, "default", moe=moe)
    keys = ("loss", "aux_loss", "grad_norm", "moe_aux_loss", "moe_z_loss")
    rows = [[[m[k] for k in keys] for m in run] for run in (by_config, by_flags, by_old)]
    assert rows[0] == rows[1] == rows[2]
    assert by_flags[0]["aux_loss"] > 10 * default[0]["aux_loss"] and by_flags[-1]["loss"] != default[-1]["loss"]


def test_deprecated_moe_coefficients_move_to_the_router_flags(capsys) -> None:
    """The old flags still work: one deprecation line each, the value lands on the core's flag; a different
    value given both ways is refused."""
    from toolkit.errors import ConfigError
    from toolkit.recipe import resolve_recipe

    recipe = resolve_recipe({"model": "tiny-qwen3-moe", "moe": {"enabled": True, "aux_loss_coef": 0.1, "z_loss_coef": 0.01}})
    assert (recipe.router_aux_loss_coef, recipe.router_z_loss_coef) == (0.1, 0.01)
    assert recipe.options["moe"]["aux_loss_coef"] is None and recipe.options["moe"]["z_loss_coef"] is None
    lines = [line for line in capsys.readouterr().err.splitlines() if "deprecated" in line]
    assert lines == ["toolkit: --moe-aux-loss-coef (YAML moe: aux_loss_coef) is deprecated; use --router-aux-loss-coef "
                     "0.1 (YAML router_aux_loss_coef: 0.1)",
                     "toolkit: --moe-z-loss-coef (YAML moe: z_loss_coef) is deprecated; use --router-z-loss-coef 0.01 "
                     "(YAML router_z_loss_coef: 0.01)"]
    assert resolve_recipe({"router_z_loss_coef": 0.01, "moe": {"z_loss_coef": 0.01}}).router_z_loss_coef == 0.01
    with pytest.raises(ConfigError, match="--moe-z-loss-coef 0.01 \\(deprecated\\) and --router-z-loss-coef 0.02 "
                                          "disagree: give --router-z-loss-coef only"):
        resolve_recipe({"router_z_loss_coef": 0.02, "moe": {"z_loss_coef": 0.01}})


def test_old_flag_strings_parse_through_the_cli() -> None:
    """``--moe-aux-loss-coef`` is still a flag of ``toolkit sft`` (a deprecated alias), not an unknown option."""
    import subprocess
    import sys

    args = ["sft", "--model", "tiny-qwen3-moe", "--moe-aux-loss-coef", "0.3", "--router-aux-loss-coef", "0.4"]
    result = subprocess.run([sys.executable, "-m", "toolkit", *args], capture_output=True, text=True)
    assert result.returncode != 0
    assert "--moe-aux-loss-coef 0.3 (deprecated) and --router-aux-loss-coef 0.4 disagree" in result.stderr + result.stdout


def test_a_run_saved_with_the_old_fields_resumes_with_the_new_flag(tmp_path) -> None:
    """recipe.yaml of a run started before the rename holds ``moe: {z_loss_coef: ...}``: resuming it with
    --router-z-loss-coef at the same value is the same training, another value a change."""
    import yaml

    from toolkit.errors import ConfigError
    from toolkit.recipe import resolve_recipe
    from toolkit.train.runner import check_resume_changes

    def recipe(z):
        return resolve_recipe({"model": "tiny-qwen3-moe", "output": str(tmp_path), "resume": "auto",
                               "router_z_loss_coef": z, "moe": {"enabled": True}})

    saved = recipe(0.01).to_yaml_dict()
    del saved["router_z_loss_coef"], saved["router_aux_loss_coef"]
    saved["moe"]["z_loss_coef"] = 0.01
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(saved))
    check_resume_changes(recipe(0.01), is_main=True)
    with pytest.raises(ConfigError, match=r"router_z_loss_coef: 0.01 -> 0.02"):
        check_resume_changes(recipe(0.02), is_main=True)
