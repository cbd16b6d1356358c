"""A rank that dies or hangs ends the whole torchrun job within --dist-timeout, naming the rank and the last collective."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import nan_plugin
import pytest
from test_numerics import write_dataset

from toolkit.testing import free_port, run_distributed, run_python, write_plugin_distribution

TIMEOUT = 6
STARTUP = 240  # seconds two CPU ranks may take to import torch and build the tiny model on a loaded machine;
# with the grace below, still under the 600 s a collective outside a step may wait (toolkit.train.distributed.STARTUP_TIMEOUT)


def poisoned_position(data: Path) -> tuple[int, int]:
    """(1-based step, data-parallel rank) that meets the poisoned sample with 2 ranks, computed independently."""
    from toolkit.data.pipeline import Batches, load_examples
    from toolkit.models import resolve_model

    examples, _ = load_examples([str(data)], resolve_model("tiny-llama").tokenizer, dataset_format="poisoned", seq_len=64)
    for rank in range(2):
        batches = Batches(examples, seed=42, seq_len=64, packing=False, micro_batch_size=1, global_batch_size=2,
                          dp_rank=rank, dp_world_size=2, pad_id=0, group_by_length=True)  # the runner's default order
        for step in range(batches.steps_per_epoch):
            if any(mb["sequence_meta"].get("poison") is not None and bool(mb["sequence_meta"]["poison"].any())
                   for mb in batches.micro_batches(step)):
                return step + 1, rank
    raise AssertionError("no poisoned sample")


SKEWED = """
import sys, time
from toolkit.train.distributed import all_reduce_sum, barrier, init_world, start_watchdog
world = init_world(2.0)  # --dist-timeout 2
if world.rank == 1:
    time.sleep(5)  # a rank that imports or loads slower than the others
barrier()
print("start-up ok", flush=True)
start_watchdog(2.0).arm("step 1")
if world.rank == 1:
    time.sleep(5)  # within its own watchdog's limit (2 s + 5 s of grace)
try:
    all_reduce_sum([1.0])
    print("step ok", flush=True)
except Exception as exc:
    print("step failed:", str(exc).splitlines()[0][:200], flush=True)
sys.stdout.flush()
import os
os._exit(0)
"""


def test_start_up_waits_for_a_slow_rank_and_a_step_waits_dist_timeout():
    """--dist-timeout bounds a training step's collectives; ranks that reach start-up's barrier seconds apart
    (a loaded machine, rank 0 writing a cache the others wait for) are not a failure."""
    results = run_distributed(["-c", SKEWED], nproc=2, timeout=120)
    assert [r.stdout.count("start-up ok") for r in results] == [1, 1], [r.stdout + r.stderr[-2000:] for r in results]
    assert "step failed:" in results[0].stdout and "step ok" not in results[0].stdout, results[0].stdout


@pytest.fixture
def launch(tmp_path, toolkit_manager):
    toolkit_manager(("nan-plugin", nan_plugin), installed=False)
    site = tmp_path / "site"
    write_plugin_distribution(site, "toolkit-nan-test", Path(nan_plugin.__file__).read_text(), module="toolkit_nan_test")

    def run(data: Path) -> tuple[subprocess.CompletedProcess, float]:
        command = ["-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={free_port()}",
                   "-m", "toolkit", "train", "--model", "tiny-llama", "--dataset", str(data), "--dataset-format", "poisoned",
                   "--loss", "nan-sft", "--output", str(tmp_path / "run"), "--seq-len", "64", "--max-steps", "6",
                   "--micro-batch-size", "1", "--global-batch-size", "2", "--dist-timeout", str(TIMEOUT)]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), *sys.path]), "TOOLKIT_PLUGINS": "nan-test",
               "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
        start = time.monotonic()
        # torchrun's own process forked from the test fork server (no import of torch); its ranks are torchrun's
        result = run_python(command, env=env, timeout=STARTUP + TIMEOUT + 60)
        return result, time.monotonic() - start

    return run


@pytest.mark.slow
@pytest.mark.parametrize("failure", ["exit", "hang"])
def test_a_dead_or_hung_rank_ends_the_job_and_is_named(tmp_path, launch, failure):
    data = write_dataset(tmp_path / "data.jsonl", poison=failure)
    step, bad_rank = poisoned_position(data)
    result, elapsed = launch(data)
    err = result.stderr
    assert result.returncode != 0, err[-3000:]
    assert elapsed < STARTUP + TIMEOUT + 5 + 15, (elapsed, err[-3000:])  # 5: the hung rank's own grace period
    survivor = 1 - bad_rank
    assert f"toolkit: error: rank {survivor}: a collective failed during step {step}" in err, err[-3000:]
    assert f"rank {bad_rank}: last seen" in err and f"in step {step};" in err, err[-3000:]
    assert "Last collective on this rank: " in err and "Traceback" not in err.split("toolkit: error:")[0][-2000:]
    if failure == "hang":  # the hung rank ends itself too, naming what it was doing
        assert f"toolkit: error: rank {bad_rank}: step {step} made no progress for {TIMEOUT + 5}s" in err, err[-3000:]


@pytest.mark.parametrize("message", [
    "Application timeout caused pair closure",  # gloo, waiting in the autograd engine's reduction (CI, 2026-12-01)
    "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1234",
    "Timed out waiting 6000ms for recv operation to complete",
    "[/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 6000ms for recv",
    "Socket Timeout",
])
def test_gloo_peer_failures_are_recognised(message):
    from toolkit.train.distributed import is_collective_failure

    assert is_collective_failure(RuntimeError(message))


@pytest.mark.parametrize("error", [RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x8 and 16x8)"),
                                   ValueError("Application timeout caused pair closure")])
def test_other_errors_are_not_taken_for_a_lost_peer(error):
    from toolkit.train.distributed import is_collective_failure

    assert not is_collective_failure(error)
