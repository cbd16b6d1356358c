"""FSDP2 options against one ``local`` process: clipping over sharded gradients, activation checkpointing, CPU offload.

Every run clips at a small max-norm so clipping is active on every step, and AdamW's epsilon is
large enough that its update depends on the gradient's scale: a norm taken over one rank's shards
would clip by another factor and change the losses from the second step on (and the logged norm).
"""

from __future__ import annotations

import json

import pytest

from toolkit.testing import run_distributed

COMMON = ["sft", "--model", "tiny-llama", "--dataset", "demo", "--seq-len", "64", "--lr", "1e-3", "--max-steps", "3",
          "--micro-batch-size", "2", "--global-batch-size", "4", "--max-grad-norm", "0.05",
          "--adam-eps", "1e-4"]


def toolkit(*args, nproc=1):
    return run_distributed(["-m", "toolkit", *map(str, args)], nproc=nproc, timeout=300)


def metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def local_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("local") / "run"
    toolkit(*COMMON, "--output", run)
    found = metrics(run)
    assert all(m["grad_norm"] > 20 * 0.05 for m in found), "the test needs clipping active on every step"
    return found


@pytest.mark.slow
@pytest.mark.parametrize("flags", [[], ["--gradient-checkpointing"], ["--fsdp-cpu-offload"]],
                         ids=["clipped", "activation-checkpointing", "cpu-offload"])
def test_fsdp_equals_local(tmp_path, local_run, flags):
    toolkit(*COMMON, "--strategy", "fsdp", *flags, "--output", tmp_path / "run", nproc=2)
    for a, b in zip(local_run, metrics(tmp_path / "run"), strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), (a, b)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4), (a, b)
