"""The adapters' initial tensors without the base model's weights (``LoRATuner.initial_adapters``).

Strategies whose modules are not the HF model's (Megatron-Core) start LoRA/DoRA from the adapters
this tuner would create on the HF model, so that every strategy trains the same adapters from the
same seed. Loading the HF model for that costs a full copy of the weights in host memory on every
rank; here the HF modules are built on the ``meta`` device and each parameter becomes a zero-stride
CPU view of one element (its shape and dtype, 2-4 bytes), so PEFT injects, seeds and initialises the
adapters exactly as on the loaded model. DoRA's magnitude is the row norm of ``W + scale * B @ A``:
it is computed by PEFT's own DoRA init with the real ``W`` of one layer at a time, read from the
safetensors files.
"""

from __future__ import annotations

from typing import Any

import torch

from toolkit.errors import ConfigError, ModelError

_BASE_DEPENDENT_INITS = ("pissa", "olora")


def initial_adapters(tuner: Any, source: Any, recipe: Any) -> dict[str, torch.Tensor]:
    """``tuner.checkpoint_state(load_hf_model(source, tuner, recipe, cpu))``, bit for bit, with the base
    weights never loaded (DoRA reads the targeted ones one at a time)."""
    from transformers import AutoModelForCausalLM

    init = tuner.config.init
    if init.startswith(_BASE_DEPENDENT_INITS):
        raise ConfigError(f"--{tuner.name}-init {init} derives the adapters from the base weights and changes those "
                          f"weights; strategies that build their own modules take --{tuner.name}-init default, gaussian, "
                          "orthogonal or random")
    if getattr(tuner, "quantized", False):
        raise ConfigError(f"--tuner {tuner.name}: quantized bases need the loaded HF model")
    dtype = tuner.model_load_kwargs().get("dtype") or torch.float32
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(source.config, dtype=dtype, trust_remote_code=source.trust_remote_code)
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            placeholder = torch.zeros((), dtype=param.dtype).expand(param.shape)
            module.register_parameter(name, torch.nn.Parameter(placeholder, requires_grad=param.requires_grad))
    model.config.use_cache = False
    torch.manual_seed(recipe.seed)  # as load_hf_model seeds right before tuner.apply
    model = tuner.apply(model, source)
    if tuner.use_dora:
        _dora_magnitudes(model, source)
    state = tuner.checkpoint_state(model)
    return {name: tensor.detach().clone() for name, tensor in state.items()}


def _dora_magnitudes(model: torch.nn.Module, source: Any) -> None:
    """Run PEFT's DoRA init again on each adapted layer with its real base weight in place."""
    from safetensors import safe_open

    files = {}
    for path in source.weight_files:
        with safe_open(str(path), framework="pt") as handle:
            files.update({name: path for name in handle.keys()})
    for module_name, module in model.named_modules():
        magnitudes = getattr(module, "lora_magnitude_vector", None)
        if not magnitudes:
            continue
        base = module.get_base_layer()
        weight_name = f"{module_name}.weight"
        if weight_name not in files:
            raise ModelError(f"{source.directory}: no tensor {weight_name!r} in the safetensors files, needed for the "
                             "DoRA magnitude of that layer")
        placeholder = base.weight
        with safe_open(str(files[weight_name]), framework="pt") as handle:
            real = handle.get_tensor(weight_name).to(placeholder.dtype)
        if tuple(real.shape) != tuple(placeholder.shape):
            raise ModelError(f"{files[weight_name]}: {weight_name} has shape {tuple(real.shape)}, the config says "
                             f"{tuple(placeholder.shape)}")
        base.weight = torch.nn.Parameter(real, requires_grad=False)
        try:
            for adapter in list(magnitudes):
                # at PEFT's DoRA init A and B still have the base dtype (the fp32 cast comes after): so here
                a, b = module.lora_A[adapter], module.lora_B[adapter]
                kept = a.weight.dtype
                a.to(real.dtype), b.to(real.dtype)
                module.lora_variant[adapter].init(module, adapter_name=adapter)
                a.to(kept), b.to(kept)
                vector = module.lora_magnitude_vector[adapter]
                if vector.weight.dtype in (torch.float16, torch.bfloat16) and kept == torch.float32:
                    vector.float()  # PEFT's autocast_adapter_dtype
        finally:
            base.weight = placeholder
