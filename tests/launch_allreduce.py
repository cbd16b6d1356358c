"""Worker for tests/test_launch.py: one all_reduce over gloo, prints what every rank saw."""

import os
import sys

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
value = torch.tensor([float(rank + 1)])
dist.all_reduce(value)
node = os.environ.get("GROUP_RANK", "?")
print(f"RESULT rank={rank} world={world} node={node} sum={value.item():g}", flush=True)
dist.barrier()
dist.destroy_process_group()
sys.stdout.flush()
os._exit(0)
