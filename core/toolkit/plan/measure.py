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


def cpu_peak_bytes(step: Callable[[], Any], baseline: int) -> int:
    """Peak bytes held by the CPU allocator while ``step()`` runs: ``baseline`` (what was allocated
    before, e.g. weights and optimizer states) plus the highest running sum of the allocations and
    frees the profiler records. Lets the memory model be checked on machines without CUDA."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    allocations: list[tuple[int, int]] = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation and str(node.extra_fields.device) == "cpu":
            allocations.append((node.start_time_ns, node.extra_fields.alloc_size))
        stack.extend(node.children)
    current = peak = 0
    for _, size in sorted(allocations):
        current += size
        peak = max(peak, current)
    return baseline + peak


def allocated_bytes(model: Any, optimizer: Any) -> int:
    """Bytes of parameters, gradients and optimizer state tensors that exist right now."""
    import torch

    total = sum(p.numel() * p.element_size() for p in model.parameters())
    total += sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
    for state in optimizer.state.values():
        total += sum(t.numel() * t.element_size() for t in state.values() if torch.is_tensor(t) and t.dim())
    return total
