"""--on-nan: a non-finite loss or gradient norm is caught on its step; skip, stop and rollback do what they say."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import nan_plugin
import pytest
import torch
from safetensors.torch import load_file

from toolkit.recipe import resolve_recipe
from toolkit.testing import run_distributed, write_plugin_distribution

RECORDS = 12
POISONED_LINE = 5


def write_dataset(path: Path, poison: str = "loss", lines: tuple[int, ...] = (POISONED_LINE,)) -> Path:
    rows = []
    for line in range(1, RECORDS + 1):
        row = {"messages": [{"role": "user", "content": f"What is {line} plus {line}?"},
                            {"role": "assistant", "content": f"It is {2 * line}."}]}
        if line in lines:
            row["poison"] = poison
        rows.append(json.dumps(row))
    path.write_text("\n".join(rows) + "\n")
    return path


def recipe_for(dataset: Path, output: Path, **overrides):
    values = {"model": "tiny-llama", "dataset": [str(dataset)], "dataset_format": "poisoned", "loss": "nan-sft",
              "output": str(output), "seq_len": 64, "lr": 1e-2, "max_steps": 6, "micro_batch_size": 1,
              "global_batch_size": 2, "save_every": 1, "keep_last": 10, "precision": "bf16", "schedule": "linear",
              "warmup_steps": 1, **overrides}
    return resolve_recipe(values)


def events(run_dir: Path) -> list[dict]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [line for line in lines if line.get("event") == "nonfinite"]


def reference_weights(recipe, skip_step: int | None) -> dict[str, torch.Tensor]:
    """A plain loop over the engine that never feeds the 0-based ``skip_step``: what skipping must equal."""
    from toolkit.data.pipeline import Batches, load_examples
    from toolkit.models import resolve_model
    from toolkit.train.runner import resolve_components

    strategy, tuner, loss, recipe = resolve_components(recipe, 1)
    source = resolve_model(recipe.model)
    examples, _ = load_examples(recipe.dataset, source.tokenizer, dataset_format=recipe.dataset_format, seq_len=recipe.seq_len)
    engine = strategy.build(source, tuner, loss, recipe)
    batches = Batches(examples, seed=recipe.seed, seq_len=recipe.seq_len, packing=False, micro_batch_size=recipe.micro_batch_size,
                      global_batch_size=recipe.global_batch_size, dp_rank=0, dp_world_size=1, pad_id=0,
                      group_by_length=recipe.group_by_length)  # the runner's order
    engine.set_total_steps(recipe.max_steps)
    for step in range(recipe.max_steps):
        if step != skip_step:
            assert engine.train_step(batches.micro_batches(step), loss, batches.context(step)).applied
    if engine.master is not None:
        return engine.master.state_dict()
    return {k: v.detach().clone() for k, v in engine.model.state_dict().items()}


def saved_weights(run_dir: Path, step: int, precision: str = "bf16") -> dict[str, torch.Tensor]:
    name = "master.safetensors" if precision == "bf16" else "model.safetensors"
    return load_file(str(run_dir / "checkpoints" / f"step-{step}" / name))


@pytest.fixture
def nan_manager(toolkit_manager):
    return toolkit_manager(("nan-plugin", nan_plugin), installed=False)


def test_skip_drops_exactly_the_poisoned_update_under_bf16_master_weights(tmp_path, nan_manager, capsys):
    from toolkit.train.runner import run_training

    data = write_dataset(tmp_path / "data.jsonl", poison="loss")
    recipe = recipe_for(data, tmp_path / "skip", on_nan="skip")
    run_training(recipe)
    (event,) = events(tmp_path / "skip")
    assert event["quantities"] == ["loss"] and event["action"] == "skip" and event["loss"] is None
    assert f"{data}, line {POISONED_LINE}" in event["samples"] and len(event["samples"]) == 2
    assert f"line {POISONED_LINE}" in capsys.readouterr().err
    bad = event["step"]
    before = saved_weights(tmp_path / "skip", bad - 1) if bad > 1 else None
    after = saved_weights(tmp_path / "skip", bad)
    if before is not None:
        for key in after:  # the skipped step changed nothing
            assert torch.equal(before[key], after[key]), key
    final = saved_weights(tmp_path / "skip", 6)
    expected = reference_weights(recipe, skip_step=bad - 1)
    assert all(torch.isfinite(v).all() for v in final.values())
    assert final.keys() <= expected.keys() and final
    for key, value in final.items():
        torch.testing.assert_close(value, expected[key], rtol=0, atol=0)
    state = json.loads((tmp_path / "skip/checkpoints/step-6/trainer_state.json").read_text())
    assert state["step"] == 6


def test_rollback_equals_never_seeing_the_batch(tmp_path, nan_manager):
    from toolkit.train.runner import run_training

    data = write_dataset(tmp_path / "data.jsonl", poison="grad")
    recipe = recipe_for(data, tmp_path / "rollback", on_nan="rollback", save_every=2)
    run_training(recipe)
    (event,) = events(tmp_path / "rollback")
    assert event["quantities"] == ["grad_norm"] and event["action"] == "rollback"
    assert event["checkpoint"].endswith(f"step-{2 * ((event['step'] - 1) // 2)}")
    final = saved_weights(tmp_path / "rollback", 6)
    expected = reference_weights(recipe, skip_step=event["step"] - 1)
    assert final.keys() <= expected.keys() and final
    for key, value in final.items():
        torch.testing.assert_close(value, expected[key], rtol=0, atol=0)
    state = json.loads((tmp_path / "rollback/checkpoints/step-6/trainer_state.json").read_text())
    assert state["skipped_steps"] == [event["step"] - 1]
    logged = [json.loads(line)["step"] for line in (tmp_path / "rollback/metrics.jsonl").read_text().splitlines()]
    assert sorted(logged) == [1, 2, 3, 4, 5, 6]  # replayed steps are not logged twice


def test_stop_names_step_samples_and_last_checkpoint_and_saves_nothing_new(tmp_path, nan_manager):
    from toolkit.train.numerics import NumericalError
    from toolkit.train.runner import run_training

    data = write_dataset(tmp_path / "data.jsonl", poison="grad")
    with pytest.raises(NumericalError) as caught:
        run_training(recipe_for(data, tmp_path / "stop"))  # stop is the default
    (event,) = events(tmp_path / "stop")
    bad = event["step"]
    message = str(caught.value)
    assert f"step {bad}:" in message and "grad_norm" in message and f"{data}, line {POISONED_LINE}" in message
    saved = sorted(int(p.name.split("-")[1]) for p in (tmp_path / "stop/checkpoints").glob("step-*"))
    assert saved == list(range(1, bad))
    assert (f"step-{bad - 1}" in message) if bad > 1 else ("no checkpoint" in message)


def test_skip_gives_up_after_max_nan_steps_in_a_row(tmp_path, nan_manager):
    from toolkit.train.numerics import NumericalError
    from toolkit.train.runner import run_training

    data = write_dataset(tmp_path / "data.jsonl", lines=tuple(range(1, RECORDS + 1)))
    with pytest.raises(NumericalError, match="3 non-finite steps in a row"):
        run_training(recipe_for(data, tmp_path / "run", on_nan="skip", max_nan_steps=3))
    assert [e["action"] for e in events(tmp_path / "run")] == ["skip", "skip", "stop"]


def test_rollback_before_the_first_checkpoint_stops(tmp_path, nan_manager):
    from toolkit.train.numerics import NumericalError
    from toolkit.train.runner import run_training

    data = write_dataset(tmp_path / "data.jsonl", poison="loss")
    with pytest.raises(NumericalError, match="no checkpoint to roll back to yet"):
        run_training(recipe_for(data, tmp_path / "run", on_nan="rollback", save_every=0))
    assert not (tmp_path / "run/checkpoints").exists()


def test_skip_is_refused_for_an_engine_that_updates_before_checking(tmp_path, nan_manager):
    from toolkit.errors import ConfigError
    from toolkit.train.numerics import NonFiniteGuard

    class PostCheckEngine:
        is_main = True
        skips_nonfinite_updates = False

    with pytest.raises(ConfigError, match="--on-nan rollback"):
        NonFiniteGuard.for_run(recipe_for(tmp_path / "x.jsonl", tmp_path, on_nan="skip"), PostCheckEngine(), tmp_path)
    assert NonFiniteGuard.for_run(recipe_for(tmp_path / "x.jsonl", tmp_path, on_nan="rollback"), PostCheckEngine(), tmp_path)


@pytest.mark.slow
def test_nan_on_one_ddp_rank_is_skipped_on_both(tmp_path, nan_manager):
    """The poisoned sample sits on one rank and only its loss is NaN (its gradients are finite): a rank
    that looked only at its own loss would step while the other does not, and the weights would differ."""
    data = write_dataset(tmp_path / "data.jsonl", poison="loss")
    site = tmp_path / "site"
    write_plugin_distribution(site, "toolkit-nan-test", Path(nan_plugin.__file__).read_text(), module="toolkit_nan_test")
    run_dir = tmp_path / "ddp"
    args = ["-m", "toolkit", "train", "--model", "tiny-llama", "--dataset", str(data), "--dataset-format", "poisoned",
            "--loss", "nan-sft", "--output", str(run_dir), "--seq-len", "64", "--lr", "1e-2", "--max-steps", "6",
            "--micro-batch-size", "1", "--global-batch-size", "2", "--save-every", "6", "--schedule", "linear",
            "--warmup-steps", "1", "--on-nan", "skip"]
    env = {"PYTHONPATH": os.pathsep.join([str(site), *sys.path]), "TOOLKIT_PLUGINS": "nan-test"}
    run_distributed(args, nproc=2, env=env, timeout=240)
    (event,) = events(run_dir)
    assert event["action"] == "skip" and event["quantities"] == ["loss"]
    recipe = recipe_for(data, tmp_path / "unused", precision="fp32")
    expected = reference_weights(recipe, skip_step=event["step"] - 1)
    final = saved_weights(run_dir, 6, precision="fp32")
    assert final.keys() <= expected.keys() and final
    for key, value in final.items():
        torch.testing.assert_close(value, expected[key], rtol=1e-4, atol=2e-5)
