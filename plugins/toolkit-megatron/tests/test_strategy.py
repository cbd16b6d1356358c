"""The megatron strategy through the CLI: 5 SFT steps equal the local strategy at every layout,
resume reproduces the remaining steps, the HF export equals local's, LoRA equals local LoRA."""

from __future__ import annotations

import json
import os

import pytest
import torch

from toolkit.testing import run_distributed, run_python

pytestmark = pytest.mark.slow

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
COMMON = ["--model", "tiny-llama", "--dataset", "demo", "--seq-len", "64", "--lr", "1e-3", "--max-steps", "5",
          "--micro-batch-size", "2", "--global-batch-size", "4"]
TOLERANCE = 1e-4


def toolkit(*args: str, nproc: int = 1, warnings: str = "ignore") -> None:
    """``python -m toolkit ARGS`` on ``nproc`` ranks; ``warnings``: their PYTHONWARNINGS (``error:MESSAGE`` fails the run)."""
    if nproc > 1:  # the ranks with torchrun's environment, without torchrun's own process (its imports: ~1.6 s of CPU)
        run_distributed(["-m", "toolkit", *args], nproc=nproc, timeout=400,
                        env={"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": warnings, "HF_HUB_OFFLINE": "1"})
        return
    result = run_python(["-m", "toolkit", *args], env={**ENV, "PYTHONWARNINGS": warnings}, timeout=400)
    assert result.returncode == 0, f"{args} failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"


def metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def assert_same_steps(expected, got):
    assert [m["step"] for m in got] == [m["step"] for m in expected]
    for a, b in zip(expected, got, strict=True):
        assert abs(a["loss"] - b["loss"]) <= TOLERANCE, (a, b)
        # the same tokens trained, counted once however many ranks hold them
        assert (a["trained_tokens"], a["row_fill"]) == (b["trained_tokens"], b["row_fill"]), (a, b)
        assert abs(a["grad_norm"] - b["grad_norm"]) <= TOLERANCE * max(1.0, a["grad_norm"]), (a, b)


@pytest.fixture(scope="module")
def family_local_run(tmp_path_factory):
    """(args, local run dir) of 3 SFT steps of an added family with the bundled tokenizer, by (family, tuner), trained
    (and exported to HF) once for every layout compared to it."""
    runs = {}

    def run(family: str, tuner: str):
        if (family, tuner) not in runs:
            from conftest import cli_model_dir

            root = tmp_path_factory.mktemp(f"{family}-{tuner}")
            model = cli_model_dir(family, root / family)
            args = ["--model", str(model), *COMMON[2:], "--tuner", tuner, "--max-steps", "3",
                    *(["--lr", "1e-2"] if tuner == "lora" else [])]
            toolkit("sft", *args, "--output", str(root / "local"), "--export", "hf")
            runs[family, tuner] = (args, root / "local")
        return runs[family, tuner]

    return run


@pytest.mark.parametrize(("family", "tuner", "layout"), [("phi3", "lora", []), ("phi3", "lora", ["--tp", "2"]),
                                                        ("glm4", "full", []), ("gemma2", "full", []),
                                                        ("gemma3_text", "lora", [])],
                         ids=["phi3-lora", "phi3-lora-tp2", "glm4-full", "gemma2-full", "gemma3_text-lora"])
def test_added_family_sft_steps_equal_local(family, tuner, layout, family_local_run, tmp_path):
    """A family added to the bridge trains as `local` does (one process, and Phi-3 with LoRA at TP2 too: the
    bridge's model, RoPE and fused weights; Phi-3 with LoRA on its fused qkv_proj / gate_up_proj; Gemma 2 / 3 with
    their soft-capping and windows of 4 on 64-token rows, Gemma 3 with LoRA on q/k/v/o/gate/up/down; layouts are
    held to HF's logits in test_bridge.py). At TP2 the merged export from the checkpoint (reloaded at TP1, where
    gate_up_proj's B is no longer split) gives the same logits too."""
    from transformers import AutoModelForCausalLM

    args, local = family_local_run(family, tuner)
    toolkit("sft", *args, "--output", str(tmp_path / "megatron"), "--strategy", "megatron", *layout, "--export", "hf",
            nproc=2 if layout else 1)
    assert_same_steps(metrics(local), metrics(tmp_path / "megatron"))
    exports = [tmp_path / "megatron" / "export"]
    if layout:
        toolkit("export", str(tmp_path / "megatron"), "--to", "hf", "--output", str(tmp_path / "from-checkpoint"))
        exports.append(tmp_path / "from-checkpoint")
    ids = torch.arange(5, 40)[None]  # the exports (LoRA merged into the fused weights) give the same logits
    with torch.no_grad():
        eager = {"attn_implementation": "eager"}  # the attention that soft-caps (Gemma 2) on every transformers
        expected = AutoModelForCausalLM.from_pretrained(local / "export", **eager)(ids).logits
        for export in exports:
            exported = AutoModelForCausalLM.from_pretrained(export, **eager)(ids).logits
            torch.testing.assert_close(exported, expected, rtol=1e-4, atol=1e-4, msg=lambda text, export=export: f"{export}: {text}")


def test_gemma2_context_parallel_sft_steps_equal_local(family_local_run, tmp_path):
    """Gemma 2 at CP2: the window (4 tokens) and the attention soft-capping on keys gathered over the CP group, and
    the soft-capped logits, train as `local` does over 3 steps (gradients through every piece)."""
    args, local = family_local_run("gemma2", "full")
    toolkit("sft", *args, "--output", str(tmp_path / "cp2"), "--strategy", "megatron", "--cp", "2", nproc=2)
    assert_same_steps(metrics(local), metrics(tmp_path / "cp2"))


@pytest.fixture(scope="module")
def local_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("local") / "run"
    toolkit("sft", *COMMON, "--output", str(run), "--export", "hf")
    return run


# tp2 alone is the first layout of test_resume_after_step_3_reproduces_steps_4_5_and_exports: its 5 steps
# (3, then 2 resumed) are held to local's there, so it is not launched a second time here
@pytest.mark.parametrize("layout", [["--pp", "2"], [], ["--tp", "2", "--sequence-parallel"], ["--cp", "2"]],
                         ids=["pp2", "dp2", "tp2-sp", "cp2"])
def test_sft_steps_equal_local(layout, local_run, tmp_path):
    run = tmp_path / "run"
    toolkit("sft", *COMMON, "--output", str(run), "--strategy", "megatron", *layout, nproc=2)
    assert_same_steps(metrics(local_run), metrics(run))
    assert (run / "checkpoints/step-5/mcore/toolkit_mcore.json").is_file()


@pytest.mark.parametrize("layout", [["--tp", "2"], ["--megatron-distributed-optimizer", "--megatron-async-save"]],
                         ids=["tp2", "dp2-distributed-optimizer-async-save"])
def test_resume_after_step_3_reproduces_steps_4_5_and_exports(layout, local_run, tmp_path):
    from transformers import AutoModelForCausalLM

    run = tmp_path / "run"
    toolkit("sft", *COMMON, "--output", str(run), "--strategy", "megatron", *layout, "--stop-after", "3", nproc=2)
    assert len(metrics(run)) == 3
    toolkit("sft", *COMMON, "--output", str(run), "--strategy", "megatron", *layout, "--resume", "auto", "--export", "hf", nproc=2)
    assert_same_steps(metrics(local_run), metrics(run))
    assert (run / "checkpoints/step-5/mcore/toolkit_mcore.json").is_file()
    ids = torch.arange(5, 40)[None]
    with torch.no_grad():
        expected = AutoModelForCausalLM.from_pretrained(local_run / "export")(ids).logits
        exported = AutoModelForCausalLM.from_pretrained(run / "export")(ids).logits
    torch.testing.assert_close(exported, expected, rtol=1e-4, atol=1e-4)


def test_lora_tp2_equals_local_lora_and_exports_merged(tmp_path):
    pytest.importorskip("toolkit_peft", reason="LoRA comes from toolkit-peft")
    from transformers import AutoModelForCausalLM

    lora = ["--tuner", "lora", "--lora-rank", "4", "--lora-alpha", "8", "--max-steps", "3"]
    toolkit("sft", *COMMON, *lora, "--output", str(tmp_path / "local"), "--export", "hf")
    toolkit("sft", *COMMON, *lora, "--output", str(tmp_path / "tp2"), "--strategy", "megatron", "--tp", "2",
            "--export", "hf", nproc=2)
    assert_same_steps(metrics(tmp_path / "local"), metrics(tmp_path / "tp2"))
    toolkit("export", str(tmp_path / "tp2"), "--to", "hf", "--output", str(tmp_path / "from-checkpoint"))
    ids = torch.arange(5, 40)[None]
    with torch.no_grad():
        expected = AutoModelForCausalLM.from_pretrained(tmp_path / "local/export")(ids).logits
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "tp2/export")(ids).logits
        again = AutoModelForCausalLM.from_pretrained(tmp_path / "from-checkpoint")(ids).logits
    torch.testing.assert_close(merged, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(again, merged, rtol=0, atol=1e-6)


def test_dora_tp2_sequence_parallel_equals_local_dora(tmp_path):
    pytest.importorskip("toolkit_peft", reason="DoRA comes from toolkit-peft")
    from transformers import AutoModelForCausalLM

    dora = ["--tuner", "dora", "--dora-rank", "4", "--dora-alpha", "8", "--max-steps", "3"]
    toolkit("sft", *COMMON, *dora, "--output", str(tmp_path / "local"), "--export", "hf")
    toolkit("sft", *COMMON, *dora, "--output", str(tmp_path / "sp"), "--strategy", "megatron", "--tp", "2",
            "--sequence-parallel", "--export", "hf", nproc=2)
    assert_same_steps(metrics(tmp_path / "local"), metrics(tmp_path / "sp"))
    ids = torch.arange(5, 40)[None]
    with torch.no_grad():
        expected = AutoModelForCausalLM.from_pretrained(tmp_path / "local/export")(ids).logits
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "sp/export")(ids).logits
    torch.testing.assert_close(merged, expected, rtol=1e-4, atol=1e-4)


def test_packed_rows_under_context_parallelism_equal_local(tmp_path):
    packed = ["--model", "tiny-llama", "--dataset", "demo", "--seq-len", "128", "--lr", "1e-3", "--max-steps", "3",
              "--micro-batch-size", "2", "--global-batch-size", "4", "--packing"]
    toolkit("sft", *packed, "--output", str(tmp_path / "local"))
    toolkit("sft", *packed, "--output", str(tmp_path / "cp2"), "--strategy", "megatron", "--cp", "2", nproc=2)
    assert_same_steps(metrics(tmp_path / "local"), metrics(tmp_path / "cp2"))


def test_overlapped_grad_reduce_with_distributed_optimizer_equals_local(tmp_path):
    """DP2 with two micro-batches per rank: Megatron's bucketed reduction runs once, after the last one."""
    batch = ["--global-batch-size", "8", "--max-steps", "3"]
    toolkit("sft", *COMMON, *batch, "--output", str(tmp_path / "local"))
    toolkit("sft", *COMMON, *batch, "--output", str(tmp_path / "dp2"), "--strategy", "megatron",
            "--megatron-overlap-grad-reduce", "--megatron-distributed-optimizer", nproc=2)
    local, dp2 = metrics(tmp_path / "local"), metrics(tmp_path / "dp2")
    assert len(local) == 3
    assert_same_steps(local, dp2)


EVAL_RECORDS = [{"instruction": f"Name the colour number {i}.", "output": f"Colour {i} is {c}."}
                for i, c in enumerate(["red", "green", "blue", "amber", "violet"])]


@pytest.fixture(scope="module")
def eval_local_run(tmp_path_factory):
    """(flags, local run dir): 2 steps evaluated after each on 5 held-out examples, trained once for both layouts."""
    from toolkit.testing import write_jsonl

    root = tmp_path_factory.mktemp("eval")
    dataset = write_jsonl(root / "eval.jsonl", EVAL_RECORDS)
    flags = [*COMMON, "--max-steps", "2", "--eval-dataset", str(dataset), "--eval-every", "1"]
    toolkit("sft", *flags, "--output", str(root / "local"))
    return flags, root / "local"


@pytest.mark.parametrize("layout", [["--tp", "2"], ["--pp", "2"]], ids=["tp2", "pp2"])
def test_evaluation_during_training_equals_local(layout, eval_local_run, tmp_path):
    # 5 held-out examples in micro-batches of 2: a short last group, which pipeline stages cannot pass as is
    flags, local = eval_local_run
    toolkit("sft", *flags, "--output", str(tmp_path / "run"), "--strategy", "megatron", *layout, nproc=2)
    expected, got = metrics(local), metrics(tmp_path / "run")
    assert [m["step"] for m in got] == [1, 2]
    for a, b in zip(expected, got, strict=True):
        assert b["eval/examples"] == 5
        for key in ("eval/loss", "eval/perplexity"):
            assert b[key] == pytest.approx(a[key], rel=1e-5), key


def test_dpo_evaluation_under_pipeline_parallelism_equals_local(tmp_path):
    pytest.importorskip("toolkit_dpo", reason="DPO comes from toolkit-dpo")
    flags = ["--model", "tiny-llama", "--dataset", "parity-prefs", "--max-samples", "24", "--seq-len", "64", "--lr", "1e-3",
             "--max-steps", "2", "--micro-batch-size", "2", "--global-batch-size", "4", "--eval-samples", "5",
             "--eval-every", "1", "--precompute-reference"]
    toolkit("dpo", *flags, "--output", str(tmp_path / "local"))
    toolkit("dpo", *flags, "--output", str(tmp_path / "pp2"), "--strategy", "megatron", "--pp", "2", nproc=2)
    expected, got = metrics(tmp_path / "local"), metrics(tmp_path / "pp2")
    for a, b in zip(expected, got, strict=True):
        for key in ("eval/loss", "eval/rewards/margins", "eval/rewards/accuracies", "eval/rewards/chosen"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
