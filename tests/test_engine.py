"""The local engine against independent references: HF's own loss, packing, accumulation, resume, export."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from toolkit.builtins.loaders import resolve_model
from toolkit.builtins.losses import SFTLoss
from toolkit.data.pipeline import collate, load_examples
from toolkit.recipe import resolve_recipe
from toolkit.train.logps import CausalLMLogps, token_logps
from toolkit.train.runner import run_training


@pytest.fixture(scope="module")
def source():
    return resolve_model("tiny-llama")


@pytest.fixture(scope="module")
def model(source):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(source.directory, dtype=torch.float32).eval()


def test_sft_loss_equals_hf_labels_loss(source, model):
    examples, _ = load_examples(["demo"], source.tokenizer, max_samples=4)
    batch = collate(examples, [[0], [1], [2], [3]], pad_id=source.tokenizer.pad_token_id, packing=False)
    with torch.no_grad():
        out = token_logps(CausalLMLogps(model), batch, torch.device("cpu"))
        ours = SFTLoss()(out, _ctx(batch)).loss
        # HF shifts labels itself: its label at t+1 is ours at t
        hf_labels = torch.cat([torch.full_like(batch["labels"][:, :1], -100), batch["labels"][:, :-1]], dim=1)
        attention = (batch["sequence_ids"] >= 0).long()
        reference = model(input_ids=batch["input_ids"], attention_mask=attention, labels=hf_labels).loss
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-6)


def _ctx(batch):
    from toolkit.contracts import StepContext

    return StepContext(label_tokens=int((batch["labels"] != -100).sum()), sequences=batch["num_sequences"], examples=batch["num_sequences"])


def test_packed_and_unpacked_give_the_same_per_sample_losses(source, model):
    examples, _ = load_examples(["demo"], source.tokenizer, max_samples=5)
    pad = source.tokenizer.pad_token_id
    with torch.no_grad():
        packed = token_logps(CausalLMLogps(model), collate(examples, [[0, 1, 2, 3, 4]], pad, packing=True), torch.device("cpu"))
        plain = token_logps(CausalLMLogps(model), collate(examples, [[0], [1], [2], [3], [4]], pad, packing=False), torch.device("cpu"))
    assert packed.logps.shape[0] == 1 and plain.logps.shape[0] == 5
    torch.testing.assert_close(packed.sequence_sums(), plain.sequence_sums(), rtol=1e-5, atol=1e-5)


def train(tmp_path, name, **values):
    recipe = resolve_recipe({"model": "tiny-llama", "dataset": ["demo"], "output": str(tmp_path / name), "lr": 1e-3,
                             "seq_len": 128, "log_every": 1, **values})
    run_dir = run_training(recipe)
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return run_dir, metrics


def final_weights(run_dir):
    newest = sorted((run_dir / "checkpoints").iterdir(), key=lambda p: int(p.name.split("-")[1]))[-1]
    return load_file(str(newest / "model.safetensors"))


def test_accumulation_equals_one_big_batch(tmp_path):
    one, m1 = train(tmp_path, "big", micro_batch_size=4, global_batch_size=4, max_steps=3)
    acc, m2 = train(tmp_path, "acc", micro_batch_size=1, global_batch_size=4, max_steps=3)
    for a, b in zip(m1, m2):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
    w1, w2 = final_weights(one), final_weights(acc)
    for key in w1:
        torch.testing.assert_close(w1[key], w2[key], rtol=1e-4, atol=2e-5)  # Adam amplifies fp32 rounding of tiny grads


def test_resume_is_bit_identical(tmp_path):
    straight, _ = train(tmp_path, "straight", micro_batch_size=2, max_steps=20, warmup_steps=3)
    resumed, first = train(tmp_path, "resumed", micro_batch_size=2, max_steps=20, warmup_steps=3, stop_after=10)
    assert [m["step"] for m in first] == list(range(1, 11))
    resumed, metrics = train(tmp_path, "resumed", micro_batch_size=2, max_steps=20, warmup_steps=3, resume="auto")
    a, b = final_weights(straight), final_weights(resumed)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [m["step"] for m in metrics] == list(range(1, 21))


def test_hf_export_reloads_with_same_logits(tmp_path, source):
    from transformers import AutoModelForCausalLM

    run_dir, _ = train(tmp_path, "exp", micro_batch_size=2, max_steps=3, export="hf")
    exported = AutoModelForCausalLM.from_pretrained(run_dir / "export", dtype=torch.float32).eval()
    trained = AutoModelForCausalLM.from_pretrained(source.directory, dtype=torch.float32).eval()
    trained.load_state_dict(final_weights(run_dir), strict=False)
    ids = torch.tensor([source.tokenizer("The capital of Lopehes is").input_ids])
    with torch.no_grad():
        torch.testing.assert_close(exported(ids).logits, trained(ids).logits, rtol=0, atol=0)
    assert (run_dir / "export" / "tokenizer_config.json").is_file()
    assert json.loads((run_dir / "export" / "generation_config.json").read_text())["eos_token_id"] == source.tokenizer.eos_token_id
    assert exported.lm_head.weight.abs().sum() > 0 and not torch.equal(exported.lm_head.weight, trained.lm_head.weight * 0)


def test_bf16_master_weights_track_fp32_and_resume_exactly(tmp_path):
    fp32, m32 = train(tmp_path, "fp32", micro_batch_size=2, global_batch_size=4, max_steps=6)
    bf16, m16 = train(tmp_path, "bf16", micro_batch_size=2, global_batch_size=4, max_steps=6, precision="bf16")
    for a, b in zip(m32, m16):
        assert a["loss"] == pytest.approx(b["loss"], rel=2e-2)  # bf16 compute, same trajectory
    master = load_file(str(bf16 / "checkpoints/step-6/master.safetensors"))
    params = final_weights(bf16)
    assert all(master[k].dtype == torch.float32 and params[k].dtype == torch.bfloat16 for k in master)
    assert all(torch.equal(master[k].to(torch.bfloat16), params[k]) for k in master)
    half, _ = train(tmp_path, "half", micro_batch_size=2, global_batch_size=4, max_steps=6, precision="bf16", stop_after=3)
    half, _ = train(tmp_path, "half", micro_batch_size=2, global_batch_size=4, max_steps=6, precision="bf16", resume="auto")
    resumed = load_file(str(half / "checkpoints/step-6/master.safetensors"))
    assert all(torch.equal(master[k], resumed[k]) for k in master)
