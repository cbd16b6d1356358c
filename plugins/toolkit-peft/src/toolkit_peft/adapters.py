"""Injecting PEFT adapters into a Hugging Face model in place, and reading/writing what trains."""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any

from toolkit.errors import ConfigError, ModelError, ToolkitError

if TYPE_CHECKING:
    import torch

    from toolkit.contracts import ModelSource
    from toolkit_peft.tuners import LoRAConfig

# The PeftModel is kept in the HF model's __dict__, not as a submodule: registering it would put
# a cycle into named_modules()/state_dict() and change every parameter name strategies see.
_PEFT_ATTR = "_toolkit_peft_model"
_SOURCE_ATTR = "_toolkit_peft_source"


def peft_lora_config(config: LoRAConfig, *, use_dora: bool) -> Any:
    """The ``peft.LoraConfig`` equivalent to our options."""
    import peft

    from toolkit_peft.targets import peft_target_modules

    init: Any = {"default": True, "random": False}.get(config.init, config.init)
    return peft.LoraConfig(
        r=config.rank,
        lora_alpha=config.alpha,
        lora_dropout=config.dropout,
        target_modules=peft_target_modules(config),
        exclude_modules=list(config.exclude_modules) or None,
        use_rslora=config.rslora,
        modules_to_save=list(config.modules_to_save) or None,
        init_lora_weights=init,
        bias=config.bias,
        use_dora=use_dora,
        task_type="CAUSAL_LM",
    )


def inject(model: torch.nn.Module, config: LoRAConfig, *, use_dora: bool, source: ModelSource | None = None) -> torch.nn.Module:
    """Add adapters to ``model`` in place (base frozen) and return it; the PeftModel rides along."""
    import peft

    from toolkit_peft.targets import target_problems

    if _PEFT_ATTR in model.__dict__:
        raise ToolkitError("this model already has toolkit adapters; apply a LoRA tuner once per model")
    problems = target_problems(config, model=model)
    if problems:
        raise ConfigError(problems, source=f"{'dora' if use_dora else 'lora'} options")
    # Adapters are created in fp32 on a bf16/fp16 base (PEFT's autocast_adapter_dtype): the
    # optimizer then updates full-precision adapter weights without a separate master copy.
    peft_model = peft.get_peft_model(model, peft_lora_config(config, use_dora=use_dora), autocast_adapter_dtype=True)
    hf_model = peft_model.base_model.model
    bare = experts_without_adapters(hf_model, config)
    if bare and int(os.environ.get("RANK", "0") or 0) == 0:
        kind = getattr(getattr(hf_model, "config", None), "model_type", "this model")
        print(f"toolkit: LoRA gives the routed experts of {kind} no adapter ({bare[0]}"
              f"{f' and {len(bare) - 1} more' if len(bare) > 1 else ''}): PEFT does not adapt this family's fused experts "
              "on transformers 5, so only the attention, shared experts and their gates train; --tuner full trains the "
              "experts", file=sys.stderr)
    for module in hf_model.modules():
        # bitsandbytes repacks 4-bit weights for a bf16 CPU kernel on the first eval forward without
        # grad; that rounds the stored constants (exports drift) and evaluates with other numerics
        # than training, so keep the training kernel.
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
    if config.fast_forward:
        from toolkit_peft.fast_lora import install_fast_forward

        install_fast_forward(hf_model)
    hf_model.__dict__[_PEFT_ATTR] = peft_model
    hf_model.__dict__[_SOURCE_ATTR] = source
    return hf_model


MLP_TARGETS = {"gate_proj", "up_proj", "down_proj", "gate_up_proj", "w1", "w2", "w3"}


def experts_without_adapters(model: torch.nn.Module, config: LoRAConfig) -> list[str]:
    """Routed-expert modules (``*.experts``) left without an adapter although the targets name MLP linears
    (``all-linear`` or gate/up/down): PEFT moves such targets onto transformers 5's fused experts for most MoE
    families, but not for every one (PEFT 0.22 gives PhiMoE's, GPT-OSS's, Jamba's and Llama 4's experts none)."""
    targets = set(config.target_modules)
    if targets != {"all-linear"} and not targets & MLP_TARGETS:
        return []
    adapted = [name for name, _ in model.named_parameters() if "lora_" in name]
    experts = [name for name, _ in model.named_modules() if name.endswith(".experts")]
    return [name for name in experts if not any(a.startswith(name + ".") for a in adapted)]


def unwrap(model: Any) -> Any:
    """The adapted HF model under DDP-style wrappers (``.module``), a PeftModel, or a proxy that
    forwards attribute access to it (FSDP's full-state view)."""
    for _ in range(4):
        peft_model = getattr(model, _PEFT_ATTR, None)
        if peft_model is not None:
            return peft_model.base_model.model
        if hasattr(model, "peft_config") and hasattr(model, "get_base_model"):
            return model.get_base_model()
        inner = getattr(model, "module", None)
        if inner is None:
            break
        model = inner
    return model


def peft_model_of(model: Any) -> Any:
    """The ``peft.PeftModel`` that owns the adapters injected into ``model``."""
    peft_model = getattr(unwrap(model), _PEFT_ATTR, None)
    if peft_model is None:
        raise ToolkitError(
            f"{type(model).__name__} has no LoRA adapters from toolkit-peft; "
            "the model must come from the lora/dora/qlora tuner's apply()"
        )
    return peft_model


def source_of(model: Any) -> ModelSource | None:
    return getattr(unwrap(model), _SOURCE_ATTR, None)


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What trains (adapters, DoRA magnitudes, modules_to_save copies), by parameter name."""
    hf_model = unwrap(model)
    return {name: param.detach() for name, param in hf_model.named_parameters() if param.requires_grad}


def load_trainable_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy ``state`` (from :func:`trainable_state`) into the adapters, checking names and shapes."""
    import torch

    hf_model = unwrap(model)
    params = {name: param for name, param in hf_model.named_parameters() if param.requires_grad}
    missing = sorted(set(params) - set(state))
    unexpected = sorted(set(state) - set(params))
    if missing or unexpected:
        raise ModelError(
            "the checkpoint's adapter tensors do not fit this model's adapters (were rank, target_modules or "
            f"modules_to_save changed since it was written?); missing: {missing[:5]} ({len(missing)} in all), "
            f"unexpected: {unexpected[:5]} ({len(unexpected)} in all)"
        )
    with torch.no_grad():
        for name, param in params.items():
            value = state[name]
            if value.shape != param.shape:
                raise ModelError(f"checkpoint tensor {name} has shape {tuple(value.shape)}, the model's is {tuple(param.shape)}")
            param.copy_(value.to(device=param.device, dtype=param.dtype))
