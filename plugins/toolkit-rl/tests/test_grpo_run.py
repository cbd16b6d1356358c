"""End to end on the tiny preset: toolkit grpo trains, logs, samples rollouts, resumes exactly, refuses bad input."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from toolkit.recipe import resolve_recipe

os.environ.setdefault("HF_HUB_OFFLINE", "1")
VOWELS = f"{Path(__file__).parent / 'toy_rewards.py'}:vowels"

BASE = {"model": "tiny-llama", "dataset": ["demo"], "loss": "grpo", "max_samples": 16, "micro_batch_size": 4,
        "seq_len": 96, "lr": 1e-2, "schedule": "constant", "seed": 3,
        "grpo": {"rewards": ["answer:1", VOWELS], "num_generations": 4, "prompts_per_rollout": 2,
                 "max_completion_length": 6}, "answer": {"mode": "contains"}}


def run(tmp_path, name, **overrides):
    from toolkit_rl.loop import run_grpo

    values = {**BASE, "output": str(tmp_path / name), **overrides}
    values["grpo"] = {**BASE["grpo"], **overrides.get("grpo", {})}
    return run_grpo(resolve_recipe(values))


def metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_cli_trains_logs_and_samples_rollouts(tmp_path, cli_runner):
    out = tmp_path / "cli"
    result = cli_runner.invoke("grpo", "--model", "tiny-llama", "--dataset", "demo", "--max-samples", "8",
                               "--reward", "answer", "--reward", "length:0.1", "--num-generations", "4",
                               "--grpo-prompts-per-rollout", "2", "--max-completion-length", "6", "--grpo-beta", "0.04",
                               "--loss-type", "dapo", "--max-steps", "2", "--micro-batch-size", "4", "--seq-len", "96",
                               "--output", str(out))
    assert result.exit_code == 0, result.output
    lines = metrics(out)
    assert [m["step"] for m in lines] == [1, 2]
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "reward/mean", "reward/std", "rewards/answer/mean",
                "rewards/length/std", "completion_length", "clip_ratio/region", "kl", "entropy", "rollout_time",
                "train_time", "groups_dropped"):
        assert key in lines[0], key
    rollouts = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    assert {r["step"] for r in rollouts} == {1, 2} and rollouts[0]["prompt"].endswith("assistant\n")
    assert set(rollouts[0]["rewards"]) == {"answer", "length"}
    assert (out / "checkpoints" / "step-2").is_dir() and (out / "recipe.yaml").is_file()


def test_rollouts_use_the_weights_of_the_last_step(tmp_path, monkeypatch):
    """One optimizer step per rollout batch: the rollout policy IS the trained policy, so every ratio is 1 and
    the clipped objective is minus the mean advantage, zero per group. A stale rollout model breaks that."""
    from toolkit_rl import loop

    grpo = {"steps_per_rollout": 1, "iterations": 1}
    fresh = metrics(run(tmp_path, "fresh", max_steps=3, grpo=grpo))
    assert all(abs(m["loss"]) < 1e-6 for m in fresh), [m["loss"] for m in fresh]
    monkeypatch.setattr(loop.GRPORun, "sync_weights", lambda self: None)
    stale = metrics(run(tmp_path, "stale", max_steps=3, grpo=grpo))
    assert max(abs(m["loss"]) for m in stale[1:]) > 1e-5, [m["loss"] for m in stale]


def test_resume_is_exact(tmp_path):
    """Prompt order, rollout sampling and weights continue as if never stopped (two optimizer steps per batch)."""
    from safetensors.torch import load_file

    grpo = {"steps_per_rollout": 2, "iterations": 1, "loss_type": "gspo"}
    straight = run(tmp_path, "straight", max_steps=6, save_every=2, grpo=grpo)
    stopped = run(tmp_path, "resumed", max_steps=6, save_every=2, stop_after=2, grpo=grpo)
    assert sorted(p.name for p in (stopped / "checkpoints").iterdir()) == ["step-2"]
    resumed = run(tmp_path, "resumed", max_steps=6, save_every=2, resume="auto", grpo=grpo)
    a, b = load_file(straight / "checkpoints/step-6/model.safetensors"), load_file(resumed / "checkpoints/step-6/model.safetensors")
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    timing = {"tokens_per_s", "train_time", "rollout_time"}
    clean = [{k: v for k, v in m.items() if k not in timing} for m in metrics(straight)]
    again = [{k: v for k, v in m.items() if k not in timing} for m in metrics(resumed)]
    assert clean == again
    assert (straight / "rollouts.jsonl").read_text() == (resumed / "rollouts.jsonl").read_text()


def test_a_dying_rollout_backend_names_itself_and_the_run_saves(tmp_path, monkeypatch):
    from toolkit_rl import rollout
    from toolkit_rl.rollout import RolloutError

    calls = {"n": 0}
    generate = rollout.HFRollouts.generate

    def flaky(self, prompts, seed):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("engine process exited")
        return generate(self, prompts, seed)

    monkeypatch.setattr(rollout.HFRollouts, "generate", flaky)
    with pytest.raises(RolloutError, match=r"rollout backend 'hf' failed before step 3: RuntimeError: engine process "
                                           r"exited \(checkpoint .*step-2; continue with --resume auto\)"):
        run(tmp_path, "dies", max_steps=4)
    assert (tmp_path / "dies" / "checkpoints" / "step-2").is_dir()


def write(path, lines):
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return str(path)


@pytest.mark.parametrize("args,message", [
    (["--reward", "answer", "--dataset", "BAD"], r"bad.jsonl, record 2: a prompt record needs a 'prompt'"),
    (["--reward", "answer", "--dataset", "LONG", "--seq-len", "20"], r"long.jsonl, record 1: the prompt has \d+ tokens"),
    (["--dataset", "demo"], "needs at least one --reward"),
    (["--reward", "nope", "--dataset", "demo"], "unknown reward 'nope'"),
    (["--reward", "answer", "--dataset", "demo", "--save-every", "3", "--grpo-steps-per-rollout", "2"],
     "must be a multiple of the 2 optimizer steps"),
])
def test_bad_input_is_named_before_training(tmp_path, cli_runner, args, message):
    bad = write(tmp_path / "bad.jsonl", [{"prompt": "a?", "answer": "b"}, {"question": "c?"}])
    long = write(tmp_path / "long.jsonl", [{"prompt": "word " * 40}])
    args = [{"BAD": bad, "LONG": long}.get(a, a) for a in args]
    result = cli_runner.invoke("grpo", "--model", "tiny-llama", "--output", str(tmp_path / "run"), *args)
    assert result.exit_code != 0 and "Traceback" not in result.output
    import re

    assert re.search(message, result.output), result.output
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_train_loss_grpo_is_refused_before_training(tmp_path, cli_runner):
    """The core's runner has no rollouts: no dataset format makes 'rollout' examples, and it says so."""
    result = cli_runner.invoke("train", "--loss", "grpo", "--model", "tiny-llama", "--max-steps", "1",
                               "--output", str(tmp_path / "run"))
    assert result.exit_code != 0 and "needs rollout examples" in result.output, result.output
    assert not (tmp_path / "run" / "checkpoints").exists()
