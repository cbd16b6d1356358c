"""Bad input that used to train on garbage or end in a torch traceback: refused before anything loads, with
one message listing every problem (recipe numbers) or naming the file and line (records)."""

from __future__ import annotations

import math

import pytest

from toolkit.errors import ConfigError
from toolkit.recipe import resolve_recipe

BAD_NUMBERS = {
    "lr": (math.inf, "lr must be a finite number, got inf"),
    "adam_beta1": (1.0, "adam_beta1 must be in [0, 1), got 1.0"),
    "adam_beta2": (-0.1, "adam_beta2 must be in [0, 1), got -0.1"),
    "epochs": (0, "epochs must be positive when max_steps is 0, got 0"),
    "weight_decay": (-0.01, "weight_decay must be 0 or more, got -0.01"),
    "min_lr_ratio": (1.5, "min_lr_ratio must be between 0 and 1 (a fraction of --lr), got 1.5"),
    "adam_eps": (0.0, "adam_eps must be positive, got 0.0"),
    "max_grad_norm": (-1.0, "max_grad_norm must be 0 (no clipping) or more, got -1.0"),
}


@pytest.mark.parametrize("key", BAD_NUMBERS)
def test_an_optimizer_number_torch_would_misuse_is_refused(key):
    value, expected = BAD_NUMBERS[key]
    with pytest.raises(ConfigError) as error:
        resolve_recipe({"model": "tiny-llama", key: value})
    assert any(expected in p for p in error.value.problems), error.value.problems


def test_nan_lr_is_refused_not_compared():
    with pytest.raises(ConfigError) as error:
        resolve_recipe({"lr": math.nan})
    assert any("lr must be a finite number, got nan" in p for p in error.value.problems)


def test_every_bad_number_and_the_unknown_exporter_come_in_one_error():
    values = {key: value for key, (value, _) in BAD_NUMBERS.items()} | {"export": "hff"}
    with pytest.raises(ConfigError) as error:
        resolve_recipe(values)
    problems = error.value.problems
    assert len(problems) == len(BAD_NUMBERS) + 1
    assert any(p.startswith("export: unknown exporter 'hff' (did you mean 'hf'?)") for p in problems), problems


def test_sane_numbers_pass():
    recipe = resolve_recipe({"lr": 3e-4, "epochs": 0, "max_steps": 5, "min_lr_ratio": 1.0, "adam_beta1": 0.0,
                             "weight_decay": 0.1, "export": "hf"})
    assert (recipe.epochs, recipe.max_steps, recipe.export) == (0, 5, "hf")


def test_the_cli_refuses_a_bad_lr_before_loading_the_model(cli_runner, monkeypatch, tmp_path):
    import toolkit.builtins.loaders as loaders

    monkeypatch.setattr(loaders, "resolve_model", lambda *a, **k: pytest.fail("the model was loaded"))
    result = cli_runner.invoke("sft", "--model", "tiny-llama", "--lr", "inf", "--adam-beta2", "1",
                               "--export", "nope", "--output", str(tmp_path / "run"))
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "lr must be a finite number, got inf" in result.stderr
    assert "adam_beta2 must be in [0, 1), got 1.0" in result.stderr and "unknown exporter 'nope'" in result.stderr
    assert not (tmp_path / "run").exists()


def test_eval_samples_larger_than_the_data_names_the_flag_and_the_count(tmp_path, monkeypatch):
    import toolkit.builtins.strategies as strategies
    from toolkit.data.pipeline import load_examples
    from toolkit.train.runner import run_training
    from toolkit.builtins.loaders import resolve_model

    count = len(load_examples(["demo"], resolve_model("tiny-llama").tokenizer, seq_len=64)[0])
    monkeypatch.setattr(strategies.LocalStrategy, "build", lambda *a, **k: pytest.fail("the model was built"))
    with pytest.raises(ConfigError) as error:
        run_training(resolve_recipe({"eval_samples": count, "seq_len": 64, "output": str(tmp_path / "run")}))
    assert f"--eval-samples {count} holds out every example: the data has {count}" in str(error.value)
