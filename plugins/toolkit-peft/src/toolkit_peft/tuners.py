"""The ``lora``, ``dora`` and ``qlora`` tuners: options, validation and the Tuner protocol.

Each tuner injects PEFT adapters into the Hugging Face model in place and returns that same
model, so strategies keep seeing a plain ``transformers`` module (``model.model``,
``lm_head``, ``config`` all work). The :class:`peft.PeftModel` that owns the adapters rides
along (see :func:`toolkit_peft.adapters.peft_model_of`). This module imports no torch.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from toolkit.config import option

if TYPE_CHECKING:
    import torch

    from toolkit.contracts import AdapterSpec, ModelSource
    from toolkit.recipe import Recipe

# init variants that need nothing but the base weights (eva, corda, loftq and lora_ga need data
# or a separate preparation step, which a recipe option cannot express).
INIT_CHOICES = ("default", "gaussian", "orthogonal", "pissa", "olora", "random")
OPTIMIZERS = ("adamw", "adamw8bit", "paged_adamw", "paged_adamw8bit")


@dataclass(kw_only=True)
class LoRAConfig:
    rank: int = option(16, help="LoRA rank r (the inner dimension of the adapter).")
    alpha: float = option(32.0, help="LoRA alpha; the update is scaled by alpha/r (alpha/sqrt(r) with rslora).")
    dropout: float = option(0.0, help="Dropout on the adapter input (0 disables it).")
    target_modules: list[str] = option(
        ["all-linear"],
        help="Layers that get adapters: 'all-linear' (every linear layer but the output head), module names "
        "matched as suffixes (q_proj,v_proj), or one regular expression over full module paths "
        "(e.g. '.*layers\\.[0-3]\\..*proj'; a 're:' prefix forces regex).",
    )
    exclude_modules: list[str] = option([], help="Module names (suffixes) that never get adapters.")
    rslora: bool = option(False, help="Rank-stabilised LoRA: scale by alpha/sqrt(r) instead of alpha/r.")
    modules_to_save: list[str] = option(
        [], help="Modules trained in full and saved with the adapters, e.g. embed_tokens,lm_head (new tokens, a new head)."
    )
    init: str = option(
        "default",
        help="Adapter initialisation: default (B=0), gaussian, orthogonal, pissa, pissa_niter_N (fast SVD), "
        "olora, random (A and B random: the adapter is not a no-op; for debugging).",
    )
    bias: Literal["none", "all", "lora_only"] = option("none", help="Which biases train: none, all, lora_only.")
    fast_forward: bool = option(
        True,
        help="Use the toolkit's LoRA forward (adapter weights cast to the activation dtype and the update fused "
        "into one GEMM) instead of PEFT's, which upcasts every activation to the adapter dtype.",
    )
    optimizer: Literal["adamw", "adamw8bit", "paged_adamw", "paged_adamw8bit"] = option(
        "adamw", help="Optimizer for the adapters: adamw (torch), or bitsandbytes adamw8bit, paged_adamw, paged_adamw8bit."
    )
    base_dtype: Literal["auto", "fp32", "bf16", "fp16"] = option(
        "auto",
        help="dtype of the frozen base weights: auto loads them in the --precision dtype (bf16/fp16 need no fp32 "
        "master copy of weights that never change), fp32 otherwise.",
    )
    export_dtype: Literal["auto", "fp32", "bf16", "fp16"] = option(
        "auto", help="dtype of merged exports: auto keeps the base model's dtype (the compute dtype for qlora)."
    )

    def __post_init__(self) -> None:
        # flags give "q_proj,v_proj" as one item; a regex (which may hold commas) stays whole
        if target_regex(self.target_modules) is None:
            self.target_modules = split_names(self.target_modules)
        self.exclude_modules = split_names(self.exclude_modules)
        self.modules_to_save = split_names(self.modules_to_save)

    def check(self) -> list[str]:
        problems = []
        if self.rank < 1:
            problems.append(f"rank must be at least 1, got {self.rank}")
        if self.alpha <= 0:
            problems.append(f"alpha must be positive, got {self.alpha}")
        if not 0.0 <= self.dropout < 1.0:
            problems.append(f"dropout must be in [0, 1), got {self.dropout}")
        if not self.target_modules:
            problems.append("target_modules is empty: give 'all-linear', module names or a regex")
        if self.init not in INIT_CHOICES and not re.fullmatch(r"pissa_niter_\d+", self.init):
            problems.append(
                f"init {self.init!r} is not supported; choose one of {', '.join(INIT_CHOICES)} or pissa_niter_N "
                "(eva, corda and loftq need data or a separate preparation step: use PEFT directly for those)"
            )
        regex = target_regex(self.target_modules)
        if regex is not None:
            try:
                re.compile(regex)
            except re.error as exc:
                problems.append(f"target_modules regex {regex!r} does not compile: {exc}")
        return problems


@dataclass(kw_only=True)
class QLoRAConfig(LoRAConfig):
    quant_type: Literal["nf4", "fp4"] = option("nf4", help="4-bit data type of the frozen base (bitsandbytes).")
    double_quant: bool = option(True, help="Quantise the quantisation constants too (saves ~0.4 bit per weight).")
    compute_dtype: Literal["bf16", "fp16", "fp32"] = option("bf16", help="dtype the 4-bit weights are dequantised to for matmuls.")


def split_names(values: list[str]) -> list[str]:
    return [name.strip() for value in values for name in value.split(",") if name.strip()]


def target_regex(targets: list[str]) -> str | None:
    """The regex in ``targets``, or ``None`` when they are names / ``all-linear``."""
    if len(targets) != 1:
        return None
    (value,) = targets
    if value.startswith("re:"):
        return value[3:]
    return value if re.search(r"[*\[\]()|^$\\+?{}]", value) else None


class LoRATuner:
    """Low-rank adapters on the chosen linear layers; the base stays frozen."""

    name: ClassVar[str] = "lora"
    Config: ClassVar[type] = LoRAConfig
    use_dora: ClassVar[bool] = False
    quantized: ClassVar[bool] = False

    def __init__(self, config: LoRAConfig | None = None):
        self.config = config or self.Config()
        self.precision = "fp32"
        """The recipe's --precision, recorded by :meth:`validate` (runs before the model is loaded)."""

    # ------------------------------------------------------------------ protocol

    def validate(self, recipe: Recipe, source: ModelSource) -> list[str]:
        from toolkit_peft.targets import target_problems

        self.precision = getattr(recipe, "precision", "fp32")
        problems = [f"{self.name}: {p}" for p in self.config.check()]
        if self.config.optimizer != "adamw" or self.quantized:
            problems += [f"{self.name}: {p}" for p in bitsandbytes_problems(self.name)]
        if self.config.optimizer != "adamw" and getattr(recipe, "optimizer", "adamw") != "adamw":
            problems.append(f"--{self.name}-optimizer {self.config.optimizer} and --optimizer {recipe.optimizer} both choose "
                            f"the optimizer; give one (--optimizer adamw-8bit is --{self.name}-optimizer adamw8bit)")
        strategy = getattr(recipe, "strategy", "local")
        if self.quantized and strategy in ("megatron", "fsdp"):
            problems.append(f"qlora: --strategy {strategy} cannot shard 4-bit bitsandbytes weights; use --strategy local "
                            "(DDP under torchrun) or --tuner lora")
        if strategy == "megatron" and self.config.init.startswith(("pissa", "olora")):
            problems.append(f"--{self.name}-init {self.config.init} derives the adapters from the base weights and changes "
                            "those weights, which the megatron strategy loads itself; use default, gaussian, orthogonal or random")
        if not problems:
            problems += [f"{self.name}: {p}" for p in target_problems(self.config, source)]
        return problems

    def model_load_kwargs(self) -> dict[str, Any]:
        from toolkit_peft.quant import torch_dtype

        return {"dtype": torch_dtype(self.base_dtype())}

    def base_dtype(self) -> str:
        if self.config.base_dtype != "auto":
            return self.config.base_dtype
        return self.precision if self.precision in ("bf16", "fp16") else "fp32"

    def apply(self, model: torch.nn.Module, source: ModelSource) -> torch.nn.Module:
        from toolkit_peft.adapters import inject

        return inject(model, self.config, use_dora=self.use_dora, source=source)

    def checkpoint_state(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        from toolkit_peft.adapters import trainable_state

        return trainable_state(model)

    def load_checkpoint_state(self, model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
        from toolkit_peft.adapters import load_trainable_state

        load_trainable_state(model, state)

    def export_tensors(self, model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        from toolkit_peft.merge import merged_tensors

        return merged_tensors(model, self.config.export_dtype)

    # ------------------------------------------------------------------ extras

    def adapter_export(self, model: torch.nn.Module) -> Callable[[], tuple[dict[str, Any], Iterable[tuple[str, torch.Tensor]]]]:
        """For ``ExportModel.adapter``: a callable giving ``(adapter_config_dict, (name, tensor) pairs)``."""
        from toolkit_peft.merge import adapter_export

        def export() -> tuple[dict[str, Any], list[tuple[str, torch.Tensor]]]:
            config, tensors = adapter_export(model, self.config)
            return config, list(tensors.items())

        return export

    def adapter_from_checkpoint(self, checkpoint: Path, source: ModelSource, recipe: Recipe) -> tuple[dict[str, Any], Any]:
        """The adapter of a training checkpoint in PEFT's format, without loading the base weights."""
        from toolkit_peft.merge import adapter_from_checkpoint

        config, tensors = adapter_from_checkpoint(self, Path(checkpoint), source)
        return config, list(tensors.items())

    def initial_adapters(self, source: ModelSource, recipe: Recipe) -> dict[str, torch.Tensor]:
        """What :meth:`checkpoint_state` gives on ``load_hf_model``'s model, bit for bit, without loading the
        base weights (the HF modules are built on ``meta``; DoRA reads its layers' weights one at a time).
        For strategies that build their own modules (Megatron-Core) and split the adapters themselves."""
        from toolkit_peft.skeleton import initial_adapters

        return initial_adapters(self, source, recipe)

    def adapter_spec(self) -> AdapterSpec:
        """What this tuner adapts, for strategies with modules of their own (``contracts.AdapterSpec``)."""
        from toolkit.contracts import AdapterSpec

        config = self.config
        return AdapterSpec(target_modules=tuple(config.target_modules), rank=config.rank, alpha=float(config.alpha),
                           dropout=config.dropout, dora=self.use_dora, rslora=config.rslora,
                           modules_to_save=tuple(config.modules_to_save), bias=config.bias, init=config.init)

    def save_adapter(self, model: torch.nn.Module, output: str | Path) -> Path:
        """Write ``adapter_config.json`` + ``adapter_model.safetensors`` (PEFT/vLLM layout) to ``output``."""
        from toolkit.hfdir import write_adapter
        from toolkit.writes import staged_directory
        from toolkit_peft.merge import adapter_export

        config, tensors = adapter_export(model, self.config)
        with staged_directory(Path(output)) as staging:  # complete or absent
            write_adapter(staging, config, tensors)
        return Path(output)

    @contextlib.contextmanager
    def disabled_adapters(self, model: torch.nn.Module) -> Iterator[torch.nn.Module]:
        """Run ``model`` as the frozen base inside the block (the DPO reference model, no copy).

        ``with tuner.disabled_adapters(model): ref = model(**batch)`` — LoRA/DoRA deltas and
        ``modules_to_save`` copies are bypassed; QLoRA gives the 4-bit base.
        """
        from toolkit_peft.adapters import peft_model_of

        with peft_model_of(model).disable_adapter():
            yield model

    def optimizer_factory(self, params: Any, recipe: Recipe) -> Any:
        """The optimizer for the trainable parameters (torch AdamW or a bitsandbytes variant)."""
        from toolkit_peft.quant import build_optimizer

        return build_optimizer(self.config.optimizer, params, recipe)


class DoRATuner(LoRATuner):
    """Weight-decomposed LoRA: a trained magnitude per output row plus a low-rank direction update."""

    name: ClassVar[str] = "dora"
    use_dora: ClassVar[bool] = True


class QLoRATuner(LoRATuner):
    """LoRA on a base quantised to 4 bits by bitsandbytes (NF4, double quantisation)."""

    name: ClassVar[str] = "qlora"
    Config: ClassVar[type] = QLoRAConfig
    quantized: ClassVar[bool] = True

    def model_load_kwargs(self) -> dict[str, Any]:
        from toolkit_peft.quant import quantization_kwargs

        return quantization_kwargs(self.config, self.base_dtype())


def bitsandbytes_problems(tuner: str) -> list[str]:
    from toolkit_peft.quant import INSTALL_HINT

    try:
        import bitsandbytes  # noqa: F401
    except ImportError as exc:
        return [
            f"{tuner} needs bitsandbytes for 4-bit weights and 8-bit/paged optimizers, but it is not importable "
            f"({exc}); install it with: {INSTALL_HINT}"
        ]
    return []
