"""Measure what autograd keeps for the backward pass, to check the planner's activation model.

Used by tests/test_plan_measure.py and bench/plan_check.py. torch is imported inside functions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def saved_activation_bytes(model: Any, forward: Callable[[], Any], vocab: int) -> int:
    """Bytes of distinct storages saved for backward while ``forward()`` runs (it returns the loss).

    Parameters, their bf16 autocast copies (the planner counts them as weight copies) and
    vocabulary-sized loss tensors (counted as logits) are left out.
    """
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    copies: set[int] = set()

    class WeightCasts(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if (func is torch.ops.aten._to_copy.default and isinstance(args[0], torch.Tensor)
                    and args[0].untyped_storage().data_ptr() in params):
                copies.add(out.untyped_storage().data_ptr())
            return out

    seen: dict[int, int] = {}

    def pack(tensor):
        pointer = tensor.untyped_storage().data_ptr()
        if pointer not in params and pointer not in copies and tensor.dim() and tensor.shape[-1] != vocab:
            seen.setdefault(pointer, tensor.untyped_storage().nbytes())
        return tensor

    with WeightCasts(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = forward()
    del loss
    return sum(seen.values())
