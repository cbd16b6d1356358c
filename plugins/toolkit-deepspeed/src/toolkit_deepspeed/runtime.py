"""Process setup for DeepSpeed: accelerator choice, CPU op builds, the process group."""

from __future__ import annotations

import os
from typing import Any

from toolkit.train.distributed import free_port


def import_deepspeed() -> Any:
    """Import DeepSpeed with the CPU accelerator when there is no GPU.

    ``DS_ACCELERATOR`` must be set before the first import. On CPU DeepSpeed would compile a
    shared-memory all-reduce op (about 24 s on first use) for inference collectives; training
    goes through gloo, so the build is skipped.
    """
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import sys
    import warnings

    # DeepSpeed's ZeRO collectives call torch's older names; say it once, not at every step.
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
    import deepspeed
    import deepspeed.comm.torch  # noqa: F401  (``deepspeed.comm.torch`` the attribute is the torch package)
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() == "cpu":
        sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    return deepspeed


def init_distributed() -> Any:
    """The toolkit's world (torchrun environment), with DeepSpeed's comm layer on the same group."""
    from toolkit.train.distributed import init_world

    world = init_world()
    deepspeed = import_deepspeed()
    if not world.distributed:
        # One process: DeepSpeed still wants a process group; give it a private one.
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
            os.environ.setdefault(name, value)
    deepspeed.init_distributed(dist_backend="nccl" if world.device.type == "cuda" else "gloo", verbose=False)
    return world


def on_cpu() -> bool:
    import torch

    return not torch.cuda.is_available()
