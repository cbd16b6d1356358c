"""The megatron strategy through the CLI: SFT steps equal the local strategy; resume; HF export."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.slow

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
COMMON = ["--model", "tiny-llama", "--dataset", "demo", "--seq-len", "64", "--lr", "1e-3", "--max-steps", "3",
          "--micro-batch-size", "2", "--global-batch-size", "4"]


def toolkit(*args: str, nproc: int = 1) -> None:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"] if nproc > 1 else [sys.executable]
    result = subprocess.run([*launcher, "-m", "toolkit", *args], capture_output=True, text=True, env=ENV, timeout=400)
    assert result.returncode == 0, f"{args} failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"


def metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_tp2_sft_equals_local_and_exports(tmp_path):
    from transformers import AutoModelForCausalLM

    toolkit("sft", *COMMON, "--output", str(tmp_path / "local"), "--export", "hf")
    run = tmp_path / "tp2"
    toolkit("sft", *COMMON, "--output", str(run), "--strategy", "megatron", "--tp", "2", "--export", "hf", nproc=2)
    assert (run / "checkpoints/step-3/mcore/toolkit_mcore.json").is_file()
    local, tp2 = metrics(tmp_path / "local"), metrics(run)
    assert [m["step"] for m in tp2] == [1, 2, 3]
    for a, b in zip(local, tp2, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-4, (a, b)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
    ids = torch.arange(5, 40)[None]
    with torch.no_grad():
        expected = AutoModelForCausalLM.from_pretrained(tmp_path / "local/export")(ids).logits
        exported = AutoModelForCausalLM.from_pretrained(run / "export")(ids).logits
    torch.testing.assert_close(exported, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.skip(reason="known bug: a 2-process run that saves a mid-run checkpoint (--stop-after) or runs PP2 "
                         "finishes its steps and checkpoint but hangs at exit; under investigation")
def test_tp2_resume_reproduces_the_remaining_steps(tmp_path):
    run = tmp_path / "tp2"
    toolkit("sft", *COMMON, "--output", str(run), "--strategy", "megatron", "--tp", "2", "--stop-after", "2", nproc=2)
    toolkit("sft", *COMMON, "--output", str(run), "--strategy", "megatron", "--tp", "2", "--resume", "auto", nproc=2)
    toolkit("sft", *COMMON, "--output", str(tmp_path / "local"))
    for a, b in zip(metrics(tmp_path / "local"), metrics(run), strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-4, (a, b)
