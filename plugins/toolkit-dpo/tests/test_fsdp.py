"""Preference losses under ``--strategy fsdp`` (2 gloo processes) equal one ``local`` process.

Covers the three ways a strategy meets these losses: a frozen reference model (full DPO: FSDP
shards the reference copy too), the policy with its adapters disabled as the reference (DPO on
LoRA: that forward must go through the FSDP root) and a value head (reward modeling).
"""

from __future__ import annotations

import json

import pytest

from toolkit.cli import build_cli
from toolkit.testing import run_distributed

COMMON = ["--model", "tiny-llama", "--dataset", "parity-prefs", "--max-samples", "32", "--max-steps", "3", "--lr", "1e-3",
          "--micro-batch-size", "2", "--global-batch-size", "4", "--seq-len", "128"]


def metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("loss, extra", [("dpo", ["--dpo-beta", "0.5"]),
                                         ("dpo", ["--dpo-beta", "0.5", "--tuner", "lora", "--lora-rank", "4", "--lora-init", "random"]),
                                         ("rm", [])], ids=["dpo-full", "dpo-lora", "rm"])
def test_fsdp_matches_local(tmp_path, loss, extra):
    if "lora" in extra:
        pytest.importorskip("toolkit_peft")
    flags = [loss, *COMMON, *extra]
    build_cli().main(args=[*flags, "--output", str(tmp_path / "local")], prog_name="toolkit", standalone_mode=False)
    run_distributed(["-m", "toolkit", *flags, "--strategy", "fsdp", "--output", str(tmp_path / "fsdp")], nproc=2, timeout=300)
    local, fsdp = metrics(tmp_path / "local"), metrics(tmp_path / "fsdp")
    assert len(local) == len(fsdp) == 3 and local[-1]["rewards/margins"] != 0
    keys = ("loss", "grad_norm", "rewards/margins", "rewards/chosen") + (("logps/chosen", "logps/rejected") if loss != "rm" else ())
    for a, b in zip(local, fsdp, strict=True):
        for key in keys:
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-5), (key, a[key], b[key])
