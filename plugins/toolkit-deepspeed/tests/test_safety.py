"""DeepSpeed reads its checkpoint files with torch.load(weights_only=False): a crafted one must be refused in one
line, at resume and at export, before DeepSpeed unpickles it; real checkpoints of every ZeRO stage pass."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from toolkit.train import checkpoint as ckpt

pytestmark = pytest.mark.slow

FLAGS = ["sft", "--model", "tiny-llama", "--dataset", "demo", "--seq-len", "64", "--max-steps", "1", "--strategy", "deepspeed"]


def launch(*args: str) -> subprocess.CompletedProcess:
    """``toolkit *args`` on two ranks, started as torchrun would (forked: toolkit.testing.run_python)."""
    from toolkit.testing import run_python

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    return run_python(["-m", "toolkit", *args], nproc=2, env=env, timeout=300)


class Payload:
    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('ran')",))


@pytest.fixture(scope="module", params=[2, 3], ids=lambda z: f"zero{z}")  # ZeRO-1 writes what ZeRO-2 does
def run(request, tmp_path_factory):
    run = tmp_path_factory.mktemp(f"zero{request.param}") / "run"
    done = launch(*FLAGS, "--zero", str(request.param), "--output", str(run))
    assert done.returncode == 0, done.stderr[-3000:]
    return run, str(request.param)


def test_real_deepspeed_checkpoints_pass_the_check(run):
    from toolkit_deepspeed.engine import check_pickles

    check_pickles(run[0] / "checkpoints" / "step-1" / "deepspeed")


def test_a_crafted_optimizer_shard_is_refused_at_export_and_resume(run, tmp_path, cli_runner):
    import torch

    copy = tmp_path / "run"
    shutil.copytree(run[0], copy)
    step = copy / "checkpoints" / "step-1"
    shard = sorted((step / "deepspeed").glob("*optim_states.pt"))[0]
    marker = tmp_path / "ran"
    torch.save({"optimizer_state_dict": Payload(marker)}, shard)
    (step / "manifest.json").unlink()
    ckpt.write_manifest(step)  # whoever ships a checkpoint writes its manifest too
    exported = cli_runner.invoke("export", copy, "--output", tmp_path / "out")
    assert exported.exit_code == 1 and "Traceback" not in exported.output, exported.output
    assert f"{shard} holds objects a weights-only load refuses" in exported.stderr
    resumed = launch(*FLAGS, "--zero", run[1], "--max-steps", "2", "--resume", "auto", "--output", str(copy))
    assert resumed.returncode != 0 and f"{shard} holds objects a weights-only load refuses" in resumed.stderr, resumed.stderr[-3000:]
    assert not marker.exists()
