"""Process-group setup from torchrun's environment, and a clean exit for gloo jobs."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any


@dataclass
class World:
    rank: int
    local_rank: int
    world_size: int
    device: object

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


_WORLD: World | None = None


def init_world() -> World:
    """Initialise torch.distributed when launched by torchrun (gloo on CPU, NCCL on GPU)."""
    global _WORLD
    if _WORLD is not None:
        return _WORLD
    import torch
    import torch.distributed as dist

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    _WORLD = World(rank=rank, local_rank=local_rank, world_size=world_size, device=device)
    return _WORLD


def all_reduce_sum(values: list[float], device: object = None) -> list[float]:
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return list(values)
    tensor = torch.tensor(values, dtype=torch.float64, device=device or "cpu")
    dist.all_reduce(tensor)
    return tensor.tolist()


def read_step_values(summed: list[Any], kept: list[Any], device: Any) -> list[float]:
    """``summed`` all-reduced over ranks, then ``kept`` as they are, read to the host in one synchronisation.

    Items are device tensors (0-dim) or Python numbers; engines call this once per step, after the
    step's work is queued, so the GPU never idles waiting for the host in the middle of a step.
    """
    import torch
    import torch.distributed as dist

    def on_device(values: list[Any]) -> Any:
        numbers = torch.tensor([0.0 if torch.is_tensor(v) else float(v) for v in values], dtype=torch.float64)
        if device is not None and torch.device(device).type == "cuda":
            numbers = numbers.pin_memory().to(device, non_blocking=True)
        tensors = [v.detach().reshape(()).to(device=numbers.device, dtype=torch.float64) if torch.is_tensor(v)
                   else numbers.new_zeros(()) for v in values]
        return (torch.stack(tensors) + numbers) if values else numbers

    reduced = on_device(summed)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 and summed:
        dist.all_reduce(reduced)
    return torch.cat([reduced, on_device(kept)]).tolist()


def barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def shutdown(exit_code: int | None = None) -> None:
    """Tear down the process group; under torchrun, exit hard so gloo threads cannot abort at exit."""
    import torch.distributed as dist

    global _WORLD
    distributed = dist.is_available() and dist.is_initialized()
    if distributed:
        try:
            dist.barrier()
        finally:
            dist.destroy_process_group()
    _WORLD = None
    if distributed and exit_code is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(exit_code)
