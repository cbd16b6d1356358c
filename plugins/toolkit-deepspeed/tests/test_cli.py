"""The command line end to end: ``toolkit launch --nproc 2 sft --strategy deepspeed --zero 3 ...`` (the first run
through ``toolkit launch`` itself, the others on two ranks forked as torchrun would start them, a CPU minute less)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_zero3_run_with_user_json_resumes_exports_and_consolidates(tmp_path, cli_runner):
    import torch
    from transformers import AutoModelForCausalLM

    from toolkit.testing import run_python
    from toolkit.train.distributed import free_port

    ds_json = tmp_path / "ds.json"
    ds_json.write_text(json.dumps({"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                                         "reduce_bucket_size": 4096},
                                   "train_micro_batch_size_per_gpu": "auto", "gradient_clipping": "auto"}))
    run = tmp_path / "run"

    def launch(*extra: str, status: int = 0, through_launch: bool = False) -> None:
        flags = ["sft", "--model", "tiny-llama", "--strategy", "deepspeed", "--zero", "3", "--deepspeed-config", str(ds_json),
                 "--max-steps", "3", "--global-batch-size", "4", "--seq-len", "96", "--max-samples", "32",
                 "--output", str(run), "--export", "hf", *extra]
        if through_launch:
            done = subprocess.run([sys.executable, "-m", "toolkit", "launch", "--nproc", "2", "--master-port",
                                   str(free_port()), *flags], capture_output=True, text=True, timeout=300, env={**os.environ})
        else:
            done = run_python(["-m", "toolkit", *flags], nproc=2, env={**os.environ}, timeout=300)
        assert done.returncode == status, done.stderr[-5000:]

    # a time-boxed job: checkpoint at step 2, no export yet; stopped, resumable
    launch("--stop-after", "2", status=75, through_launch=True)
    assert (run / "checkpoints" / "step-2" / "deepspeed").is_dir() and not (run / "export").exists()
    launch("--resume", "auto")
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3] and metrics[-1]["loss"] < metrics[0]["loss"]
    assert (run / "checkpoints" / "step-3" / "deepspeed").is_dir()

    # The checkpoint consolidated offline (one process) equals what the run exported live.
    result = cli_runner.invoke("export", str(run), "--to", "hf", "--output", str(tmp_path / "offline"))
    assert result.exit_code == 0, result.output
    ids = torch.arange(5, 45).reshape(2, 20)
    logits = []
    for directory in (run / "export", tmp_path / "offline"):
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
        with torch.no_grad():
            logits.append(model(input_ids=ids).logits)
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=1e-5)


def test_contradicting_json_is_refused_before_training(tmp_path, cli_runner):
    ds_json = tmp_path / "ds.json"
    ds_json.write_text(json.dumps({"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}}))
    result = cli_runner.invoke("sft", "--model", "tiny-llama", "--strategy", "deepspeed", "--zero", "3",
                               "--deepspeed-config", str(ds_json), "--max-steps", "1", "--output", str(tmp_path / "run"))
    assert result.exit_code != 0
    assert "zero_optimization.stage = 2 contradicts --zero (which gives 3)" in result.output
    assert "bf16.enabled = true contradicts --precision" in result.output
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_zero3_evaluation_during_training_equals_one_process(tmp_path):
    from toolkit.testing import run_python, write_jsonl

    # 5 held-out examples over 2 ranks in micro-batches of 2: one rank runs a zeroed padding copy
    held_out = write_jsonl(tmp_path / "eval.jsonl", [{"instruction": f"Name colour {i}.", "output": f"It is {c}."}
                                                     for i, c in enumerate(["red", "green", "blue", "amber", "violet"])])
    flags = ["sft", "--model", "tiny-llama", "--dataset", "demo", "--seq-len", "64", "--max-steps", "2", "--lr", "1e-3",
             "--micro-batch-size", "2", "--global-batch-size", "4", "--eval-dataset", held_out, "--eval-every", "1"]
    launches = {"one": (flags, 1), "zero3": ([*flags, "--strategy", "deepspeed", "--zero", "3"], 2)}
    logged = {}
    for name, (command, nproc) in launches.items():
        done = run_python(["-m", "toolkit", *command, "--output", str(tmp_path / name)], nproc=nproc, env={**os.environ},
                          timeout=300)
        assert done.returncode == 0, done.stderr[-5000:]
        logged[name] = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    for a, b in zip(logged["one"], logged["zero3"], strict=True):
        assert b["eval/examples"] == 5
        for key in ("eval/loss", "eval/perplexity"):
            assert b[key] == pytest.approx(a[key], rel=1e-5), key
