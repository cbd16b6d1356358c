"""``toolkit export --to hf --quantize bnb4|bnb8``: the export reloads in transformers as bitsandbytes layers,
generates through ``toolkit infer``, matches transformers quantizing the same weights itself, and its report's
size and perplexities equal what transformers' own loss gives on the held-out file."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from toolkit.testing import write_jsonl

pytest.importorskip("bitsandbytes")

TEXT = [{"text": f"{c} is the capital of {n}. People in {n} travel to {c} for the markets."}
        for c, n in [("Lomi", "Qurufen"), ("Nolo", "Zedorlo"), ("Mivi", "Migalgal"), ("Zevi", "Tarandu"), ("Kado", "Pelomi")]]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny run trained enough to have something to lose, and its plain HF export."""
    from toolkit.testing import CliRunner

    root = tmp_path_factory.mktemp("bnb")
    runner = CliRunner()
    result = runner.invoke(["sft", "--model", "tiny-llama", "--dataset", "demo", "--max-steps", "20", "--lr", "3e-3",
                            "--seq-len", "64", "--micro-batch-size", "8", "--output", str(root / "run")])
    assert result.exit_code == 0, result
    result = runner.invoke(["export", str(root / "run"), "--to", "hf", "--output", str(root / "full")])
    assert result.exit_code == 0, result
    return root


def hf_perplexity(model, tokenizer, records):
    """transformers' own mean token loss over each record's text (labels = inputs, shifted by the model)."""
    total = count = 0.0
    with torch.no_grad():
        for record in records:
            ids = tokenizer(record["text"], return_tensors="pt").input_ids
            eos = torch.tensor([[tokenizer.eos_token_id]]) if tokenizer.eos_token_id is not None else ids[:, :0]
            ids = torch.cat([ids, eos], dim=1)
            loss = model(input_ids=ids, labels=ids).loss
            total += float(loss) * (ids.shape[1] - 1)
            count += ids.shape[1] - 1
    return math.exp(total / count)


@pytest.mark.parametrize("method", ["bnb4", "bnb8"])
def test_quantized_export_reloads_generates_and_reports(trained, tmp_path, cli_runner, method):
    import bitsandbytes as bnb
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

    held_out = write_jsonl(tmp_path / "held.jsonl", TEXT)
    out = tmp_path / method
    result = cli_runner.invoke(["export", str(trained / "run"), "--to", "hf", "--quantize", method, "--eval-dataset", held_out,
                                "--output", str(out)])
    assert result.exit_code == 0, result
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    layer = {"bnb4": bnb.nn.Linear4bit, "bnb8": bnb.nn.Linear8bitLt}[method]
    assert isinstance(model.model.layers[0].mlp.down_proj, layer)
    infer = cli_runner.invoke(["infer", str(out), "--prompt", "Lomi is the capital of", "--max-new-tokens", "4"])
    assert infer.exit_code == 0 and infer.stdout.strip(), infer

    # the reference: transformers quantizing the unquantized export itself, in memory
    config = (BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                 bnb_4bit_compute_dtype=torch.float32) if method == "bnb4" else BitsAndBytesConfig(load_in_8bit=True))
    reference = AutoModelForCausalLM.from_pretrained(trained / "full", quantization_config=config, dtype=torch.float32).eval()
    full = AutoModelForCausalLM.from_pretrained(trained / "full", dtype=torch.float32).eval()
    ids = torch.tensor([[1, 5, 9, 14, 20, 33]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits.float(), reference(ids).logits.float(), rtol=1e-3, atol=1e-3)

    report = json.loads((out / "quantization.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(out)
    records = [json.loads(line) for line in Path(held_out).read_text().splitlines()]
    assert report["unquantized_perplexity"] == pytest.approx(hf_perplexity(full, tokenizer, records), rel=1e-4)
    assert report["perplexity"] == pytest.approx(hf_perplexity(reference, tokenizer, records), rel=1e-3)
    assert report["size_bytes"] == sum(p.stat().st_size for p in out.glob("*.safetensors"))
    assert report["size_bytes"] < report["unquantized_size_bytes"] == sum(p.stat().st_size for p in (trained / "full").glob("*.safetensors"))
    # trained weights survive quantisation: far below the perplexity of the untrained model (~vocab size)
    assert report["perplexity"] < 2 * report["unquantized_perplexity"]


def test_without_eval_dataset_the_calibration_tail_is_held_out(trained, tmp_path, cli_runner):
    calibration = write_jsonl(tmp_path / "cal.jsonl", TEXT * 4)
    result = cli_runner.invoke(["export", str(trained / "run"), "--quantize", "bnb8", "--calibration-dataset", calibration,
                                "--output", str(tmp_path / "q")])
    assert result.exit_code == 0, result
    report = json.loads((tmp_path / "q/quantization.json").read_text())
    assert report["eval_dataset"].endswith("(last 10%)") and report["eval_tokens"] > 0


def test_a_bundled_dataset_name_is_held_out_text_as_in_training(trained, tmp_path, cli_runner):
    """--eval-dataset takes what --dataset takes: `demo-text` (bundled) as examples/quantize.yaml suggests."""
    result = cli_runner.invoke(["export", str(trained / "run"), "--quantize", "bnb8", "--eval-dataset", "demo-text",
                                "--output", str(tmp_path / "q")])
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "q/quantization.json").read_text())
    assert report["eval_dataset"] == "demo-text" and report["eval_tokens"] > 100


@pytest.mark.parametrize("args, message", [
    (["--quantize", "bnb4"], "give --eval-dataset FILE"),
    (["--quantize", "gptq", "--eval-dataset", "EVAL"], "calibrates on your data: give --calibration-dataset FILE"),
    (["--quantize", "bnb4", "--eval-dataset", "nope.jsonl"], "--eval-dataset nope.jsonl: no such file"),
    (["--quantize", "bnb4", "--to", "vllm", "--eval-dataset", "EVAL"], "use it with --to hf"),
    (["--quantize", "int3", "--eval-dataset", "EVAL"], "unknown quantizer 'int3'"),
    (["--eval-dataset", "EVAL"], "apply to --quantize"),
])
def test_bad_requests_are_refused_before_anything_loads(trained, tmp_path, cli_runner, args, message):
    held_out = write_jsonl(tmp_path / "held.jsonl", TEXT)
    args = [held_out if a == "EVAL" else a for a in args]
    result = cli_runner.invoke(["export", str(trained / "run"), "--output", str(tmp_path / "q"), *args])
    assert result.exit_code != 0 and message in result.output, result
    assert "Traceback" not in result.output and not (tmp_path / "q").exists()



@pytest.mark.parametrize("installed, refused", [("0.45.5", True), ("0.46.0", False), ("0.50.2", False)])
def test_a_bitsandbytes_without_a_cpu_backend_is_refused_on_cpu(trained, tmp_path, cli_runner, monkeypatch, installed,
                                                                 refused):
    """bitsandbytes quantizes on CPU from 0.46.0: an older one is named, with the upgrade, before anything loads."""
    import importlib.metadata

    import toolkit.export as export
    from toolkit_quantize.bnb import BnB4, BnB8

    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: installed if name == "bitsandbytes" else real(name))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    message = f"without a CUDA GPU needs bitsandbytes >= 0.46 (its CPU backend came in 0.46.0), but {installed} is installed"
    for cls in (BnB4, BnB8):
        assert any(message in p for p in cls().validate()) == refused, cls.name
    if refused:
        monkeypatch.setattr(export, "resolve_export_source", lambda *a, **k: pytest.fail("the model was loaded"))
        result = cli_runner.invoke(["export", str(trained / "run"), "--output", str(tmp_path / "q"), "--quantize", "bnb4",
                                    "--eval-dataset", write_jsonl(tmp_path / "held.jsonl", TEXT)])
        assert result.exit_code != 0 and f"--quantize bnb4 {message}" in result.output, result.output
        assert "Traceback" not in result.output and not (tmp_path / "q").exists()
