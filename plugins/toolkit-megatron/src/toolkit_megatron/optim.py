"""Faster optimizer steps for Megatron-Core without Transformer Engine or Apex.

Without TE/Apex, Megatron-Core falls back to ``torch.optim.AdamW`` (its default per-tensor
``foreach`` path) and to per-tensor Python loops for gradient clipping: the norm converts every
parameter's norm to a Python float (one host sync per tensor) and scaling allocates a temporary
per tensor. :func:`fuse_adam` switches the torch AdamW to its fused kernel; :func:`foreach_clipping`
replaces the two clipping fallbacks with ``torch._foreach_*`` calls (same arithmetic, one sync).
"""

from __future__ import annotations

from typing import Any

import torch


def fuse_adam(optimizer: Any) -> bool:
    """Use torch's fused AdamW kernel in every torch Adam/AdamW inside ``optimizer``; False if none is."""
    changed = False
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        torch_optimizer = getattr(inner, "optimizer", None)
        if not isinstance(torch_optimizer, (torch.optim.Adam, torch.optim.AdamW)):
            continue
        for group in torch_optimizer.param_groups:
            if all(p.dtype in (torch.float32, torch.float16, torch.bfloat16) for p in group["params"]):
                group["fused"], group["foreach"] = True, False
                changed = True
        torch_optimizer.defaults.update(fused=True, foreach=False)
    return changed


def _l2_norm(chunk_size: int, noop_flag: Any, tensor_lists: list[list[torch.Tensor]], per_tensor: bool, *args: Any) -> tuple:
    tensors = [t for group in tensor_lists for t in group]
    if not tensors:
        device = noop_flag.device if isinstance(noop_flag, torch.Tensor) else None
        return torch.zeros(1, dtype=torch.float32, device=device), None
    norms = torch._foreach_norm(tensors)
    total = torch.linalg.vector_norm(torch.stack([n.float() for n in norms])).reshape(1)
    return total, None


def _scale(chunk_size: int, noop_flag: Any, tensor_lists: list[list[torch.Tensor]], scale: float) -> None:
    sources, targets = tensor_lists
    if all(s is t for s, t in zip(sources, targets, strict=True)):
        torch._foreach_mul_(targets, scale)
    else:
        torch._foreach_copy_(targets, torch._foreach_mul(sources, scale))


def foreach_clipping(enabled: bool = True) -> bool:
    """Use foreach kernels (``enabled``) or Megatron's local per-tensor loops for gradient clipping.

    Only replaces Megatron's local fallbacks: returns False (and changes nothing) when TE or Apex
    provide the kernels. Process-wide, like Megatron's own choice of kernels.
    """
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads

    if clip_grads.l2_norm_impl not in (utils.local_multi_tensor_l2_norm, _l2_norm):
        return False
    if enabled:
        clip_grads.l2_norm_impl, clip_grads.multi_tensor_scale_impl = _l2_norm, _scale
    else:
        clip_grads.l2_norm_impl = utils.local_multi_tensor_l2_norm
        clip_grads.multi_tensor_scale_impl = utils.local_multi_tensor_scale
    return True
