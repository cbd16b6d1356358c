"""--on-nan with the megatron strategy: `skip` and `rollback` after a non-finite gradient give the
losses of the local strategy's runs (which equal a run that never saw the batch, core tests)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from toolkit.testing import run_python, write_plugin_distribution

pytestmark = pytest.mark.slow

NAN_PLUGIN = Path(__file__).resolve().parents[3] / "tests" / "nan_plugin.py"  # the core tests' poisoning plugin


def dataset(path: Path) -> Path:
    rows = [{"messages": [{"role": "user", "content": f"What is {n} plus {n}?"}, {"role": "assistant", "content": f"It is {2 * n}."}]}
            for n in range(1, 13)]
    rows[4]["poison"] = "grad"  # line 5: a finite loss with an infinite gradient
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def toolkit(tmp_path: Path, run: Path, *args: str, nproc: int = 1) -> subprocess.CompletedProcess:
    site = tmp_path / "site"
    write_plugin_distribution(site, "toolkit-nan-test", NAN_PLUGIN.read_text(), module="toolkit_nan_test")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           "PYTHONPATH": os.pathsep.join([str(site), *sys.path]), "TOOLKIT_PLUGINS": "nan-test,megatron"}
    command = ["-m", "toolkit", "train", "--model", "tiny-llama", "--dataset", str(dataset(tmp_path / "data.jsonl")),
               "--dataset-format", "poisoned", "--loss", "nan-sft", "--output", str(run), "--seq-len", "64", "--max-steps", "6",
               "--micro-batch-size", "1", "--global-batch-size", "2", "--save-every", "2", *args]
    return run_python(command, nproc=nproc, env=env, timeout=400)


def lines(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("policy", ["skip", "rollback"])
def test_megatron_tp2_skips_and_rolls_back_like_local(tmp_path, policy):
    local = toolkit(tmp_path, tmp_path / "local", "--on-nan", policy)
    assert local.returncode == 0, local.stderr[-3000:]
    mcore = toolkit(tmp_path, tmp_path / "mcore", "--strategy", "megatron", "--tp", "2", "--on-nan", policy, nproc=2)
    assert mcore.returncode == 0, mcore.stderr[-3000:]
    expected, got = lines(tmp_path / "local"), lines(tmp_path / "mcore")
    assert [m["step"] for m in got] == [m["step"] for m in expected]
    (event,) = [m for m in got if m.get("event")]
    assert event["action"] == policy and event["quantities"] == ["grad_norm"] and event["checkpoint"].endswith("step-2")
    for a, b in zip(expected, got, strict=True):
        if "event" not in a:
            assert abs(a["loss"] - b["loss"]) <= 1e-4 and abs(a["grad_norm"] - b["grad_norm"]) <= 1e-4 * max(1.0, a["grad_norm"]), (a, b)
            assert abs(a["lr"] - b["lr"]) <= 1e-12, (a, b)  # a skipped update does not advance the schedule
    state = json.loads((tmp_path / "mcore/checkpoints/step-6/trainer_state.json").read_text())
    assert state["skipped_steps"] == ([event["step"] - 1] if policy == "rollback" else [])
