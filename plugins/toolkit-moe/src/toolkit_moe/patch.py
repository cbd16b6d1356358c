"""Replace the HF sparse MoE blocks of a built model with :class:`~toolkit_moe.block.MoeBlock`.

After patching, ``model.toolkit_pop_aux_loss(tokens=None)`` returns ``(aux_loss, metrics)`` of the
last forward pass: the weighted load-balancing + z loss to add to the objective (``None`` when the
model has no routed layer) and detached routing metrics. ``tokens``, a bool tensor of the real
(non-padding) positions of that forward flattened to ``[B * T]`` (``sequence_ids >= 0``), leaves
padding out of both losses, as transformers' and Megatron's load-balancing losses do.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from toolkit_moe.block import AuxCollector, BlockOptions, MoeBlock
from toolkit_moe.families import FAMILIES
from toolkit_moe.parallel import ExpertGroup, gather_experts


def patch_moe_blocks(
    model: nn.Module,
    *,
    capacity_factor: float = 0.0,
    aux_loss_coef: float | None = None,
    z_loss_coef: float | None = None,
    experts_backend: str = "auto",
    expert_group: ExpertGroup | None = None,
) -> int:
    """Patch every sparse MoE block of ``model`` in place; returns how many were replaced.

    ``aux_loss_coef=None`` / ``z_loss_coef=None`` take the model config's ``router_aux_loss_coef`` /
    ``router_z_loss_coef`` (0 when the config has none): what ``--router-aux-loss-coef`` /
    ``--router-z-loss-coef`` set on the config of a model the toolkit loads.
    """
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    family = FAMILIES.get(model_type)
    if family is None:
        from toolkit.errors import ModelError

        raise ModelError(f"toolkit-moe does not know model type {model_type!r}; "
                         f"supported: {', '.join(sorted(FAMILIES))}. Drop the moe section (or --moe-enabled) for this model.")
    options = BlockOptions(capacity_factor=capacity_factor, experts_backend=experts_backend)
    collector = AuxCollector(aux_loss_coef=family.aux_loss_coef(config) if aux_loss_coef is None else aux_loss_coef,
                             z_loss_coef=family.z_loss_coef(config) if z_loss_coef is None else z_loss_coef)
    targets = [(name, module) for name, module in model.named_modules() if type(module).__name__ == family.block_class]
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, MoeBlock(module, family, config, options, expert_group, collector))
    if targets:
        # Each forward starts a fresh collection (also drops entries a checkpoint recompute left).
        model.register_forward_pre_hook(collector.clear)
        inner = getattr(model, "model", None)
        if isinstance(inner, nn.Module):
            inner.register_forward_pre_hook(collector.clear)
        model.toolkit_pop_aux_loss = collector.pop
        if expert_group is not None:
            model._ddp_params_and_buffers_to_ignore = expert_parameter_names(model)
    return len(targets)


def expert_parameter_names(model: nn.Module) -> list[str]:
    """Names of parameters split over expert-parallel ranks (data parallelism must skip them)."""
    return [name for name, p in model.named_parameters() if getattr(p, "toolkit_expert_parallel", False)]


def full_state_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of the whole model with expert slices gathered over their group.

    Collective under expert parallelism: every rank of the group must iterate it.
    """
    groups = {id(block.experts): block.expert_group for block in patched_blocks(model)}
    owners = {f"{name}.{p}": module for name, module in model.named_modules() if id(module) in groups
              for p in ("gate_up_proj", "down_proj")}
    for name, tensor in model.state_dict().items():
        group = groups.get(id(owners[name])) if name in owners else None
        yield name, gather_experts(tensor, group) if group is not None else tensor


def patched_blocks(model: nn.Module) -> list[MoeBlock]:
    return [m for m in model.modules() if isinstance(m, MoeBlock)]


def describe(model: nn.Module) -> dict[str, Any]:
    blocks = patched_blocks(model)
    return {"blocks": len(blocks), "first": blocks[0].extra_repr() if blocks else None}
