"""Two gloo processes under DDP train like one ``local`` process at the same global batch: --tuner lisa,
--optimizer galore, adamw-8bit and adafactor; under FSDP2 (DTensor shards) --optimizer galore does too, and a
stopped FSDP2 GaLore run resumes to the same losses (adamw-8bit and adafactor refuse fsdp)."""

from __future__ import annotations

import json

import pytest

from toolkit.testing import run_distributed

COMMON = ["sft", "--model", "tiny-llama", "--dataset", "demo", "--seq-len", "64", "--lr", "1e-3", "--max-steps", "4",
          "--micro-batch-size", "2", "--global-batch-size", "4"]
CASES = {"lisa": ["--tuner", "lisa", "--lisa-layers", "1", "--lisa-interval", "2", "--local-find-unused-parameters"],
         "galore": ["--optimizer", "galore", "--galore-rank", "4", "--galore-update-proj-gap", "2"],
         "adamw-8bit": ["--optimizer", "adamw-8bit", "--adamw-8bit-min-8bit-size", "0"],
         "adafactor": ["--optimizer", "adafactor"],
         "galore-fsdp": ["--optimizer", "galore", "--galore-rank", "4", "--galore-update-proj-gap", "2", "--strategy", "fsdp"]}


def losses(run):
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_two_processes_train_like_one(tmp_path, case):
    flags = CASES[case]
    single = [f for f in flags if f != "--local-find-unused-parameters"]
    if "fsdp" in single:  # the reference: one plain local process
        single = single[:single.index("--strategy")]
    run_distributed(["-m", "toolkit", *COMMON, *single, "--output", str(tmp_path / "one")], nproc=1, timeout=300)
    run_distributed(["-m", "toolkit", *COMMON, *flags, "--output", str(tmp_path / "two")], nproc=2, timeout=300)
    # summation order differs (two ranks' gradients are all-reduced); 8-bit states and SVDs amplify it a little
    assert losses(tmp_path / "two") == pytest.approx(losses(tmp_path / "one"), rel=2e-4)


@pytest.mark.slow
def test_galore_under_fsdp_resumes_to_the_same_losses(tmp_path):
    # the stop falls between two SVDs (gap 3): the resumed run must step with the projection it saved
    flags = [*COMMON, *CASES["galore-fsdp"][:-4], "--galore-update-proj-gap", "3", "--strategy", "fsdp"]
    run_distributed(["-m", "toolkit", *flags, "--output", str(tmp_path / "straight")], nproc=2, timeout=300)
    run_distributed(["-m", "toolkit", *flags, "--output", str(tmp_path / "half"), "--stop-after", "2"], nproc=2,
                    timeout=300)  # under torchrun's environment a stopped run exits 0
    run_distributed(["-m", "toolkit", *flags, "--output", str(tmp_path / "half"), "--resume", "auto"], nproc=2, timeout=300)
    assert len(losses(tmp_path / "half")) == 4 and losses(tmp_path / "half") == losses(tmp_path / "straight")
