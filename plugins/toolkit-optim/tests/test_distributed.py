"""Two gloo processes under DDP train like one ``local`` process at the same global batch: --tuner lisa,
--optimizer galore, adamw-8bit and adafactor; under FSDP2 (DTensor shards) galore, adafactor, adamw-8bit and
lisa do too, and stopped FSDP2 GaLore and LISA runs resume to the same losses."""

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


FSDP_COMMON = ["--strategy", "fsdp", "--max-steps", "6"]
FSDP_CASES = {"adafactor": ["--optimizer", "adafactor"],
              "adamw-8bit": ["--optimizer", "adamw-8bit", "--adamw-8bit-min-8bit-size", "0"],
              "lisa": ["--tuner", "lisa", "--lisa-layers", "1", "--lisa-interval", "2"]}


def fsdp_runs(root: str) -> list[list[int]]:
    """One 2-rank launch, every FSDP case in turn through the CLI in-process (the process group is the launch's),
    and the lisa run a second time, stopped inside a period and resumed. Returns, per step of the first lisa run,
    the decoder layers whose sharded parameters hold a gradient when the optimizer steps."""
    from toolkit.cli import main
    from toolkit.train import distributed, hf_engine

    distributed.shutdown = lambda exit_code=None: distributed.barrier()  # keep the launch's group (and process) for the next run

    def toolkit(*args: str) -> None:
        try:
            main([*COMMON, *FSDP_COMMON, *args])
        except SystemExit as exc:
            assert exc.code in (0, None), (args, exc.code)

    graded: list[list[int]] = []
    clip = hf_engine.LocalEngine._clip_gradients

    def recording(engine):  # runs after the backward passes, before the optimizer step
        if engine.tuner.name == "lisa":
            graded.append(sorted({int(n.split(".layers.")[1].split(".")[0]) for n, p in engine.model.named_parameters()
                                  if ".layers." in n and p.grad is not None}))
        return clip(engine)

    hf_engine.LocalEngine._clip_gradients = recording
    for case, flags in FSDP_CASES.items():
        toolkit(*flags, "--output", f"{root}/{case}")
    hf_engine.LocalEngine._clip_gradients = clip
    toolkit(*FSDP_CASES["lisa"], "--output", f"{root}/lisa-resumed", "--stop-after", "3")  # period 1 is steps 2-3
    toolkit(*FSDP_CASES["lisa"], "--output", f"{root}/lisa-resumed", "--resume", "auto")
    return graded


@pytest.mark.slow
def test_fsdp_adafactor_adamw_8bit_and_lisa_train_like_one_local_process(tmp_path, cli_runner):
    """torch's Adafactor, bitsandbytes' AdamW8bit and LISA's layer sampling on one local process are the reference;
    under FSDP2 adafactor all-reduces its column statistics and norms, adamw-8bit steps each shard (64 x 64 matrices
    split in 2 x 2048 elements: whole 256-element blocks, so the blocks are the unsharded ones), and lisa freezes
    the unsampled layers of the sharded model."""
    graded = run_distributed(fsdp_runs, nproc=2, args=(str(tmp_path / "fsdp"),), timeout=600)
    # FSDP2 computes no gradient for the frozen layers' shards: only this period's layer has one, on every rank
    from toolkit_optim.lisa import LISATuner

    tuner = LISATuner(LISATuner.Config(layers=1, interval=2))
    tuner.seed, tuner.num_layers = 42, 2
    sampled = [tuner.sampled_layers(step // 2) for step in range(6)]
    assert len({tuple(map(tuple, g)) for g in graded}) == 1 and graded[0] == sampled, graded
    assert len({tuple(layers) for layers in sampled}) > 1, "the draw must change layers for this to mean anything"
    for case, flags in FSDP_CASES.items():
        local = cli_runner.invoke([*COMMON, "--max-steps", "6", *flags, "--output", str(tmp_path / case)])
        assert local.exit_code == 0, local
        one, two = losses(tmp_path / case), losses(tmp_path / "fsdp" / case)
        assert len(one) == 6 and two == pytest.approx(one, rel=2e-4), case
        assert one[-1] < one[0] - 0.05, f"{case} must train for the comparison to mean anything"
    assert losses(tmp_path / "fsdp/lisa-resumed") == losses(tmp_path / "fsdp/lisa")
