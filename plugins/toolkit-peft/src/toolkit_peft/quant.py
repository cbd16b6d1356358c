"""bitsandbytes pieces: the 4-bit load configuration for QLoRA and 8-bit / paged optimizers."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from toolkit.errors import ToolkitError
from toolkit.plugins import install_hint

if TYPE_CHECKING:
    from toolkit.recipe import Recipe
    from toolkit_peft.tuners import QLoRAConfig

INSTALL_HINT = f"pip install 'bitsandbytes>=0.45', or reinstall with the extra: {install_hint('toolkit-peft', 'qlora')}"


def require_bitsandbytes(what: str) -> Any:
    try:
        import bitsandbytes
    except ImportError as exc:
        raise ToolkitError(f"{what} needs bitsandbytes, which is not importable ({exc}); install it with: {INSTALL_HINT}") from None
    return bitsandbytes


def torch_dtype(name: str) -> Any:
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


def quantization_kwargs(config: QLoRAConfig, base_dtype: str) -> dict[str, Any]:
    """``from_pretrained`` keyword arguments that load the base in 4 bits (NF4 + double quant).

    ``base_dtype`` is the dtype of what stays unquantised (norms, embeddings, the head).
    """
    require_bitsandbytes("qlora (4-bit base weights)")
    from transformers import BitsAndBytesConfig

    dtype = torch_dtype(config.compute_dtype)
    # modules_to_save train in full, so they must stay unquantised, as must the output head.
    keep = sorted({"lm_head", *(name.rsplit(".", 1)[-1] for name in config.modules_to_save)})
    quantization = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=config.quant_type,
        bnb_4bit_use_double_quant=config.double_quant,
        bnb_4bit_compute_dtype=dtype,
        llm_int8_skip_modules=keep,
    )
    kwargs = {"quantization_config": quantization, "dtype": torch_dtype(base_dtype)}
    import torch

    if torch.cuda.is_available():
        # bitsandbytes quantises while loading onto the target device; a 4-bit model cannot be
        # moved with .to() afterwards, so place it on this process's GPU (set by the strategy).
        kwargs["device_map"] = {"": torch.cuda.current_device()}
    return kwargs


def build_optimizer(name: str, params: Any, recipe: Recipe) -> Any:
    """AdamW with the recipe's hyper-parameters: torch's, or bitsandbytes' 8-bit / paged variants."""
    import torch

    params = list(params)
    # Same grouping as the core optimizer: no weight decay on vectors (DoRA magnitudes, biases).
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": recipe.weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    groups = [group for group in groups if group["params"]]
    kwargs = {"lr": recipe.lr, "betas": (recipe.adam_beta1, recipe.adam_beta2), "eps": recipe.adam_eps}
    if name == "adamw":
        return torch.optim.AdamW(groups, **kwargs)
    bnb = require_bitsandbytes(f"optimizer {name!r}")
    classes = {"adamw8bit": bnb.optim.AdamW8bit, "paged_adamw": bnb.optim.PagedAdamW, "paged_adamw8bit": bnb.optim.PagedAdamW8bit}
    return classes[name](groups, **kwargs)
