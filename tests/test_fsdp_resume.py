"""FSDP2 checkpoints resume at another number of ranks (2 -> 1, 1 -> 2) and continue like an uninterrupted run.

A checkpoint is torch.distributed.checkpoint shards plus the trainer state; a resumed run keeps the
checkpoint's global batch size, so step N trains on the same rows at any number of ranks (fewer
ranks accumulate more micro-batches). The reference is one uninterrupted ``local`` process.
"""

from __future__ import annotations

import json

import pytest

from toolkit.testing import run_distributed

COMMON = ["sft", "--model", "tiny-llama", "--dataset", "demo", "--seq-len", "64", "--lr", "1e-3", "--max-steps", "4",
          "--micro-batch-size", "2"]


def toolkit(*args, nproc=1):
    stopped = (75,) if "--stop-after" in args and nproc == 1 else ()  # one process stopped early: resumable
    return run_distributed(["-m", "toolkit", *map(str, args)], nproc=nproc, timeout=300, exit_codes=(0, *stopped))


def metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def assert_same_run(reference, resumed):
    assert [m["step"] for m in resumed] == [1, 2, 3, 4]
    for a, b in zip(reference, resumed, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), (a, b)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4), (a, b)


@pytest.fixture(scope="module")
def local_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("local") / "run"
    toolkit(*COMMON, "--global-batch-size", "4", "--output", run)
    return metrics(run)


@pytest.mark.slow
def test_two_rank_checkpoint_resumes_on_one_rank(tmp_path, local_run):
    run = tmp_path / "run"
    toolkit(*COMMON, "--strategy", "fsdp", "--stop-after", "2", "--output", run, nproc=2)  # global batch 2 x 2 ranks
    state = json.loads((run / "checkpoints/step-2/trainer_state.json").read_text())
    assert (state["world_size"], state["global_batch_size"]) == (2, 4)
    resumed = toolkit(*COMMON, "--strategy", "fsdp", "--resume", "auto", "--output", run)  # no --global-batch-size
    assert "global batch size 4" in resumed[0].stderr and "resumed from" in resumed[0].stderr
    assert_same_run(local_run, metrics(run))
    final = json.loads((run / "checkpoints/step-4/trainer_state.json").read_text())
    assert (final["world_size"], final["global_batch_size"]) == (1, 4)


@pytest.mark.slow
def test_one_rank_checkpoint_resumes_on_two_ranks(tmp_path, local_run):
    run = tmp_path / "run"
    toolkit(*COMMON, "--strategy", "fsdp", "--global-batch-size", "4", "--stop-after", "2", "--output", run)
    toolkit(*COMMON, "--strategy", "fsdp", "--resume", "auto", "--output", run, nproc=2)
    assert_same_run(local_run, metrics(run))
    # a different explicit global batch size would train other rows at each step: refused, with the fix named
    from toolkit.errors import ConfigError
    from toolkit.recipe import resolve_recipe
    from toolkit.train.runner import keep_global_batch_size

    recipe = resolve_recipe({"model": "tiny-llama", "output": str(run), "resume": "auto", "global_batch_size": 8})
    with pytest.raises(ConfigError, match="--global-batch-size 8 differs from the 4 of the checkpoint .*pass --global-batch-size 4"):
        keep_global_batch_size(recipe, run, is_main=True)
