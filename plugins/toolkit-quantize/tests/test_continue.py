"""Training goes on from a quantized export: QLoRA on a bnb4 export, LoRA on a GPTQ export (loaded decompressed);
the first step's loss is the quantized model's (close to the unquantized base's, far from an untrained one's),
and the merged result exports as a plain HF model that quantizes again."""

from __future__ import annotations

import json

import pytest

from toolkit.testing import write_jsonl

pytest.importorskip("toolkit_peft")

TEXT = [{"text": f"{c} is the capital of {n}. People in {n} travel to {c} for the markets."}
        for c, n in [("Lomi", "Qurufen"), ("Nolo", "Zedorlo"), ("Mivi", "Migalgal"), ("Zevi", "Tarandu"), ("Kado", "Pelomi")]]
TRAIN = ["--dataset", "demo", "--max-steps", "3", "--seq-len", "64", "--micro-batch-size", "4", "--seed", "3"]


def ok(cli_runner, *args):
    result = cli_runner.invoke([str(a) for a in args])
    assert result.exit_code == 0, result
    return result


def first_loss(run):
    return json.loads((run / "metrics.jsonl").read_text().splitlines()[0])["loss"]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny model trained a little (so quantisation has something to keep) and its plain export."""
    from toolkit.testing import CliRunner

    root = tmp_path_factory.mktemp("continue")
    runner = CliRunner()
    ok(runner, "sft", "--model", "tiny-llama", "--dataset", "demo", "--max-steps", "20", "--lr", "3e-3", "--seq-len", "64",
       "--micro-batch-size", "8", "--output", root / "run")
    ok(runner, "export", root / "run", "--to", "hf", "--output", root / "full")
    ok(runner, "sft", "--model", root / "full", "--tuner", "lora", *TRAIN, "--output", root / "lora-on-full")
    return root


@pytest.mark.parametrize("method, tuner, module", [("bnb4", "qlora", "bitsandbytes"), ("gptq", "lora", "llmcompressor")])
def test_training_continues_from_a_quantized_export(base, tmp_path, cli_runner, method, tuner, module):
    pytest.importorskip(module)
    held_out = write_jsonl(tmp_path / "held.jsonl", TEXT)
    calibration = ["--calibration-dataset", held_out] if method == "gptq" else []
    ok(cli_runner, "export", base / "run", "--quantize", method, *calibration, "--eval-dataset", held_out, "--output", tmp_path / "q")
    ok(cli_runner, "sft", "--model", tmp_path / "q", "--tuner", tuner, *TRAIN, "--output", tmp_path / "tuned")
    # LoRA starts as the identity: step 1's loss is the base model's on the same rows
    unquantized, quantized = first_loss(base / "lora-on-full"), first_loss(tmp_path / "tuned")
    assert quantized == pytest.approx(unquantized, rel=0.05) and quantized != unquantized
    assert quantized < 0.5 * first_loss_of_untrained(cli_runner, tmp_path)

    ok(cli_runner, "export", tmp_path / "tuned", "--to", "hf", "--output", tmp_path / "merged")
    assert "quantization_config" not in json.loads((tmp_path / "merged/config.json").read_text())
    ok(cli_runner, "infer", tmp_path / "merged", "--prompt", "Lomi is the capital of", "--max-new-tokens", "3")
    ok(cli_runner, "export", tmp_path / "tuned", "--quantize", method, *calibration, "--eval-dataset", held_out,
       "--output", tmp_path / "again")
    assert json.loads((tmp_path / "again/quantization.json").read_text())["method"] == method


def first_loss_of_untrained(cli_runner, tmp_path):
    ok(cli_runner, "sft", "--model", "tiny-llama", "--tuner", "lora", *TRAIN, "--max-steps", "1", "--output", tmp_path / "untrained")
    return first_loss(tmp_path / "untrained")
