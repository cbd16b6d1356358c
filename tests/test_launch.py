"""``toolkit launch``: the torchrun command it builds, and a real 2-"node" job on localhost (gloo)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from toolkit import forkserver
from toolkit.commands.launch import torchrun_command
from toolkit.testing import free_port, run_python

WORKER = Path(__file__).with_name("launch_allreduce.py")


def test_single_node_command_runs_toolkit():
    command = torchrun_command(("sft", "--model", "tiny-llama"), nproc=4)
    assert command[1:] == ["-m", "toolkit.commands.launch", "--nproc-per-node=4", "--master-port=29500",
                           "-m", "toolkit", "sft", "--model", "tiny-llama"]


def test_multi_node_flags_pass_through():
    command = torchrun_command(("pt",), nproc=8, nnodes=4, node_rank=3, master_addr="node0", master_port=6000)
    assert {"--nnodes=4", "--node-rank=3", "--master-addr=node0", "--master-port=6000"} <= set(command)


def test_bad_launch_flags_are_usage_errors():
    proc = subprocess.run([sys.executable, "-m", "toolkit", "launch", "--nnodes", "2", "--node-rank", "2", "pt"],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert "--node-rank must be in 0..1" in proc.stderr and "--master-addr" in proc.stderr


def run_nodes(args: list[str], env: dict[str, str], tmp_path: Path, timeout: float) -> list[tuple[str, str]]:
    """``toolkit launch --nproc 1 --nnodes 2 ... ARGS`` for node ranks 0 and 1 at once on localhost; (stdout, stderr)
    of each. The two launchers are forked from the test fork server (no import of torch each); their ranks are
    torchrun's own processes."""
    port = free_port()
    nodes = []
    for rank in (0, 1):
        out, err = (open(tmp_path / f"node{rank}.{name}", "w+") for name in ("out", "err"))  # noqa: SIM115
        command = [sys.executable, "-m", "toolkit", "launch", "--nproc", "1", "--nnodes", "2", "--node-rank", str(rank),
                   "--master-addr", "127.0.0.1", "--master-port", str(port), *args]
        nodes.append((forkserver.popen(command, env=env, cwd=tmp_path, stdout=out, stderr=err), out, err))
    outputs = []
    try:
        for node, out, err in nodes:
            node.wait(timeout=timeout)
            out.seek(0), err.seek(0)
            outputs.append((out.read(), err.read()))
            assert node.returncode == 0, outputs[-1][1][-3000:]
    finally:
        for node, out, err in nodes:
            if node.poll() is None:
                node.kill()
            out.close(), err.close()
    return outputs


@pytest.mark.slow
def test_two_node_torchrun_job_on_localhost(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    outputs = run_nodes(["--script", str(WORKER)], env, tmp_path, timeout=180)
    results = sorted(line for out, _ in outputs for line in out.splitlines() if line.startswith("RESULT"))
    assert results == ["RESULT rank=0 world=2 node=0 sum=3", "RESULT rank=1 world=2 node=1 sum=3"]


@pytest.mark.slow
def test_two_node_toolkit_training_step(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    args = ["pt", "--model", "tiny-llama", "--strategy", "auto", "--max-steps", "1", "--seq-len", "64",
            "--output", str(tmp_path / "run")]
    run_nodes(args, env, tmp_path, timeout=300)
    import json

    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    metrics = [json.loads(line) for line in lines if line.strip()]
    assert metrics and metrics[-1]["step"] == 1 and metrics[-1]["loss"] > 0
    recipe = (tmp_path / "run" / "recipe.yaml").read_text()
    assert "strategy: local" in recipe  # --strategy auto on CPU


@pytest.mark.slow
def test_an_input_error_of_a_launched_job_prints_once_without_a_torchrun_traceback(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    result = run_python(["-m", "toolkit", "launch", "--nproc", "2", "--master-port", str(free_port()), "sft", "--dataset",
                         str(tmp_path / "missing.jsonl"), "--output", str(tmp_path / "run")], env=env, timeout=180)
    assert result.returncode == 1
    assert result.stderr.count("is neither a file nor a bundled dataset") == 1, result.stderr
    assert "Traceback" not in result.stderr and "ChildFailedError" not in result.stderr, result.stderr
    assert "toolkit launch: rank" in result.stderr.splitlines()[-1]


def test_a_rank_other_than_zero_leaves_input_errors_to_rank_zero(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOOLKIT_")}
    command = [sys.executable, "-m", "toolkit", "sft", "--dataset", str(tmp_path / "missing.jsonl"), "--output", str(tmp_path / "run")]
    quiet = run_python(command[1:], env={**env, "RANK": "1"}, timeout=120)  # forked: no second import of torch
    loud = run_python(command[1:], env={**env, "RANK": "0"}, timeout=120)
    assert quiet.returncode == loud.returncode == 1
    assert "missing.jsonl" in loud.stderr and "missing.jsonl" not in quiet.stderr
