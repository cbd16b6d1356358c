"""``--quantize gptq`` (W4A16), ``awq`` (W4A16 asymmetric, AWQ smoothing) and ``fp8`` (FP8 W8A8, dynamic
per-token activation scales) through llm-compressor's ``oneshot``; the output is a compressed-tensors
checkpoint, which vLLM serves natively and transformers loads (decompressing where no kernel runs).

llm-compressor 0.14 pins transformers<=5.17, older than the rest of the toolkit's: it is tested in a
session of its own (``nox -s tests-quantize``), and ``validate`` names the conflict when
the installed transformers cannot import it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, ClassVar

from toolkit.plugins import install_hint

IGNORE = ["lm_head"]


def llmcompressor_problems(name: str) -> list[str]:
    try:
        import llmcompressor  # noqa: F401
    except Exception as exc:  # not installed, or installed beside a transformers it does not accept
        return [f"--quantize {name} needs llm-compressor, which is not importable ({type(exc).__name__}: {exc}); install it in an environment "
                f"of its own (it pins transformers<=5.17): {install_hint('toolkit-quantize', 'llmcompressor')}"]
    return []


def calibration_dataset(calibration: list[list[int]]) -> Any:
    from datasets import Dataset

    return Dataset.from_dict({"input_ids": calibration, "attention_mask": [[1] * len(ids) for ids in calibration]})


def run_oneshot(model_dir: Path, output: Path, recipe: Any, calibration: list[list[int]] | None) -> None:
    import torch
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16 if torch.cuda.is_available() else torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    kwargs: dict[str, Any] = {}
    if calibration is not None:
        kwargs = {"dataset": calibration_dataset(calibration), "num_calibration_samples": len(calibration),
                  "max_seq_length": max(len(ids) for ids in calibration)}
    oneshot(model=model, tokenizer=tokenizer, recipe=recipe, **kwargs)
    model.save_pretrained(output, save_compressed=True)
    tokenizer.save_pretrained(output)


@dataclasses.dataclass(kw_only=True)
class GPTQConfig:
    """4-bit weights (group size 128), 16-bit activations; GPTQ's second-order error correction on your data."""


class GPTQ:
    name: ClassVar[str] = "gptq"
    Config: ClassVar[type] = GPTQConfig
    needs_calibration: ClassVar[bool] = True

    def __init__(self, config: Any = None):
        self.config = config or self.Config()

    def validate(self) -> list[str]:
        return llmcompressor_problems(self.name)

    def recipe(self) -> Any:
        from llmcompressor.modifiers.gptq import GPTQModifier

        return GPTQModifier(targets="Linear", scheme="W4A16", ignore=IGNORE)

    def quantize(self, model_dir: Path, output: Path, calibration: list[list[int]] | None) -> None:
        run_oneshot(model_dir, output, self.recipe(), calibration)


@dataclasses.dataclass(kw_only=True)
class AWQConfig:
    """4-bit asymmetric weights after AWQ's activation-aware channel scaling, calibrated on your data."""


class AWQ(GPTQ):
    name: ClassVar[str] = "awq"
    Config: ClassVar[type] = AWQConfig

    def validate(self) -> list[str]:
        import torch

        if not torch.cuda.is_available():
            # llm-compressor 0.14's AWQ pins its cached activations (pipelines/cache.py, pin_memory) for GPU
            # transfers, which raises "Cannot access accelerator device" on a machine without one.
            return ["--quantize awq needs a CUDA GPU: llm-compressor's AWQ pins host memory for its grid search, which "
                    "fails without an accelerator; on this machine use --quantize gptq (also 4-bit weights, W4A16)"]
        return super().validate()

    def recipe(self) -> Any:
        from llmcompressor.modifiers.quantization import QuantizationModifier
        from llmcompressor.modifiers.transform import AWQModifier

        return [AWQModifier(duo_scaling="both"), QuantizationModifier(targets=["Linear"], scheme="W4A16_ASYM", ignore=IGNORE)]


@dataclasses.dataclass(kw_only=True)
class FP8Config:
    """FP8 (e4m3) weights per channel and activations per token, scaled at run time: no calibration."""


class FP8(GPTQ):
    name: ClassVar[str] = "fp8"
    Config: ClassVar[type] = FP8Config
    needs_calibration: ClassVar[bool] = False

    def recipe(self) -> Any:
        from llmcompressor.modifiers.quantization import QuantizationModifier

        return QuantizationModifier(targets="Linear", scheme="FP8_DYNAMIC", ignore=IGNORE)
