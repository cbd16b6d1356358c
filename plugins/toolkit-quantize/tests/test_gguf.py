"""``--to gguf``: transformers' own GGUF reader (which undoes llama.cpp's q/k permutation itself) loads the
file into the logits of the HF export, f16 to fp16 rounding and q8_0 to 8-bit rounding; the vocabulary
round-trips into the same token ids; the Modelfile names the file and the ChatML template; other families refuse."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from toolkit.testing import CliRunner

    root = tmp_path_factory.mktemp("gguf")
    runner = CliRunner()
    for args in (["sft", "--model", "tiny-llama", "--dataset", "demo", "--max-steps", "5", "--lr", "3e-3", "--seq-len", "64",
                  "--output", str(root / "run")], ["export", str(root / "run"), "--to", "hf", "--output", str(root / "full")]):
        result = runner.invoke(args)
        assert result.exit_code == 0, result
    return root


@pytest.mark.parametrize("dtype, atol", [("f32", 1e-4), ("f16", 5e-3), ("q8_0", 5e-2)])
def test_gguf_reloads_into_the_same_logits(run, tmp_path, cli_runner, dtype, atol):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "gguf"
    result = cli_runner.invoke(["export", str(run / "run"), "--to", "gguf", "--option", f"dtype={dtype}", "--output", str(out)])
    assert result.exit_code == 0, result
    full = AutoModelForCausalLM.from_pretrained(run / "full", dtype=torch.float32).eval()
    loaded = AutoModelForCausalLM.from_pretrained(out, gguf_file="model.gguf", dtype=torch.float32).eval()
    ids = torch.tensor([[1, 5, 9, 14, 20, 33, 100, 200, 300, 400]])
    with torch.no_grad():
        expected, got = full(ids).logits, loaded(ids).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=atol)
    text = "Lomi is the capital of Qurufen.<|im_end|>"
    tokenizer = AutoTokenizer.from_pretrained(out, gguf_file="model.gguf")
    assert tokenizer(text).input_ids == AutoTokenizer.from_pretrained(run / "full")(text).input_ids
    modelfile = (out / "Modelfile").read_text()
    assert modelfile.startswith("FROM ./model.gguf\n") and "<|im_start|>{{ .Role }}" in modelfile
    assert 'PARAMETER stop "<|im_end|>"' in modelfile


def test_q8_0_is_smaller_than_f16(run, tmp_path, cli_runner):
    sizes = {}
    for dtype in ("f16", "q8_0"):
        assert cli_runner.invoke(["export", str(run / "run"), "--to", "gguf", "--option", f"dtype={dtype}",
                                  "--output", str(tmp_path / dtype)]).exit_code == 0
        sizes[dtype] = (tmp_path / dtype / "model.gguf").stat().st_size
    assert sizes["q8_0"] < 0.7 * sizes["f16"]


def test_a_family_without_a_gguf_mapping_is_refused(tmp_path, cli_runner):
    result = cli_runner.invoke(["export", "tiny-qwen2-moe", "--to", "gguf", "--output", str(tmp_path / "g")])
    assert result.exit_code != 0 and "--to gguf writes llama, mistral, qwen2 models" in result.output, result
    assert "Traceback" not in result.output and not (tmp_path / "g").exists()


@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_other_supported_families_reload(tmp_path, cli_runner, family):
    """Mistral is written as llama.cpp's llama architecture (q/k permuted); Qwen2 as qwen2 (q/k/v biases, no permutation)."""
    from transformers import AutoModelForCausalLM

    for to in ("hf", "gguf"):
        assert cli_runner.invoke(["export", f"tiny-{family}", "--to", to, "--output", str(tmp_path / to)]).exit_code == 0
    full = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "gguf", gguf_file="model.gguf", dtype=torch.float32).eval()
    ids = torch.tensor([[1, 5, 9, 14, 20, 33]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, full(ids).logits, rtol=0, atol=5e-3)


def test_toolkit_plugins_lists_what_this_plugin_registers(cli_runner):
    import json

    result = cli_runner.invoke(["plugins", "--json"])
    assert result.exit_code == 0, result
    (row,) = [r for r in json.loads(result.stdout) if r["name"] == "quantize"]
    assert row["distribution"] == "toolkit-quantize" and row["error"] is None
    assert row["registers"] == {"quantizer": ["bnb4", "bnb8", "gptq", "awq", "fp8"], "exporter": ["gguf"]}
