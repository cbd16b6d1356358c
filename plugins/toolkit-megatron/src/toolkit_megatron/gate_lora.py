"""LoRA on a mixture-of-experts layer's replicated gate weights: the router's ``weight`` and Qwen2-MoE's shared
expert gate (``gate_weight``), which PEFT adapts on the HF side (transformers 5's router, a module holding a bare
parameter, through PEFT's ``ParamWrapper``; the shared expert gate, an ``nn.Linear``, through ``lora.Linear``).

Megatron reads these weights inside its own methods (the router's ``gating``, the shared expert's ``forward`` and its
overlapped-communication path, on megatron-core 0.16 and 0.19 alike), so rather than wrapping the module the adapted
module reads its weight through a property, ``W + scale * B A``: what PEFT computes, in the weight's dtype, before the
router's own cast to ``moe_router_dtype``. The base parameter stays where the bridge, the checkpoints and the optimizer
know it, and the adapter is a child module (``adapter``) whose parameters are named ``...adapter.lora_a``/``lora_b``.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from toolkit.errors import ConfigError

GATE_WEIGHTS = ("mlp.router.weight", "mlp.shared_experts.gate_weight")
"""The bridge's (:data:`toolkit_megatron.bridge.PER_LAYER`) replicated linear maps that LoRA adapts in place."""

_ADAPTED_CLASSES: dict[tuple[type, str], type] = {}


class LoRAGate(torch.nn.Module):
    """The adapter ``B A`` (PEFT's layout: ``A`` ``[r, in]``, ``B`` ``[out, r]``) of one gate weight, whole on every
    rank like the weight itself."""

    def __init__(self, weight: torch.Tensor, tensors: dict, sequence_parallel: bool):
        super().__init__()
        self.scale = float(tensors["scale"])
        self.sources = tensors.get("names", {})  # the tuner's names of A and B
        # on the weight's device: the tuner's tensors may be on the host (as LoRALinear's)
        self.lora_a = torch.nn.Parameter(tensors["A"].to(weight.device, weight.dtype).contiguous())
        self.lora_b = torch.nn.Parameter(tensors["B"].to(weight.device, weight.dtype).contiguous())
        for param in (self.lora_a, self.lora_b):
            # as Megatron marks the gate weight: under sequence parallelism each TP rank's gradient covers its own
            # tokens, and finalize_model_grads sums such parameters' gradients over TP
            param.sequence_parallel = sequence_parallel

    def adapted(self, weight: torch.Tensor) -> torch.Tensor:
        return weight + (self.lora_b @ self.lora_a).to(weight.dtype) * self.scale

    def full_part(self, value: Any) -> dict[str, torch.Tensor]:
        """``value`` of ``A`` and ``B``, whole already (the interface of ``LoRALinear.full_part``)."""
        return {"A": value(self.lora_a).detach(), "B": value(self.lora_b).detach()}

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        from megatron.core import parallel_state as ps
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        return make_sharded_tensors_for_checkpoint({"lora_a": self.lora_a, "lora_b": self.lora_b}, prefix, {},
                                                   sharded_offsets, tp_group=ps.get_tensor_model_parallel_group(),
                                                   dp_cp_group=ps.get_data_parallel_group(with_context_parallel=True))


def _adapted_class(base: type, name: str) -> type:
    """``base`` whose parameter ``name`` reads as adapted by the module's ``adapter`` (one class per base and name)."""
    key = (base, name)
    if key not in _ADAPTED_CLASSES:
        def adapted(self: Any) -> torch.Tensor:
            return self.adapter.adapted(self._parameters[name])

        _ADAPTED_CLASSES[key] = type(f"LoRA{base.__name__}", (base,), {
            name: property(adapted, doc=f"``{name}`` plus its LoRA update; the parameter itself: ``_parameters``"),
            "adapted_weight": name,
        })
    return _ADAPTED_CLASSES[key]


def adapt_gate(owner: Any, name: str, tensors: dict, path: str) -> None:
    """Give ``owner``'s gate weight ``name`` the adapter ``tensors`` (the HF module ``path``'s, for errors)."""
    weight = owner._parameters.get(name)
    if weight is None:
        raise ConfigError(f"LoRA on {path}: the Megatron module {type(owner).__name__} has no {name} (is its gate off?); "
                          "drop it from --lora-target-modules")
    if "M" in tensors:
        raise ConfigError(f"DoRA on the gate {path} is not supported by the megatron strategy; use --tuner lora, "
                          "exclude it (--dora-exclude-modules), or use --strategy local")
    shape = (tensors["B"].shape[0], tensors["A"].shape[1])
    if shape != tuple(weight.shape):
        raise ConfigError(f"LoRA on {path}: the adapter maps {shape[1]} to {shape[0]} features, the Megatron gate weight "
                          f"{name} is {tuple(weight.shape)}")
    owner.adapter = LoRAGate(weight, tensors, bool(getattr(weight, "sequence_parallel", False)))
    owner.__class__ = _adapted_class(type(owner), name)


def module_name(name: str, families: tuple[str, ...]) -> str:
    """The name transformers 5 gives the module a checkpoint calls ``name`` (Mixtral's checkpoints, which the bridge
    reads, say ``block_sparse_moe.gate``, its modules and so PEFT's adapters ``mlp.gate``): ``name`` through the
    renamings of the families' checkpoint conversion mapping."""
    from transformers.conversion_mapping import WeightRenaming, get_checkpoint_conversion_mapping

    for family in families:
        for rename in get_checkpoint_conversion_mapping(family) or []:
            if isinstance(rename, WeightRenaming):
                for source in rename.source_patterns:
                    name = re.sub(source, rename.target_patterns[0], name)
    return name


def gates(chunk: Any) -> list[tuple[str, Any]]:
    """(module name, module) of every adapted gate in ``chunk``."""
    return [(path, module) for path, module in chunk.named_modules() if hasattr(type(module), "adapted_weight")]


def merged_gates(chunk: Any) -> dict[str, torch.Tensor]:
    """Megatron parameter name -> adapted gate weight, for the bridge's export."""
    with torch.no_grad():
        return {f"{path}.{module.adapted_weight}": getattr(module, module.adapted_weight).detach()
                for path, module in gates(chunk)}
