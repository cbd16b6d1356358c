"""End to end through the CLI: LoRA resume is bit-identical, exports reload, QLoRA trains and exports."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors.torch import load_file

from toolkit.errors import RunStopped

COMMON = ["--model", "tiny-llama", "--micro-batch-size", "8", "--seq-len", "64", "--lr", "1e-2", "--seed", "3"]


def toolkit(*args):
    from toolkit.cli import build_cli

    build_cli().main(args=[str(a) for a in args], prog_name="toolkit", standalone_mode=False)


def losses(run):
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def engine_model(run, step):
    """The adapted model exactly as the local engine builds it, with the checkpoint's adapters loaded."""
    from toolkit.export import load_run_recipe
    from toolkit.models import load_hf_model, resolve_model
    from toolkit.plugins import get_plugin_manager
    from toolkit.recipe import thing_options

    recipe = load_run_recipe(run)
    tuner_cls = get_plugin_manager().get("tuner", recipe.tuner)
    tuner = tuner_cls(thing_options(recipe, tuner_cls))
    source = resolve_model(recipe.model)
    model = load_hf_model(source, tuner, recipe, torch.device("cpu"))
    tuner.load_checkpoint_state(model, load_file(str(run / "checkpoints" / f"step-{step}" / "model.safetensors")))
    return model.eval(), source, tuner


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("runs") / "lora"
    toolkit("sft", *COMMON, "--tuner", "lora", "--lora-rank", "4", "--lora-dropout", "0.1", "--max-steps", "6",
            "--save-every", "3", "--keep-last", "3", "--output", run)
    return run


def test_lora_resume_is_bit_identical(lora_run, tmp_path):
    resumed = tmp_path / "resumed"
    flags = [*COMMON, "--tuner", "lora", "--lora-rank", "4", "--lora-dropout", "0.1", "--max-steps", "6", "--output", resumed]
    with pytest.raises(RunStopped):  # the CLI's exit status 75
        toolkit("sft", *flags, "--stop-after", "3")
    assert [p.name for p in (resumed / "checkpoints").iterdir()] == ["step-3"]
    toolkit("sft", *flags, "--resume", "auto")
    first, second = (load_file(str(r / "checkpoints" / "step-6" / "model.safetensors")) for r in (lora_run, resumed))
    assert first.keys() == second.keys() and all("lora_" in name for name in first)
    assert all(torch.equal(first[name], second[name]) for name in first)
    step3 = load_file(str(lora_run / "checkpoints" / "step-3" / "model.safetensors"))
    assert not all(torch.equal(first[name], step3[name]) for name in first), "steps 4-6 must change the adapters"
    optim = [torch.load(r / "checkpoints" / "step-6" / "optimizer.pt", weights_only=True)["state"] for r in (lora_run, resumed)]
    assert all(torch.equal(optim[0][i]["exp_avg_sq"], optim[1][i]["exp_avg_sq"]) for i in optim[0])


@pytest.fixture(scope="module")
def dora_qwen2_run(tmp_path_factory):
    """DoRA on tiny-qwen2: tied embeddings and q/k/v biases."""
    run = tmp_path_factory.mktemp("runs") / "dora-qwen2"
    toolkit("sft", *COMMON[2:], "--model", "tiny-qwen2", "--tuner", "dora", "--dora-rank", "4", "--max-steps", "2",
            "--output", run)
    return run


@pytest.mark.parametrize(("run_name", "step"), [("lora_run", 6), ("dora_qwen2_run", 2)])
def test_exports_reload_with_transformers_and_peft(run_name, step, request, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run = request.getfixturevalue(run_name)
    model, source, _ = engine_model(run, step)
    ids = torch.randint(0, source.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(ids).logits
        toolkit("export", run, "--to", "hf", "--output", tmp_path / "merged")
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
        torch.testing.assert_close(merged(ids).logits, expected, atol=1e-5, rtol=1e-5)
        toolkit("export", run, "--to", "hf", "--adapter-only", "--output", tmp_path / "adapter")
        assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in (tmp_path / "adapter").iterdir()}
        adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(source.directory), tmp_path / "adapter")
        torch.testing.assert_close(adapted(ids).logits, expected, atol=1e-5, rtol=1e-5)


def test_qlora_trains_and_exports_dequantised(tmp_path, caplog):
    from transformers import AutoModelForCausalLM

    run = tmp_path / "qlora"
    toolkit("sft", *COMMON, "--tuner", "qlora", "--qlora-rank", "8", "--qlora-compute-dtype", "fp32", "--max-steps", "8",
            "--output", run)
    curve = losses(run)
    assert sum(curve[-3:]) / 3 < curve[0] - 0.5, f"QLoRA did not learn: {curve}"
    model, source, tuner = engine_model(run, 8)
    assert any(type(p).__name__ == "Params4bit" for p in model.parameters()), "the base must really be 4-bit"
    ids = torch.randint(0, source.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="toolkit.peft"):
        expected = model(ids).logits
        toolkit("export", run, "--to", "hf", "--output", tmp_path / "merged")
        assert "dequantised" in caplog.text and "full-size" in caplog.text
        assert "quantization_config" not in json.loads((tmp_path / "merged" / "config.json").read_text())
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
        assert all(p.dtype == torch.float32 for p in merged.parameters())
        torch.testing.assert_close(merged(ids).logits, expected, atol=1e-4, rtol=1e-4)
        toolkit("export", run, "--to", "hf", "--adapter-only", "--output", tmp_path / "adapter")
        from peft import PeftModel

        # the adapter applies to the original full-precision base (the usual way QLoRA adapters are served)
        adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(source.directory), tmp_path / "adapter")
        lora_b = {n: p for n, p in adapted.named_parameters() if "lora_B" in n}
        assert len(lora_b) == 14 and all(p.abs().sum() > 0 for p in lora_b.values())
        exported = dict(tuner.export_tensors(model))
        model(ids)  # eval without grad: bitsandbytes would repack (and round) 4-bit weights for its CPU kernel
        assert all(torch.equal(exported[name], tensor) for name, tensor in tuner.export_tensors(model))


def test_qlora_without_bitsandbytes_says_what_to_install(monkeypatch, source):
    import sys

    from toolkit.errors import ToolkitError
    from toolkit_peft.tuners import QLoRATuner

    monkeypatch.setitem(sys.modules, "bitsandbytes", None)
    tuner = QLoRATuner()
    problems = tuner.validate(None, source)
    assert len(problems) == 1 and "pip install 'toolkit-peft[qlora]'" in problems[0]
    with pytest.raises(ToolkitError, match="pip install"):
        tuner.model_load_kwargs()


@pytest.mark.slow
def test_lora_on_two_ddp_ranks_equals_one_rank(tmp_path):
    """DDP (gloo, 2 processes) over the adapted model gives the adapters one process gives."""
    import os

    from toolkit.testing import run_python

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    flags = [*COMMON, "--tuner", "lora", "--lora-rank", "4", "--max-steps", "3", "--micro-batch-size", "2",
             "--global-batch-size", "4"]
    for name, nproc in (("one", 1), ("two", 2)):
        result = run_python(["-m", "toolkit", "sft", *flags, "--output", tmp_path / name], nproc=nproc, env=env, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
    assert [round(x, 5) for x in losses(tmp_path / "one")] == [round(x, 5) for x in losses(tmp_path / "two")]
    one, two = (load_file(str(tmp_path / n / "checkpoints" / "step-3" / "model.safetensors")) for n in ("one", "two"))
    assert one.keys() == two.keys() and all("lora_" in k for k in one)
    for key in one:
        torch.testing.assert_close(one[key], two[key], rtol=1e-4, atol=2e-6)


def test_fsdp_lora_export_equals_the_checkpoint_export(tmp_path):
    """Under FSDP the tuner merges from the gathered full state; it must equal the merge from the checkpoint."""
    run = tmp_path / "fsdp"
    toolkit("sft", *COMMON, "--strategy", "fsdp", "--tuner", "dora", "--dora-rank", "4", "--dora-init", "random",
            "--max-steps", "2", "--output", run, "--export", "hf")
    toolkit("export", run, "--to", "hf", "--output", tmp_path / "from-checkpoint")
    in_run, from_checkpoint = (load_file(str(d / "model.safetensors")) for d in (run / "export", tmp_path / "from-checkpoint"))
    assert in_run.keys() == from_checkpoint.keys()
    assert all(torch.equal(in_run[k], from_checkpoint[k]) for k in in_run)
    from toolkit.models import resolve_model

    base = load_file(str(resolve_model("tiny-llama").weight_files[0]))
    key = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.allclose(in_run[key].float(), base[key].float(), atol=1e-4), "the adapters must be merged in"


def test_engine_reference_logps_are_the_frozen_base(tmp_path):
    """What DPO gets as reference on a LoRA run: the base model's log-probs, with no second copy of the model."""
    from toolkit.builtins.strategies import LocalStrategy
    from toolkit.data.pipeline import Batches, load_examples
    from toolkit.models import resolve_model
    from toolkit.plugins import get_plugin_manager
    from toolkit.recipe import resolve_recipe
    from toolkit.train.logps import CausalLMLogps, token_logps

    recipe = resolve_recipe({"model": "tiny-llama", "tuner": "lora",
                             "seq_len": 64, "micro_batch_size": 4, "output": str(tmp_path)})
    manager = get_plugin_manager()
    tuner_cls = manager.get("tuner", "lora")
    tuner, loss = tuner_cls(tuner_cls.Config(rank=4, init="random")), manager.get("loss", "sft")()
    source = resolve_model("tiny-llama")
    assert not tuner.validate(recipe, source)
    engine = LocalStrategy().build(source, tuner, loss, recipe)
    assert engine.reference is None, "no copy of the model: the reference is the policy with adapters disabled"
    examples, _ = load_examples(["demo"], source.tokenizer, seq_len=64, max_samples=8)
    batches = Batches(examples, seed=0, seq_len=64, packing=False, micro_batch_size=4, global_batch_size=4,
                      dp_rank=0, dp_world_size=1, pad_id=source.tokenizer.pad_token_id)
    micro_batch = batches.micro_batches(0)[0]
    engine.train_step([micro_batch], loss, batches.context(0))  # reference must not depend on training the adapters
    reference = engine.reference_logps(micro_batch)
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(source.directory)
    with torch.no_grad():
        expected = token_logps(CausalLMLogps(base), micro_batch, torch.device("cpu")).sequence_sums()
        policy = token_logps(engine.module, micro_batch, torch.device("cpu")).sequence_sums()
    torch.testing.assert_close(reference, expected, atol=1e-4, rtol=1e-5)
    assert not torch.allclose(policy, expected, atol=1e-2), "the adapted policy must differ from the reference"
