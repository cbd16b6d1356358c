"""scripts/kill_test.py, short: a local run and a megatron TP2 run (2 gloo processes) SIGKILLed twice (aimed at
random moments, most inside checkpoint writes), one disk-full round and one corrupted checkpoint, then finished;
their weights equal an uninterrupted run. Every run is forked from one process that imported torch once
(``--fork``), ranks started as torchrun would."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "kill_test.py"


def run_kill_test(tmp_path: Path, *args: str) -> dict:
    summary = tmp_path / "summary.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, str(SCRIPT), "--workdir", str(tmp_path / "work"), "--json", str(summary), "--fork", *args],
                            capture_output=True, text=True, env=env, timeout=900)
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr[-3000:]}"
    return json.loads(summary.read_text())


@pytest.mark.parametrize("mode", ["local", "megatron-tp2"])
def test_run_survives_kills_corruption_and_a_full_disk_bit_identically(tmp_path, mode):
    if mode == "megatron-tp2":
        pytest.importorskip("toolkit_megatron")
    summary = run_kill_test(tmp_path, "--mode", mode, "--kills", "2", "--seed", "3", "--steps", "8",
                            "--corrupt-every", "2", "--disk-full-round", "1")
    assert summary["passed"] and summary["bit_identical"] and summary["metrics_identical"]
    assert summary["kills"] == 2 and summary["steps_logged"] == 8
    assert summary["disk_full_rounds"] == summary["disk_full_handled"] == 1
    assert len(summary["corrupted"]) == summary["damaged_detected"] == 1
