"""Exports: adapters merged into full-precision HF tensors, and adapter-only in PEFT's own layout."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from toolkit.errors import ToolkitError

if TYPE_CHECKING:
    import torch

    from toolkit_peft.tuners import LoRAConfig

log = logging.getLogger("toolkit.peft")

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def _export_dtype(hf_model: torch.nn.Module, export_dtype: str, source: Any) -> torch.dtype:
    """The export dtype: as asked, else the base model's own dtype on disk, else the embedding's."""
    import torch

    if export_dtype != "auto":
        return getattr(torch, DTYPES[export_dtype])
    on_disk = getattr(getattr(source, "config", None), "dtype", None)
    if isinstance(on_disk, str) and isinstance(getattr(torch, on_disk, None), torch.dtype):
        on_disk = getattr(torch, on_disk)
    if isinstance(on_disk, torch.dtype) and on_disk.is_floating_point:
        return on_disk
    # The embedding is never quantised, so its dtype is the model's (the compute dtype for qlora).
    return hf_model.get_input_embeddings().weight.dtype


def _is_quantized(weight: torch.Tensor) -> bool:
    return type(weight).__name__ in ("Params4bit", "Int8Params")


def _full_weight(layer: torch.nn.Module) -> torch.Tensor:
    """The layer's weight in fp32, dequantised when bitsandbytes stores it in 4 or 8 bits."""
    weight = layer.weight
    if _is_quantized(weight):
        from peft.utils.integrations import dequantize_bnb_weight

        state = getattr(weight, "quant_state", None)
        if getattr(state, "packing_format_for_cpu", False):
            # bitsandbytes repacks 4-bit weights for its CPU inference kernel on the first eval
            # forward; dequantisation needs the canonical layout back (what its state_dict does too).
            from bitsandbytes.functional import _convert_weight_packed_for_cpu_inverse

            weight.data, weight.quant_state = _convert_weight_packed_for_cpu_inverse(weight.data, state)

        return dequantize_bnb_weight(weight, state=getattr(layer, "state", None)).float()
    return weight.detach().float()


class _Tensors:
    """Tensors of the adapted model by module path: the live modules, or a gathered full state
    dict when the strategy shards them (FSDP hands tuners ``state_dict()`` of full tensors)."""

    def __init__(self, gathered: dict[str, torch.Tensor] | None):
        self.gathered = gathered

    def get(self, module: torch.nn.Module, path: str, name: str) -> torch.Tensor:
        if self.gathered is not None and path + name in self.gathered:
            return self.gathered[path + name]
        return getattr(module, name)

    def weight(self, layer: torch.nn.Module, path: str) -> torch.Tensor:
        if _is_quantized(layer.weight):
            return _full_weight(layer)
        return self.get(layer, path, "weight").detach().float()


def _merged_weight(layer: torch.nn.Module, path: str, adapter: str, tensors: _Tensors) -> torch.Tensor:
    """Base weight + adapter update in fp32 (PEFT's merge formulas for LoRA and DoRA)."""
    from peft.utils.other import transpose

    weight = tensors.weight(layer.get_base_layer(), path + "base_layer.")
    if adapter in layer.lora_A:
        lora_a = tensors.get(layer.lora_A[adapter], f"{path}lora_A.{adapter}.", "weight").detach().float()
        lora_b = tensors.get(layer.lora_B[adapter], f"{path}lora_B.{adapter}.", "weight").detach().float()
        delta = transpose(lora_b @ lora_a, layer.fan_in_fan_out) * layer.scaling[adapter]
    elif adapter in getattr(layer, "lora_embedding_A", {}):
        delta = layer.get_delta_weight(adapter).detach().float()
    else:
        return weight
    if adapter not in layer.lora_magnitude_vector:
        return weight + delta
    # DoRA: W' = m / ||W + dW||_row * (W + dW), norms over the unmerged weight as in forward.
    fan_in_fan_out = layer.fan_in_fan_out
    combined = transpose(weight + delta, fan_in_fan_out)
    magnitude = tensors.get(layer.lora_magnitude_vector[adapter], f"{path}lora_magnitude_vector.{adapter}.", "weight")
    return transpose((magnitude.detach().float() / combined.norm(dim=1)).view(-1, 1) * combined, fan_in_fan_out)


def merged_tensors(model: Any, export_dtype: str = "auto") -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named tensors of ``model`` with its adapters merged in fp32, without changing the model.

    ``model`` is the adapted HF model, or an object whose ``state_dict()`` holds the gathered full
    tensors of a sharded one. A 4-bit or 8-bit (QLoRA) base cannot take the update without
    rounding it away, so such weights are dequantised first; the result is a full-size model in
    the export dtype. Tied parameters are yielded once, like ``named_parameters``.
    """
    import torch
    from peft.tuners.lora import LoraLayer
    from peft.tuners.lora.layer import ParamWrapper
    from peft.utils import ModulesToSaveWrapper

    from toolkit_peft.adapters import peft_model_of, source_of

    peft_model = peft_model_of(model)
    hf_model = peft_model.base_model.model
    tensors = _Tensors(None if isinstance(model, torch.nn.Module) else dict(model.state_dict()))
    adapter = peft_model.active_adapter
    dtype = _export_dtype(hf_model, export_dtype, source_of(model))
    seen: set[int] = set()
    warned = False

    def out(tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
        return tensor.detach().to(device="cpu", dtype=dtype if tensor.is_floating_point() else tensor.dtype).contiguous()

    def walk(module: torch.nn.Module, name: str, path: str) -> Iterator[tuple[str, torch.Tensor]]:
        """``name``: the HF name to export under; ``path``: where the tensors live in the adapted model."""
        nonlocal warned
        if isinstance(module, ModulesToSaveWrapper):
            if adapter in module.modules_to_save:
                yield from walk(module.modules_to_save[adapter], name, f"{path}modules_to_save.{adapter}.")
            else:
                yield from walk(module.original_module, name, f"{path}original_module.")
            return
        if isinstance(module, ParamWrapper):  # adapters on parameters (fused MoE experts), one wrapper per parameter
            deltas, depth = {}, 0
            while isinstance(module, ParamWrapper):
                if adapter in module.lora_A:
                    deltas[module.parameter_name] = module.get_delta_weight(adapter).detach().float()  # PEFT's formula
                module, depth = module.base_layer, depth + 1
            path += "base_layer." * depth
            for key, param in module._parameters.items():
                if param is not None:
                    seen.add(id(param))
                    yield name + key, out(tensors.get(module, path, key).detach().float() + deltas.get(key, 0.0))
            for key, child in module._modules.items():
                if child is not None:
                    yield from walk(child, f"{name}{key}.", f"{path}{key}.")
            return
        if isinstance(module, LoraLayer) or _is_quantized(module._parameters.get("weight")):
            lora = isinstance(module, LoraLayer)
            base, base_path = (module.get_base_layer(), path + "base_layer.") if lora else (module, path)
            if _is_quantized(base.weight) and not warned:
                warned = True
                log.warning(
                    "the base model is quantised (%s); adapters cannot be merged into 4/8-bit weights without "
                    "rounding the update away, so every quantised weight is dequantised, merged in fp32 and "
                    "exported as %s: the export is a full-size model, not a 4-bit one",
                    type(base.weight).__name__, str(dtype).replace("torch.", ""),
                )
            seen.add(id(base.weight))
            yield name + "weight", out(_merged_weight(module, path, adapter, tensors) if lora else tensors.weight(base, base_path))
            if getattr(base, "bias", None) is not None:
                yield name + "bias", out(tensors.get(base, base_path, "bias"))
            return
        for key, param in module._parameters.items():
            if param is not None and id(param) not in seen:
                seen.add(id(param))
                yield name + key, out(tensors.get(module, path, key))
        for key, buffer in module._buffers.items():
            if buffer is not None and key not in module._non_persistent_buffers_set:
                yield name + key, out(tensors.get(module, path, key))
        for key, child in module._modules.items():
            if child is not None:
                yield from walk(child, f"{name}{key}.", f"{path}{key}.")

    with torch.no_grad():
        yield from walk(hf_model, "", "")


def _jsonable(value: Any) -> Any:
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    if hasattr(value, "value"):  # enum
        return value.value
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def adapter_export(model: torch.nn.Module, config: LoRAConfig) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``(adapter_config_dict, tensors)``: what ``PeftModel.save_pretrained`` would write."""
    from peft.utils import get_peft_model_state_dict

    from toolkit_peft.adapters import peft_model_of, source_of

    if config.init.startswith(("pissa", "olora")):
        raise ToolkitError(
            f"init {config.init!r} rewrites the base weights, so the adapter alone does not reproduce the model "
            "on the original base; export the merged model instead (toolkit export RUN --to hf --merge-lora)"
        )
    peft_model = peft_model_of(model)
    adapter = peft_model.active_adapter
    # exactly what adapter_config.json holds: plain JSON values (PEFT's enums become their strings)
    peft_config = json.loads(json.dumps(peft_model.peft_config[adapter].to_dict(), default=_jsonable))
    source = source_of(model)
    if source is not None:
        peft_config["base_model_name_or_path"] = str(source.directory)
    peft_config["inference_mode"] = True
    state = get_peft_model_state_dict(peft_model, adapter_name=adapter)
    return peft_config, {name: tensor.detach().cpu().contiguous() for name, tensor in state.items()}


def adapter_from_checkpoint(tuner: Any, checkpoint: Path, source: Any) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The adapter in a checkpoint, in PEFT's format: adapters are injected into a meta-device model
    (no base weights are read) and the checkpoint tensors are assigned in place of the meta ones."""
    import torch
    from transformers import AutoModelForCausalLM

    from toolkit.train.checkpoint import read_model_state
    from toolkit_peft.adapters import unwrap

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(source.config, trust_remote_code=source.trust_remote_code)
        model = tuner.apply(model, source)
    trainable = {name: param for name, param in unwrap(model).named_parameters() if param.requires_grad}
    state = read_model_state(checkpoint, trainable)  # model.safetensors, or an fsdp checkpoint's dcp/ shards
    if set(state) != set(trainable):
        raise ToolkitError(
            f"{checkpoint} does not hold this tuner's adapters (missing "
            f"{sorted(set(trainable) - set(state))[:3]}, unexpected {sorted(set(state) - set(trainable))[:3]}); was the run's "
            "tuner configuration changed?"
        )
    unwrap(model).load_state_dict(state, strict=False, assign=True)
    return adapter_export(model, tuner.config)
