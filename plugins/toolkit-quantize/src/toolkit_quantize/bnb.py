"""``--quantize bnb4`` (NF4, double quantisation) and ``--quantize bnb8`` (LLM.int8()): transformers loads the
unquantized export through a ``BitsAndBytesConfig`` and serialises the quantized model; the result loads
with ``from_pretrained`` (the config carries its ``quantization_config``) and is a base for QLoRA."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
from pathlib import Path
from typing import Any, ClassVar

from toolkit.plugins import install_hint

CPU_QUANTIZATION = "0.46"
"""bitsandbytes quantizes and runs 4-bit and 8-bit layers on CPU from 0.46.0 (before: CUDA only)."""


def bitsandbytes_problems(name: str) -> list[str]:
    if importlib.util.find_spec("bitsandbytes") is None:
        return [f"--quantize {name} needs bitsandbytes, which is not installed: {install_hint('toolkit-quantize', 'bnb')}"]
    import torch
    from packaging.version import Version

    installed = importlib.metadata.version("bitsandbytes")
    if not torch.cuda.is_available() and Version(installed) < Version(CPU_QUANTIZATION):
        return [f"--quantize {name} without a CUDA GPU needs bitsandbytes >= {CPU_QUANTIZATION} (its CPU backend came in "
                f"0.46.0), but {installed} is installed: pip install -U 'bitsandbytes>={CPU_QUANTIZATION}'"]
    return []


def compute_dtype() -> Any:
    import torch

    return torch.bfloat16 if torch.cuda.is_available() else torch.float32


def save_quantized(model_dir: Path, output: Path, quantization: Any) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = "cuda" if torch.cuda.is_available() else "cpu"  # bitsandbytes quantises while loading onto the device
    model = AutoModelForCausalLM.from_pretrained(model_dir, quantization_config=quantization, dtype=compute_dtype(),
                                                 device_map=device)
    model.save_pretrained(output)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(output)


@dataclasses.dataclass(kw_only=True)
class BnB4Config:
    """NF4 weights with double quantisation (QLoRA's format); the output head stays unquantized."""


class BnB4:
    name: ClassVar[str] = "bnb4"
    Config: ClassVar[type] = BnB4Config
    needs_calibration: ClassVar[bool] = False

    def __init__(self, config: Any = None):
        self.config = config or self.Config()

    def validate(self) -> list[str]:
        return bitsandbytes_problems(self.name)

    def quantize(self, model_dir: Path, output: Path, calibration: list[list[int]] | None) -> None:
        from transformers import BitsAndBytesConfig

        save_quantized(model_dir, output, BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                             bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=compute_dtype()))


@dataclasses.dataclass(kw_only=True)
class BnB8Config:
    """LLM.int8(): int8 weights, outlier features in 16 bits; the output head stays unquantized."""


class BnB8(BnB4):
    name: ClassVar[str] = "bnb8"
    Config: ClassVar[type] = BnB8Config

    def quantize(self, model_dir: Path, output: Path, calibration: list[list[int]] | None) -> None:
        from transformers import BitsAndBytesConfig

        save_quantized(model_dir, output, BitsAndBytesConfig(load_in_8bit=True))
