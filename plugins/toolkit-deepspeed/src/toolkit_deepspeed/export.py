"""HF tensors out of ZeRO: from a live ZeRO-3 engine (one gathered parameter at a time) or from a checkpoint.

A tuner whose export is the model's own state dict (``full``, ``freeze``) is streamed tensor by
tensor, so no process ever holds the whole model. A tuner that transforms weights on export
(LoRA/DoRA merging) needs its whole model: it gets it gathered (live) or rebuilt (checkpoint).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from toolkit.errors import ToolkitError

MODULE_PREFIX = "model."  # DeepSpeed wraps CausalLMLogps, whose HF model is its ``model`` attribute


def exports_state_dict(model: Any, tuner: Any) -> bool:
    """True when ``tuner.export_tensors(model)`` yields exactly the model's state-dict names, in order.

    Called on a partitioned or meta-device model, where the check costs no memory.
    """
    try:
        names = [name for name, _ in tuner.export_tensors(model)]
    except Exception:  # a transforming export cannot run on empty partitions: it is not a pass-through
        return False
    return names == list(model.state_dict().keys())


def gathered_tensors(model: Any, tuner: Any, is_main: bool) -> Iterator[tuple[str, Any]]:
    """Full tensors of a ZeRO-3 model on the main rank; every rank must iterate (gathers are collective)."""
    import deepspeed

    if not exports_state_dict(model, tuner):
        params = list(model.parameters())
        with deepspeed.zero.GatheredParameters(params):
            if is_main:
                yield from ((name, tensor.detach().clone()) for name, tensor in tuner.export_tensors(model))
        return
    for name, tensor in model.state_dict(keep_vars=True).items():
        if hasattr(tensor, "ds_id"):
            with deepspeed.zero.GatheredParameters([tensor]):
                full = tensor.detach().clone() if is_main else None
        else:
            full = tensor.detach()
        if is_main:
            yield name, full


def checkpoint_tensors(checkpoint: Path, source: Any, tuner: Any, recipe: Any, tag: str) -> Iterator[tuple[str, Any]]:
    """Consolidate a DeepSpeed checkpoint (any ZeRO stage) into HF tensors in one process.

    ZeRO-3 shards are merged lazily, one tensor at a time; frozen weights the checkpoint does not
    hold are read from the base model's files.
    """
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    if not (checkpoint / tag).is_dir():
        raise ToolkitError(f"{checkpoint} holds no DeepSpeed checkpoint ({tag}/ missing)")
    from toolkit_deepspeed.engine import check_pickles

    check_pickles(checkpoint / tag)  # zero_to_fp32 unpickles them with weights_only=False
    state = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint), tag=tag, lazy_mode=True)
    state = {name[len(MODULE_PREFIX):]: value for name, value in state.items() if name.startswith(MODULE_PREFIX)}
    skeleton = meta_model(source, tuner)
    if skeleton is not None and exports_state_dict(skeleton, tuner):
        base = BaseWeights(source)
        names = list(skeleton.state_dict())
        # Frozen weights come from the base files by name; a model whose in-memory names differ
        # from its files (fused MoE experts) is rebuilt instead.
        if all(name in state or name in base.files for name in names):
            for name in names:
                yield name, materialise(state.pop(name)) if name in state else base.get(name)
            return
    yield from rebuilt_tensors(state, source, tuner, recipe)


def rebuilt_tensors(state: dict[str, Any], source: Any, tuner: Any, recipe: Any) -> Iterator[tuple[str, Any]]:
    """The tuner's export of the whole model rebuilt on CPU with the checkpoint's weights."""
    import torch

    from toolkit.models import load_hf_model

    model = load_hf_model(source, tuner, recipe, torch.device("cpu"))
    params = dict(model.named_parameters())
    missing = [name for name, p in params.items() if p.requires_grad and name not in state]
    if missing:
        raise ToolkitError(f"the checkpoint lacks {len(missing)} trained tensors (first: {missing[0]}); "
                           f"was it written with --tuner {tuner.name}?")
    with torch.no_grad():
        for name, value in state.items():
            if name in params:
                params[name].copy_(materialise(value))
    yield from tuner.export_tensors(model)


def materialise(value: Any) -> Any:
    return value.contiguous() if not hasattr(value, "detach") else value


def meta_model(source: Any, tuner: Any) -> Any:
    """The model's structure with the tuner applied and no storage, or ``None`` if it cannot be built so."""
    import torch
    from transformers import AutoModelForCausalLM

    if "quantization_config" in tuner.model_load_kwargs():
        return None
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(source.config, trust_remote_code=source.trust_remote_code)
            return tuner.apply(model, source)
    except Exception:
        return None


class BaseWeights:
    """Tensors of the base model's safetensors files, read one at a time by name."""

    def __init__(self, source: Any):
        self.files: dict[str, Path] = {}
        from safetensors import safe_open

        for path in source.weight_files:
            with safe_open(str(path), framework="pt") as handle:
                self.files.update(dict.fromkeys(handle.keys(), path))

    def get(self, name: str) -> Any:
        from safetensors import safe_open

        if name not in self.files:
            raise ToolkitError(f"tensor {name} is neither in the DeepSpeed checkpoint nor in the base model's weights")
        with safe_open(str(self.files[name]), framework="pt") as handle:
            return handle.get_tensor(name)
