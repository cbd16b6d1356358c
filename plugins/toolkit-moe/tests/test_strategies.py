"""Through the CLI: patched blocks train the same under local (1 process), DDP, FSDP2 and expert parallelism."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from toolkit.testing import run_python

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
COMMON = ["--model", "tiny-qwen3-moe", "--dataset", "demo", "--seq-len", "64", "--lr", "1e-3", "--max-steps", "3",
          "--micro-batch-size", "2", "--global-batch-size", "4", "--max-samples", "16",
          "--moe-enabled", "--moe-experts-backend", "loop", "--router-z-loss-coef", "0.01", "--moe-capacity-factor", "2.0"]
# Five steps, drops (capacity 1.0), a z-loss and clipping that is active (grad norms 4-9 > 0.5).
EP_RUN = ["--model", "tiny-qwen3-moe", "--dataset", "demo", "--seq-len", "64", "--lr", "1e-3", "--max-steps", "5",
          "--micro-batch-size", "2", "--global-batch-size", "4", "--max-samples", "24", "--max-grad-norm", "0.5",
          "--moe-enabled", "--moe-experts-backend", "loop", "--router-z-loss-coef", "0.01", "--moe-capacity-factor", "1.0"]


def toolkit(*args: str, nproc: int = 1, common: list[str] = COMMON) -> str:
    result = run_python(["-m", "toolkit", "sft", *common, *args], nproc=nproc, env=ENV, timeout=300)
    assert result.returncode == 0, f"{args} failed:\n{result.stdout}\n{result.stderr[-3000:]}"
    return result.stdout + result.stderr


def metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def logits(export_dir) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        return AutoModelForCausalLM.from_pretrained(export_dir)(torch.arange(5, 40)[None]).logits


@pytest.mark.slow
def test_local_ddp_and_fsdp_agree_with_moe_blocks(tmp_path):
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
    torch.testing.assert_close(logits(tmp_path / "local/export"), logits(tmp_path / "fsdp/export"), rtol=1e-4, atol=1e-4)


def _same_run(reference: list[dict], other: list[dict], name: str) -> None:
    assert len(other) == len(reference), name
    for a, b in zip(reference, other, strict=True):
        for key in ("loss", "aux_loss", "grad_norm", "moe_dropped_tokens"):
            assert b[key] == pytest.approx(a[key], rel=1e-4), (name, a["step"], key)


@pytest.mark.slow
def test_expert_parallel_training_equals_one_process_and_resumes(tmp_path):
    """--ep 2 on 2 gloo ranks == 1 process == DDP (losses, clipped grad norms, drops, export,
    export from the checkpoint); a run stopped at step 3 resumes (at EP2, and from the same checkpoint at EP1)
    to the same end."""
    toolkit("--output", str(tmp_path / "one"), "--export", "hf", common=EP_RUN)
    toolkit("--output", str(tmp_path / "ddp"), nproc=2, common=EP_RUN)
    out = toolkit("--output", str(tmp_path / "ep2"), "--ep", "2", "--export", "hf", nproc=2, common=EP_RUN)
    assert "experts split over groups of 2 ranks" in out
    one = metrics(tmp_path / "one")
    assert all(m["grad_norm"] > 0.5 for m in one) and sum(m["moe_dropped_tokens"] for m in one) > 0
    _same_run(one, metrics(tmp_path / "ddp"), "ddp")
    _same_run(one, metrics(tmp_path / "ep2"), "ep2")
    reference_logits = logits(tmp_path / "one/export")
    torch.testing.assert_close(logits(tmp_path / "ep2/export"), reference_logits, rtol=1e-4, atol=1e-5)
    # the checkpoint holds full expert tensors: `toolkit export` (one process) gives the same model
    run_python(["-m", "toolkit", "export", tmp_path / "ep2", "--to", "hf", "--output", tmp_path / "from-checkpoint"],
               check=True, env=ENV, timeout=300)
    torch.testing.assert_close(logits(tmp_path / "from-checkpoint"), logits(tmp_path / "ep2/export"), rtol=0, atol=1e-6)

    toolkit("--output", str(tmp_path / "resumed"), "--ep", "2", "--stop-after", "3", nproc=2, common=EP_RUN)
    assert len(metrics(tmp_path / "resumed")) == 3
    shutil.copytree(tmp_path / "resumed", tmp_path / "resumed_ep1")
    toolkit("--output", str(tmp_path / "resumed"), "--ep", "2", "--resume", "auto", "--export", "hf",
            nproc=2, common=EP_RUN)
    toolkit("--output", str(tmp_path / "resumed_ep1"), "--resume", "auto", "--export", "hf", common=EP_RUN)
    for name in ("resumed", "resumed_ep1"):
        _same_run(one, metrics(tmp_path / name), name)
        torch.testing.assert_close(logits(tmp_path / name / "export"), reference_logits, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_expert_parallel_groups_with_replicas(tmp_path):
    """4 processes, --ep 2: two expert groups whose expert gradients are summed over
    the replica pairs (ranks 0+2, 1+3) == one process with the same global batch."""
    run = [*EP_RUN, "--max-steps", "3", "--micro-batch-size", "1"]
    toolkit("--output", str(tmp_path / "one"), common=run)
    toolkit("--output", str(tmp_path / "ep2x2"), "--ep", "2", nproc=4, common=run)
    _same_run(metrics(tmp_path / "one"), metrics(tmp_path / "ep2x2"), "ep2x2")


@pytest.mark.slow
def test_expert_parallel_under_pure_bf16_resumes_bit_identically(tmp_path):
    """--precision bf16 --local-bf16-mode pure with experts sharded over 2 ranks: bf16 expert shards and their bf16
    Adam moments are gathered into the checkpoint and cut again on resume, to the same bits as a straight run;
    the run follows the 1-process one (bf16 round-off apart)."""
    from safetensors.torch import load_file

    pure = [*EP_RUN[:EP_RUN.index("--max-steps")], "--max-steps", "4", *EP_RUN[EP_RUN.index("--max-steps") + 2:],
            "--precision", "bf16", "--local-bf16-mode", "pure", "--save-every", "2"]
    toolkit("--output", str(tmp_path / "one"), common=pure)
    toolkit("--output", str(tmp_path / "ep2"), "--ep", "2", nproc=2, common=pure)
    toolkit("--output", str(tmp_path / "resumed"), "--ep", "2", "--stop-after", "2", nproc=2, common=pure)
    toolkit("--output", str(tmp_path / "resumed"), "--ep", "2", "--resume", "auto", nproc=2, common=pure)
    one, ep2, resumed = (metrics(tmp_path / n) for n in ("one", "ep2", "resumed"))
    assert [m["loss"] for m in resumed] == [m["loss"] for m in ep2]
    straight = load_file(str(tmp_path / "ep2/checkpoints/step-4/model.safetensors"))
    again = load_file(str(tmp_path / "resumed/checkpoints/step-4/model.safetensors"))
    experts = [k for k in straight if ".experts." in k]
    assert experts and all(straight[k].dtype == torch.bfloat16 and torch.equal(straight[k], again[k]) for k in straight)
    optimizer = torch.load(tmp_path / "resumed/checkpoints/step-4/optimizer.pt", weights_only=True)
    assert {v.dtype for s in optimizer["state"].values() for k, v in s.items() if k != "step"} == {torch.bfloat16}
    assert not (tmp_path / "ep2/checkpoints/step-4/master.safetensors").exists()
    assert ep2[0]["loss"] == pytest.approx(one[0]["loss"], rel=1e-3)
    for a, b in zip(one, ep2, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=2e-2) and b["grad_norm"] == pytest.approx(a["grad_norm"], rel=5e-2)
