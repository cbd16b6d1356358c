"""What LMDeploy's engines require of an HF model directory, as checks that name the problem.

Sources: LMDeploy's documented supported-model tables (docs/en/supported_models/
supported_models.md, v0.16: "TurboMind on CUDA Platform" and "PyTorchEngine on CUDA Platform")
and TurboMind's own gate ``lmdeploy/turbomind/supported_models.py::is_supported``: architecture
in SUPPORTED_ARCHS; for LlamaForCausalLM and Qwen2ForCausalLM ``head_dim`` must be 64 or 128;
no sliding-window attention (note [1]). Both engines compute in float16 or bfloat16.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from toolkit.hfdir import head_dim

# TurboMind's SUPPORTED_ARCHS (text decoders), v0.16 docs + supported_models.py.
TURBOMIND_ARCHITECTURES = frozenset({
    "LlamaForCausalLM", "InternLMForCausalLM", "InternLM2ForCausalLM", "InternLM3ForCausalLM",
    "QWenLMHeadModel", "Qwen2ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM",
    "MistralForCausalLM", "MixtralForCausalLM", "BaiChuanForCausalLM", "BaichuanForCausalLM",
    "DeepseekV2ForCausalLM", "ChatGLMModel", "ChatGLMForConditionalGeneration", "GptOssForCausalLM",
})
# TurboMind checks head_dim for these (is_supported's special case).
TURBOMIND_HEAD_DIM_CHECKED = frozenset({"LlamaForCausalLM", "Qwen2ForCausalLM"})
TURBOMIND_HEAD_DIMS = (64, 128)
# PyTorchEngine on CUDA, text LLM rows of the documented table, as HF architecture names.
PYTORCH_ARCHITECTURES = frozenset({
    "LlamaForCausalLM", "InternLMForCausalLM", "InternLM2ForCausalLM", "InternLM3ForCausalLM",
    "BaichuanForCausalLM", "ChatGLMModel", "MistralForCausalLM", "MixtralForCausalLM", "QWenLMHeadModel",
    "Qwen2ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Qwen3NextForCausalLM",
    "DeepseekForCausalLM", "DeepseekV2ForCausalLM", "MiniCPM3ForCausalLM", "GemmaForCausalLM",
    "Gemma2ForCausalLM", "Starcoder2ForCausalLM", "Phi3ForCausalLM", "PhiMoEForCausalLM", "GlmForCausalLM",
    "Glm4ForCausalLM", "Glm4MoeForCausalLM",
})
DTYPES = ("float16", "bfloat16")
ENGINES = ("turbomind", "pytorch")


@dataclass
class Findings:
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    engine: str | None = None
    """The engine the model will run on (``auto`` resolved)."""



def turbomind_refusals(config: dict[str, Any]) -> list[str]:
    """Why TurboMind would refuse this config (empty: it runs it)."""
    reasons: list[str] = []
    architectures = config.get("architectures") or []
    arch = architectures[0] if architectures else None
    if arch not in TURBOMIND_ARCHITECTURES:
        reasons.append(f"architecture {arch!r} is not in TurboMind's supported list")
    size = head_dim(config)
    if arch in TURBOMIND_HEAD_DIM_CHECKED and size not in TURBOMIND_HEAD_DIMS:
        reasons.append(f"TurboMind runs {arch} only with head_dim 64 or 128, this model has {size}")
    if config.get("use_sliding_window") and config.get("sliding_window"):
        reasons.append("TurboMind does not support sliding-window attention (use_sliding_window is on)")
    quant = (config.get("quantization_config") or {}).get("quant_method")
    if quant == "smooth_quant":
        reasons.append("TurboMind does not run smooth_quant checkpoints")
    return reasons


def check_model_config(config: dict[str, Any], *, engine: str = "auto", dtype: str | None = None) -> Findings:
    """Check ``config.json`` content against LMDeploy; resolves ``engine=auto`` like LMDeploy does
    (TurboMind when it supports the model, else the PyTorch engine)."""
    found = Findings()
    architectures = config.get("architectures") or []
    if not architectures:
        found.errors.append("config.json has no 'architectures': LMDeploy picks the engine and model class from it")
        return found
    arch = architectures[0]
    dtype = dtype or str(config.get("dtype") or config.get("torch_dtype") or "float32")
    if dtype not in DTYPES:
        found.errors.append(f"dtype {dtype!r}: LMDeploy's engines run float16 or bfloat16; export with dtype=bfloat16")
    refusals = turbomind_refusals(config)
    pytorch_ok = arch in PYTORCH_ARCHITECTURES
    if engine == "turbomind":
        found.errors += [f"TurboMind: {reason}" for reason in refusals]
        found.engine = "turbomind"
    elif engine == "pytorch":
        if not pytorch_ok:
            found.errors.append(f"architecture {arch!r} is not in the PyTorch engine's supported list "
                                f"({', '.join(sorted(PYTORCH_ARCHITECTURES))})")
        found.engine = "pytorch"
    else:
        if not refusals:
            found.engine = "turbomind"
        elif pytorch_ok:
            found.engine = "pytorch"
            found.warnings.append("runs on the PyTorch engine, not TurboMind: " + "; ".join(refusals))
        else:
            found.errors.append(f"architecture {arch!r} is supported by neither LMDeploy engine: " + "; ".join(refusals))
    if found.engine == "turbomind" and head_dim(config) not in (128,):
        found.warnings.append("TurboMind's KV-cache int4/int8 quantization needs head_dim 128 (docs note [2])")
    return found
