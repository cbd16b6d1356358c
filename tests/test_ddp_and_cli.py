"""End to end through the CLI: DDP over 2 gloo processes equals 1 process; signals; bad input; infer."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from toolkit import forkserver
from toolkit.testing import run_python

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
COMMON = ["--model", "tiny-llama", "--dataset", "demo", "--seq-len", "128", "--lr", "1e-3", "--max-steps", "4"]


def toolkit(*args, check=True, nproc=1, timeout=300, cwd=None):
    result = run_python(["-m", "toolkit", *args], nproc=nproc, env=ENV, timeout=timeout, cwd=cwd)
    if check and result.returncode != 0:
        raise AssertionError(f"{args} failed ({result.returncode}):\n{result.stdout}\n{result.stderr[-3000:]}")
    return result


def metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_two_ddp_ranks_equal_one_rank(tmp_path):
    # 10 examples, 4 a step: step 3 ends epoch 0 with its last 2 examples (rank 0's share) and takes epoch 1's first 2
    # (rank 1's), so no example is left out and the ranks still agree with one process over the epoch boundary
    batch = ["--micro-batch-size", "2", "--global-batch-size", "4", "--max-samples", "10"]
    toolkit("sft", *COMMON, "--output", str(tmp_path / "one"), *batch)
    toolkit("sft", *COMMON, "--output", str(tmp_path / "two"), *batch, nproc=2)
    one, two = metrics(tmp_path / "one"), metrics(tmp_path / "two")
    assert len(one) == len(two) == 4
    for a, b in zip(one, two):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5) and a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
        # the step's figures over both ranks, not rank 0's half
        assert (a["trained_tokens"], a["row_fill"]) == (b["trained_tokens"], b["row_fill"])
    w1 = load_file(str(tmp_path / "one/checkpoints/step-4/model.safetensors"))
    w2 = load_file(str(tmp_path / "two/checkpoints/step-4/model.safetensors"))
    for key in w1:
        torch.testing.assert_close(w1[key], w2[key], rtol=1e-4, atol=2e-5)


def test_sigterm_saves_a_checkpoint_and_exits_cleanly(tmp_path):
    run_dir = tmp_path / "sig"
    log = (tmp_path / "stderr.txt").open("w+")
    process = forkserver.popen([sys.executable, "-m", "toolkit", "sft", *COMMON[:-1], "100000", "--output", str(run_dir),
                                "--log-every", "1"], env=ENV, stdout=subprocess.DEVNULL, stderr=log)
    deadline = time.time() + 120
    while time.time() < deadline and not ((run_dir / "metrics.jsonl").is_file() and (run_dir / "metrics.jsonl").read_text().count("\n") >= 2):
        time.sleep(0.2)
    process.send_signal(signal.SIGTERM)
    process.wait(timeout=120)
    err = (tmp_path / "stderr.txt").read_text()
    assert process.returncode == 75, err  # stopped, resumable
    checkpoints = list((run_dir / "checkpoints").glob("step-*"))
    assert len(checkpoints) == 1 and (checkpoints[0] / "trainer_state.json").is_file()
    assert not list((run_dir / "checkpoints").glob(".tmp-*"))
    assert "--resume auto" in err


def test_bad_input_errors_are_one_paragraph(tmp_path):
    empty = tmp_path / "model"
    empty.mkdir()
    (empty / "config.json").write_text(json.dumps({"model_type": "llama"}))
    cases = [
        (["sft", "--model", str(empty), "--dataset", "demo", "--output", str(tmp_path / "a")], "has no *.safetensors weights"),
        (["sft", *COMMON, "--seq-len", "999999", "--output", str(tmp_path / "b")], "exceeds the model's maximum"),
        (["sft", *COMMON, "--dataset", str(tmp_path / "missing.jsonl"), "--output", str(tmp_path / "c")], "neither a file nor a bundled dataset"),
        (["sft", *COMMON, "--strategy", "nosuch", "--output", str(tmp_path / "d")], "unknown strategy 'nosuch'"),
        (["sft", *COMMON, "--tp", "2", "--output", str(tmp_path / "e")], "--tp 2 needs --strategy megatron"),
    ]
    for args, message in cases:
        result = toolkit(*args, check=False)
        assert result.returncode != 0
        assert message in result.stderr and "Traceback" not in result.stderr, (args, result.stderr)


def test_refuses_to_reuse_a_run_directory_then_infers(tmp_path):
    run_dir = tmp_path / "run"
    toolkit("sft", *COMMON, "--max-steps", "2", "--output", str(run_dir), "--export", "hf")
    again = toolkit("sft", *COMMON, "--output", str(run_dir), check=False)
    assert again.returncode == 1 and "already holds a run" in again.stderr and "--overwrite" in again.stderr
    result = toolkit("infer", str(run_dir), "--prompt", "What is the capital of Lopehes?", "--max-new-tokens", "4")
    from toolkit.builtins.inference import GenerateConfig, HFBackend

    expected = HFBackend().generate(run_dir / "export", ["What is the capital of Lopehes?"], GenerateConfig(max_new_tokens=4))
    assert result.stdout.strip().splitlines()[-1] == expected[0].strip()


@pytest.mark.slow
def test_a_relative_model_path_is_stored_absolute_so_export_works_from_elsewhere(tmp_path):
    from toolkit.models import materialize_preset

    materialize_preset("tiny-llama", tmp_path / "base", num_hidden_layers=1)
    toolkit("sft", *COMMON[2:], "--model", "base", "--max-steps", "1", "--output", "run", cwd=tmp_path)
    recipe = (tmp_path / "run" / "recipe.yaml").read_text()
    assert recipe.startswith("# --model as given: base\n") and f"model: {tmp_path / 'base'}\n" in recipe
    (tmp_path / "elsewhere").mkdir()
    toolkit("export", str(tmp_path / "run"), "--to", "hf", "--output", "out", cwd=tmp_path / "elsewhere")
    assert (tmp_path / "elsewhere" / "out" / "model.safetensors").is_file()


@pytest.mark.slow
def test_fsdp_equals_local_resumes_and_exports(tmp_path):
    from transformers import AutoModelForCausalLM

    batch = ["--micro-batch-size", "2", "--global-batch-size", "4", "--max-steps", "5"]
    toolkit("sft", *COMMON, "--output", str(tmp_path / "local"), *batch, "--export", "hf")
    fsdp = tmp_path / "fsdp"
    toolkit("sft", *COMMON, "--output", str(fsdp), *batch, "--strategy", "fsdp", "--stop-after", "2", nproc=2)
    toolkit("sft", *COMMON, "--output", str(fsdp), *batch, "--strategy", "fsdp", "--resume", "auto", "--export", "hf", nproc=2)
    assert len(metrics(fsdp)) == 5
    for a, b in zip(metrics(tmp_path / "local"), metrics(fsdp), strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
    ids = torch.arange(5, 40)[None]
    with torch.no_grad():
        local = AutoModelForCausalLM.from_pretrained(tmp_path / "local/export")(ids).logits
        sharded = AutoModelForCausalLM.from_pretrained(fsdp / "export")(ids).logits
    torch.testing.assert_close(local, sharded, rtol=1e-4, atol=1e-4)
    # a sharded (DCP) checkpoint exports through the CLI too
    toolkit("export", str(fsdp), "--to", "hf", "--output", str(tmp_path / "from-ckpt"))
    with torch.no_grad():
        again = AutoModelForCausalLM.from_pretrained(tmp_path / "from-ckpt")(ids).logits
    torch.testing.assert_close(again, sharded, rtol=0, atol=0)


def check_run_dir_then_write(output: str) -> str:
    """Rank 1 looks at the output directory late: rank 0 must not have written this run's recipe.yaml by then."""
    import torch.distributed as dist

    from toolkit.recipe import resolve_recipe
    from toolkit.train.runner import prepare_run_dir

    if dist.get_rank() == 1:
        time.sleep(2.0)
    run_dir = prepare_run_dir(resolve_recipe({"output": output}), dist.get_rank() == 0)
    if dist.get_rank() == 0:
        (run_dir / "recipe.yaml").write_text("model: tiny-llama\n")
    return "ok"


@pytest.mark.slow
def test_a_slower_rank_does_not_take_the_new_run_for_an_old_one(tmp_path):
    from toolkit.testing import run_distributed

    assert run_distributed(check_run_dir_then_write, nproc=2, args=(str(tmp_path / "run"),), timeout=120) == ["ok", "ok"]
