"""toolkit grpo on fsdp and DeepSpeed ZeRO-2/3 (2 gloo processes) follows plain DDP (``local``), full and LoRA.

The rollout seeds depend on the data-parallel rank only, so every two-rank run samples the same
rollouts while its weights agree; two rollout batches of 2 optimizer steps x 2 iterations each
cover the weight sync after training (LoRA arrives merged), old log-probs reused by the second
iteration, and the KL term. Loss, gradient norm and KL must agree within 1e-4 at every step.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from toolkit.testing import run_python

pytestmark = pytest.mark.slow

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
       "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", os.path.expanduser("~/.cache/toolkit/torch_extensions"))}
VOWELS = f"{Path(__file__).parent / 'toy_rewards.py'}:vowels"
COMMON = ["--model", "tiny-llama", "--dataset", "demo", "--max-samples", "16", "--reward", "answer", "--reward", VOWELS,
          "--num-generations", "4", "--grpo-prompts-per-rollout", "2", "--max-new-tokens", "6",
          "--micro-batch-size", "2", "--seq-len", "64", "--lr", "1e-2", "--grpo-beta", "0.04", "--seed", "3",
          "--grpo-steps-per-rollout", "2", "--grpo-iterations", "2", "--max-steps", "8"]


def grpo(output: Path, *args: str) -> list[dict]:
    result = run_python(["-m", "toolkit", "grpo", *COMMON, *args, "--output", output], nproc=2, env=ENV, timeout=600)
    assert result.returncode == 0, f"{args} failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    return [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def ddp(tmp_path_factory):
    pytest.importorskip("toolkit_peft")
    root = tmp_path_factory.mktemp("ddp")
    return {tuner: grpo(root / tuner, "--tuner", tuner) for tuner in ("full", "lora")}


@pytest.mark.parametrize("tuner,layout", [
    ("full", ["--strategy", "fsdp"]),
    ("full", ["--strategy", "deepspeed", "--zero", "2"]),
    ("full", ["--strategy", "deepspeed", "--zero", "3"]),
    ("lora", ["--strategy", "fsdp"]),
    ("lora", ["--strategy", "deepspeed", "--zero", "3"]),
], ids=["fsdp", "zero2", "zero3", "fsdp-lora", "zero3-lora"])
def test_sharded_strategies_follow_ddp(ddp, tmp_path, tuner, layout):
    if "deepspeed" in layout:
        pytest.importorskip("toolkit_deepspeed")
    local, got = ddp[tuner], grpo(tmp_path / "run", "--tuner", tuner, *layout)
    assert [m["step"] for m in got] == list(range(1, 9))
    for a, b in zip(local, got, strict=True):
        assert a["reward/mean"] == b["reward/mean"] and a["completion_length"] == b["completion_length"]  # same rollouts
        for key in ("loss", "grad_norm", "kl"):
            assert abs(a[key] - b[key]) <= 1e-4 * max(1.0, abs(a[key])), (a["step"], key, a[key], b[key])
    assert local[0]["reward/mean"] != local[-1]["reward/mean"]  # the second batch sampled from the trained policy
    assert local[-1]["kl"] > 1e-3
