"""toolkit grpo on the megatron strategy (2 gloo processes) follows the local strategy within 1e-4, full and LoRA.

TP2 (and PP2) have one data-parallel replica, so every rank samples the rollouts local samples (the
rollout seeds depend on the data-parallel rank only): same rollouts, and the loss, gradient norm and
KL of each step must agree with the one-process run. Two rollout batches of 2 optimizer steps x 2
iterations: the second iteration reuses old log-probs (ratios leave 1, the clip can act) and the
second batch samples from the trained weights (LoRA merged by the megatron engine's export).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from toolkit.testing import run_python

pytest.importorskip("toolkit_megatron")
pytestmark = pytest.mark.slow

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
VOWELS = f"{Path(__file__).parent / 'toy_rewards.py'}:vowels"
COMMON = ["--model", "tiny-llama", "--dataset", "demo", "--max-samples", "16", "--reward", "answer", "--reward", VOWELS,
          "--num-generations", "4", "--grpo-prompts-per-rollout", "2", "--max-new-tokens", "6",
          "--micro-batch-size", "4", "--seq-len", "64", "--lr", "1e-2", "--max-steps", "8", "--grpo-beta", "0.04",
          "--seed", "3", "--grpo-steps-per-rollout", "2", "--grpo-iterations", "2"]


def grpo(*args: str, nproc: int = 1) -> list[dict]:
    result = run_python(["-m", "toolkit", "grpo", *COMMON, *args], nproc=nproc, env=ENV, timeout=400)
    assert result.returncode == 0, f"{args} failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    output = Path(args[args.index("--output") + 1])
    return [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    runs = {}

    def get(tuner: str) -> list[dict]:
        if tuner not in runs:
            runs[tuner] = grpo("--output", str(tmp_path_factory.mktemp("local") / tuner), "--tuner", tuner)
        return runs[tuner]

    return get


@pytest.mark.parametrize("tuner", ["full", "lora"])
@pytest.mark.parametrize("layout", [["--tp", "2"]], ids=["tp2"])  # --pp 2 agrees too (run by hand; CI time)
def test_megatron_follows_local(layout, tuner, local, tmp_path):
    if tuner == "lora":
        pytest.importorskip("toolkit_peft")
    expected = local(tuner)
    got = grpo("--output", str(tmp_path / "run"), "--strategy", "megatron", "--tuner", tuner, *layout, nproc=2)
    assert [m["step"] for m in got] == list(range(1, 9))
    for a, b in zip(expected, got, strict=True):
        assert a["reward/mean"] == b["reward/mean"] and a["completion_length"] == b["completion_length"]  # same rollouts
        for key in ("loss", "grad_norm", "kl"):
            assert abs(a[key] - b[key]) <= 1e-4 * max(1.0, abs(a[key])), (a["step"], key, a[key], b[key])
    assert expected[0]["reward/mean"] != expected[-1]["reward/mean"]  # the second batch sampled from trained weights
    assert expected[-1]["kl"] > 1e-3  # the policy moved: the comparison covers trained steps
