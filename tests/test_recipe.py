"""Recipes: YAML + flags merged into typed dataclasses, one validation pass reporting every problem."""

from __future__ import annotations

import pytest

from conftest import PROBE_FLAGS, PROBE_YAML, ProbeLoss, ProbeTuner
from toolkit.config import coerce
from toolkit.errors import ConfigError
from toolkit.recipe import Recipe, read_yaml, resolve_recipe, thing_options

PROBE = {"loss": "probe", "strategy": "probe-strategy", "tuner": "probe-tuner"}


def test_a_yaml_recipe_becomes_typed_options(probe_manager, tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(PROBE_YAML + "lr: 3e-4\nmax_steps: 5\ndataset: data.jsonl\nprecision: bf16\n"
                    "columns: {instruction: question}\nprobe: {weight: 2, mode: sum}\nprobe-tuner: {layers: [0, 1]}\n")
    recipe = resolve_recipe(read_yaml(path), source=str(path), manager=probe_manager)
    assert (recipe.lr, recipe.max_steps, recipe.dataset, recipe.precision) == (3e-4, 5, ["data.jsonl"], "bf16")
    assert recipe.columns == {"instruction": "question"}
    assert thing_options(recipe, ProbeLoss) == ProbeLoss.Config(weight=2.0, mode="sum")
    assert thing_options(recipe, ProbeTuner).layers == [0, 1]


def test_every_problem_is_reported_at_once(probe_manager, tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(PROBE_YAML + "lr: fast\nmax_step: 3\nprecision: fp8\nseq_len: 0\n"
                    "probe: {weight: heavy, mod: sum}\nstrategyy: local\n")
    with pytest.raises(ConfigError) as error:
        resolve_recipe(read_yaml(path), source=str(path), manager=probe_manager)
    problems = error.value.problems
    message = str(error.value)
    assert message.startswith(f"invalid configuration in {path}:")
    expected = ["lr: expected a number, got 'fast'",
                "unknown key 'max_step'; did you mean 'max_steps'?",
                "precision: expected one of 'fp32', 'bf16', 'fp16', got 'fp8'",
                "seq_len must be at least 1, got 0",
                "probe.weight: expected a number, got 'heavy'",
                "probe: unknown key 'mod'; did you mean 'mode'?",
                "unknown key 'strategyy'; did you mean 'strategy'?"]
    for text in expected:
        assert any(text in p for p in problems), (text, problems)
    assert len(problems) == len(expected)


def test_option_sections_must_be_mappings_of_registered_things(probe_manager):
    with pytest.raises(ConfigError) as error:
        resolve_recipe({**PROBE, "probe": 3, "prob": {"weight": 1}, "options": {"nosuch": {"a": 1}}}, manager=probe_manager)
    assert error.value.problems == [
        "probe: expected a mapping of option: value (e.g. probe: {...}), got 3",
        "unknown key 'prob'; did you mean 'probe'?",
        "options: 'nosuch' is not a registered strategy, tuner, loss or dataset format with a mapping of options",
    ]
    recipe = resolve_recipe({**PROBE, "options": {"probe": {"weight": 5}}}, manager=probe_manager)
    assert thing_options(recipe, ProbeLoss).weight == 5.0


def test_unknown_registered_names_are_problems_with_install_hints(probe_manager):
    with pytest.raises(ConfigError) as error:
        resolve_recipe({**PROBE, "strategy": "megatron", "tuner": "lora", "loss": "nope"}, manager=probe_manager)
    message = str(error.value)
    assert "strategy: strategy 'megatron' is not installed: pip install toolkit-megatron" in message
    assert "tuner: tuner 'lora' is not installed: pip install toolkit-peft" in message
    assert "loss: unknown loss 'nope'" in message and "Installed losses: " in message


def test_a_section_of_a_plugin_that_is_not_installed_names_the_plugin(probe_manager):
    with pytest.raises(ConfigError) as error:
        resolve_recipe({**PROBE, "moe": {"enabled": True}, "deepspeed": {"stage": 3}, "sed": 1}, manager=probe_manager)
    message = str(error.value)
    assert "section 'moe' holds the options of toolkit-moe, which is not installed: pip install toolkit-moe" in message
    assert "-e plugins/toolkit-deepspeed" in message and "did you mean 'seed'" in message.split("'sed'")[1]
    assert "did you mean 'seed'" not in message.split("'sed'")[0]


def test_yaml_syntax_errors_name_the_line(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("lr: 1e-4\nmodel: [tiny\n")
    with pytest.raises(ConfigError, match=r"broken.yaml is not valid YAML at line \d+, column \d+"):
        read_yaml(path)
    path.write_text("- just\n- a list\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        read_yaml(path)
    with pytest.raises(ConfigError, match="does not exist"):
        read_yaml(tmp_path / "missing.yaml")


@pytest.mark.parametrize(("value", "tp", "expected"), [
    ("3", int, 3), (2.0, int, 2), ("1e3", int, 1000), ("0.5", float, 0.5), ("yes", bool, True), ("off", bool, False),
    ("none", str | None, None), (None, str | None, None), ("x", list[str], ["x"]), (["1", 2], list[int], [1, 2]),
])
def test_coerce_accepts_what_yaml_and_flags_produce(value, tp, expected):
    assert coerce(value, tp) == expected


@pytest.mark.parametrize(("value", "tp"), [(True, int), (2.5, int), ("x", float), ("maybe", bool), ([1], str), ("x", dict[str, str])])
def test_coerce_rejects_wrong_types(value, tp):
    with pytest.raises(ValueError, match="expected"):
        coerce(value, tp)


def test_flags_override_the_yaml_recipe(probe_manager, cli_runner, captured_runs, tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(PROBE_YAML + "lr: 3e-4\nmax_steps: 5\nprobe: {weight: 2, mode: sum}\npacking: true\n")
    result = cli_runner.invoke("train", "--config", path, "--max-steps", "7", "--probe-weight", "4", "--no-packing",
                               "--dataset", "a.jsonl", "--dataset", "b.jsonl", "--columns", "prompt=question")
    assert result.exit_code == 0, result.output
    (recipe,) = captured_runs
    assert isinstance(recipe, Recipe)
    assert (recipe.lr, recipe.max_steps, recipe.packing, recipe.dataset) == (3e-4, 7, False, ["a.jsonl", "b.jsonl"])
    assert recipe.columns == {"prompt": "question"}
    assert thing_options(recipe, ProbeLoss) == ProbeLoss.Config(weight=4.0, mode="sum")  # flag and YAML merged


def test_flags_left_out_keep_defaults(probe_manager, cli_runner, captured_runs):
    result = cli_runner.invoke("probe", *PROBE_FLAGS[2:], "--tp", "2", "--probe-warm")
    assert result.exit_code == 0, result.output
    (recipe,) = captured_runs
    assert recipe.loss == "probe" and recipe.tensor_parallel == 2 and recipe.packing is False
    assert thing_options(recipe, ProbeLoss) == ProbeLoss.Config(warm=True)


def test_a_bad_recipe_on_the_cli_lists_every_problem_without_a_traceback(probe_manager, cli_runner, captured_runs, tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(PROBE_YAML + "lr: fast\nmax_step: 3\n")
    result = cli_runner.invoke("train", "--config", path, "--micro-batch-size", "0")
    assert result.exit_code == 1 and captured_runs == []
    assert "Traceback" not in result.output
    lines = result.stderr.strip().splitlines()
    assert lines[0] == f"Error: invalid configuration in {path}:"
    assert [line for line in lines if line.startswith("  - ")] == [
        "  - unknown key 'max_step'; did you mean 'max_steps'?",
        f"  - {path}.lr: expected a number, got 'fast'",
        f"  - {path}: micro_batch_size must be at least 1, got 0",
    ]


def test_a_loss_command_refuses_a_recipe_for_another_loss(probe_manager, cli_runner, captured_runs, tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("loss: dpo\n")
    result = cli_runner.invoke("probe", "--config", path)
    assert result.exit_code == 2 and captured_runs == []
    assert "'toolkit probe' trains with loss 'probe'; the recipe asks for 'dpo'" in result.stderr
