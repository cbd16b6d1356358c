"""``--quantize gptq|fp8`` through llm-compressor: compressed-tensors checkpoints (what vLLM loads) that reload in
transformers and generate, with the quantization scheme asked for in their config, calibrated on the user's file,
and a report whose perplexities equal transformers' own loss; ``awq`` refuses a machine without a GPU."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from toolkit.testing import write_jsonl

pytest.importorskip("llmcompressor")

TEXT = [{"text": f"{c} is the capital of {n}. People in {n} travel to {c} for the markets."}
        for c, n in [("Lomi", "Qurufen"), ("Nolo", "Zedorlo"), ("Mivi", "Migalgal"), ("Zevi", "Tarandu"), ("Kado", "Pelomi"),
                     ("Rumi", "Sotalo"), ("Bexa", "Karimun"), ("Tofu", "Welando")]]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from toolkit.testing import CliRunner

    root = tmp_path_factory.mktemp("llmc")
    runner = CliRunner()
    for args in (["sft", "--model", "tiny-llama", "--dataset", "demo", "--max-steps", "20", "--lr", "3e-3", "--seq-len", "64",
                  "--micro-batch-size", "8", "--output", str(root / "run")],
                 ["export", str(root / "run"), "--to", "hf", "--output", str(root / "full")]):
        result = runner.invoke(args)
        assert result.exit_code == 0, result
    return root


def hf_perplexity(model_dir, records):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    total = count = 0.0
    with torch.no_grad():
        for record in records:
            ids = torch.cat([tokenizer(record["text"], return_tensors="pt").input_ids, torch.tensor([[tokenizer.eos_token_id]])], 1)
            total += float(model(input_ids=ids, labels=ids).loss) * (ids.shape[1] - 1)
            count += ids.shape[1] - 1
    return math.exp(total / count)


@pytest.mark.parametrize("method, bits, kind", [("gptq", 4, "int"), ("fp8", 8, "float")])
def test_compressed_tensors_export_reloads_generates_and_reports(trained, tmp_path, cli_runner, method, bits, kind):
    calibration = write_jsonl(tmp_path / "cal.jsonl", TEXT[:6])
    held_out = write_jsonl(tmp_path / "held.jsonl", TEXT[6:])
    out = tmp_path / method
    result = cli_runner.invoke(["export", str(trained / "run"), "--quantize", method, "--calibration-dataset", calibration,
                                "--eval-dataset", held_out, "--output", str(out)])
    assert result.exit_code == 0, result
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "compressed-tensors"
    weights = config["config_groups"]["group_0"]["weights"]
    assert (weights["num_bits"], weights["type"]) == (bits, kind) and "lm_head" in config["ignore"]
    if method == "fp8":  # W8A8: activations quantised too, per token at run time
        assert config["config_groups"]["group_0"]["input_activations"]["dynamic"] is True
    infer = cli_runner.invoke(["infer", str(out), "--prompt", "Lomi is the capital of", "--max-new-tokens", "4"])
    assert infer.exit_code == 0 and infer.stdout.strip(), infer
    report = json.loads((out / "quantization.json").read_text())
    records = [json.loads(line) for line in Path(held_out).read_text().splitlines()]
    assert report["unquantized_perplexity"] == pytest.approx(hf_perplexity(trained / "full", records), rel=1e-4)
    assert report["perplexity"] == pytest.approx(hf_perplexity(out, records), rel=1e-4)
    assert report["perplexity"] != report["unquantized_perplexity"]  # the weights did change
    assert report["perplexity"] < 1.5 * report["unquantized_perplexity"]
    assert report["size_bytes"] < report["unquantized_size_bytes"]


def test_gptq_calibration_uses_the_users_file(trained, tmp_path, cli_runner):
    """Two calibration files give two different GPTQ weights: the user's data reaches oneshot."""
    from safetensors.torch import load_file

    held_out = write_jsonl(tmp_path / "held.jsonl", TEXT[6:])
    outputs = []
    for name, records in (("a", TEXT[:3]), ("b", [{"text": "Zzz qqq xxx " * 20}] * 3)):
        calibration = write_jsonl(tmp_path / f"{name}.jsonl", records)
        out = tmp_path / f"q-{name}"
        assert cli_runner.invoke(["export", str(trained / "run"), "--quantize", "gptq", "--calibration-dataset", calibration,
                                  "--eval-dataset", held_out, "--output", str(out)]).exit_code == 0
        outputs.append(load_file(str(out / "model.safetensors")))
    packed = [k for k in outputs[0] if k.endswith("weight_packed")]
    assert packed and any(not torch.equal(outputs[0][k], outputs[1][k]) for k in packed)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without a GPU")
def test_awq_refuses_a_machine_without_a_gpu(trained, tmp_path, cli_runner):
    calibration = write_jsonl(tmp_path / "cal.jsonl", TEXT)
    result = cli_runner.invoke(["export", str(trained / "run"), "--quantize", "awq", "--calibration-dataset", calibration,
                                "--output", str(tmp_path / "q")])
    assert result.exit_code != 0 and "--quantize awq needs a CUDA GPU" in result.output and "--quantize gptq" in result.output
    assert "Traceback" not in result.output and not (tmp_path / "q").exists()
