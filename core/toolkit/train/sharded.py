"""Parameters split along dim 0 over a process group (expert parallelism), and what engines do with them.

A plugin marks such a parameter with ``param.toolkit_shard = Shard(...)`` (toolkit-moe does, for
experts spread over ranks). The ``local`` engine then leaves it out of DDP, sums its gradient over
the ranks that hold the same slice, adds its squares over ``group`` to the gradient norm, and
gathers it to the full tensor for checkpoints and export (slicing again on load), so checkpoints
do not depend on the layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Shard:
    """This rank holds slice ``rank`` of ``size`` equal dim-0 slices, the others live on ``group``."""

    group: Any
    rank: int
    size: int
    replicas: Any = None
    """Process group of the ranks holding this same slice (gradients are summed over it); ``None``: no copies."""

    def local(self, full: Any) -> Any:
        """This rank's slice of a full tensor."""
        rows = full.shape[0] // self.size
        return full[self.rank * rows:(self.rank + 1) * rows]

    def gather(self, local: Any) -> Any:
        """The full tensor (collective over ``group``: every rank of it must call)."""
        import torch
        import torch.distributed as dist

        pieces = [torch.empty_like(local) for _ in range(self.size)]
        dist.all_gather(pieces, local.detach().contiguous(), group=self.group)
        return torch.cat(pieces)


def shard_of(param: Any) -> Shard | None:
    return getattr(param, "toolkit_shard", None)


def sharded_names(module: Any) -> dict[str, Shard]:
    """``{parameter name: Shard}`` of ``module``'s sharded parameters."""
    return {name: shard for name, p in module.named_parameters() if (shard := shard_of(p)) is not None}


def reduce_sharded_grads(pairs: list[tuple[Any, Shard]], scale: float) -> None:
    """Sum each sharded gradient over its replicas and multiply by ``scale``.

    Engines scale the objective by the data-parallel size to undo DDP's averaging; a sharded
    parameter is not averaged (its gradient already sums every rank's tokens through the
    all-to-all backward), so it gets ``scale = 1 / dp_world_size`` here.
    """
    import torch.distributed as dist

    for tensor, shard in pairs:
        if tensor.grad is None:
            continue
        if shard.replicas is not None:
            dist.all_reduce(tensor.grad, group=shard.replicas)
        tensor.grad.mul_(scale)


def grad_norm(tensors: list[Any], shards: dict[int, Shard]) -> Any:
    """Global L2 gradient norm: replicated tensors count once, sharded squares are summed over their group.

    ``shards`` maps ``id(tensor)`` to its :class:`Shard`. Every rank gets the same value.
    """
    import torch
    import torch.distributed as dist

    grads = [t for t in tensors if t.grad is not None]
    device = grads[0].grad.device if grads else torch.device("cpu")
    replicated = torch.zeros((), dtype=torch.float32, device=device)
    per_group: dict[int, tuple[Any, Any]] = {}
    for tensor in grads:
        square = tensor.grad.detach().float().square().sum()
        shard = shards.get(id(tensor))
        if shard is None:
            replicated += square
        else:
            group, total = per_group.get(id(shard.group), (shard.group, torch.zeros_like(replicated)))
            per_group[id(shard.group)] = (group, total + square)
    total = replicated
    for group, square in per_group.values():
        dist.all_reduce(square, group=group)
        total = total + square
    return total.sqrt()


def full_tensors(state: dict[str, Any], shards: dict[str, Shard]) -> dict[str, Any]:
    """``state`` with sharded entries gathered to full tensors (collective: every rank calls, same order)."""
    return {name: shards[name].gather(t) if name in shards else t for name, t in state.items()}


def local_tensors(state: dict[str, Any], shards: dict[str, Shard]) -> dict[str, Any]:
    """``state`` (full tensors, e.g. read from a checkpoint) with sharded entries cut to this rank's slice."""
    return {name: shards[name].local(t).contiguous() if name in shards else t for name, t in state.items()}


def full_optimizer_state(optimizer: Any, shards: dict[int, Shard]) -> dict[str, Any]:
    """``optimizer.state_dict()`` with the moments of sharded parameters gathered (collective)."""
    return _convert_optimizer_state(optimizer, optimizer.state_dict(), shards, lambda shard, t: shard.gather(t))


def local_optimizer_state(optimizer: Any, state_dict: dict[str, Any], shards: dict[int, Shard]) -> dict[str, Any]:
    """A full optimizer state dict (from :func:`full_optimizer_state`) cut to this rank's slices."""
    return _convert_optimizer_state(optimizer, state_dict, shards, lambda shard, t: shard.local(t).contiguous())


def _convert_optimizer_state(optimizer: Any, state_dict: dict[str, Any], shards: dict[int, Shard], convert: Any) -> dict[str, Any]:
    # torch numbers parameters in state_dict()["state"] by their position over the param groups
    ordered = [p for group in optimizer.param_groups for p in group["params"]]
    for index, param in enumerate(ordered):
        shard = shards.get(id(param))
        entry = state_dict["state"].get(index)
        if shard is None or entry is None:
            continue
        # state_dict() shares each parameter's state dict with the live optimizer: convert a copy
        entry = state_dict["state"][index] = dict(entry)
        for key, value in entry.items():
            if hasattr(value, "ndim") and value.ndim > 0:  # moments; the 0-d step count is shared
                entry[key] = convert(shard, value)
    return state_dict
