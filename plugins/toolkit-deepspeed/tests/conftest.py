"""Shared settings and fixtures for the DeepSpeed plugin's tests: offline, one thread, one extension cache."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from toolkit import forkserver

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
# DeepSpeed compiles C++ ops on first use; every test process shares one cache of them.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "toolkit" / "torch_extensions"))

# the fork server of toolkit.testing.run_python imports DeepSpeed once too (3-4 CPU-s per rank otherwise)
os.environ.setdefault("TOOLKIT_TEST_PRELOAD", ",".join((*forkserver.PRELOAD, "deepspeed")))

HERE = Path(__file__).parent


class ScenarioReport(dict):
    """What ``scenarios.py`` measured, by scenario name."""

    def series(self, name: str, key: str) -> list[float]:
        return [step[key] for step in self[name]["history"]]


def torchrun(script: Path, *args: str, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    """``script`` on two torch.distributed ranks, as torchrun would start them."""
    from toolkit.testing import run_python

    return run_python([script, *args], nproc=2, env={**os.environ, **(env or {})}, timeout=timeout)


@pytest.fixture(scope="session")
def scenarios(tmp_path_factory):
    """``scenarios(group)``: run one group of two-rank scenarios (once per session) and return its report."""
    reports: dict[str, ScenarioReport] = {}

    def run(group: str) -> ScenarioReport:
        if group not in reports:
            work = tmp_path_factory.mktemp(group)
            path = work / "report.json"
            done = torchrun(HERE / "scenarios.py", str(path), str(work), env={"SCENARIOS": group})
            assert path.is_file(), f"scenarios failed (exit {done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
            data = json.loads(path.read_text())
            assert not data.get("errors"), data["errors"]
            reports[group] = ScenarioReport(data)
        return reports[group]

    return run
