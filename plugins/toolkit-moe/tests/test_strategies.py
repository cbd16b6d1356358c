"""Through the CLI: patched blocks train the same under local (1 process), DDP and FSDP2 (2 processes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
COMMON = ["--model", "tiny-qwen3-moe", "--dataset", "demo", "--seq-len", "64", "--lr", "1e-3", "--max-steps", "3",
          "--micro-batch-size", "2", "--global-batch-size", "4", "--max-samples", "16",
          "--moe-enabled", "--moe-experts-backend", "loop", "--moe-z-loss-coef", "0.01", "--moe-capacity-factor", "2.0"]


def toolkit(*args: str, nproc: int = 1) -> None:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"] if nproc > 1 else [sys.executable]
    result = subprocess.run([*launcher, "-m", "toolkit", "sft", *COMMON, *args], capture_output=True, text=True, env=ENV, timeout=300)
    assert result.returncode == 0, f"{args} failed:\n{result.stdout}\n{result.stderr[-3000:]}"


def metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_local_ddp_and_fsdp_agree_with_moe_blocks(tmp_path):
    from transformers import AutoModelForCausalLM

    toolkit("--output", str(tmp_path / "local"), "--export", "hf")
    toolkit("--output", str(tmp_path / "ddp"), nproc=2)
    toolkit("--output", str(tmp_path / "fsdp"), "--strategy", "fsdp", "--export", "hf", nproc=2)
    one = metrics(tmp_path / "local")
    assert len(one) == 3 and all(m["aux_loss"] > 0 for m in one)
    for name in ("ddp", "fsdp"):
        for a, b in zip(one, metrics(tmp_path / name), strict=True):
            for key in ("loss", "aux_loss", "grad_norm"):
                if key in b or name != "fsdp":  # the fsdp engine does not log aux_loss (it does add it)
                    assert b[key] == pytest.approx(a[key], rel=1e-4), (name, key)
    ids = torch.arange(5, 40)[None]
    with torch.no_grad():
        local = AutoModelForCausalLM.from_pretrained(tmp_path / "local/export")(ids).logits
        sharded = AutoModelForCausalLM.from_pretrained(tmp_path / "fsdp/export")(ids).logits
    torch.testing.assert_close(local, sharded, rtol=1e-4, atol=1e-4)
