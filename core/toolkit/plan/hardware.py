"""The machine a plan is for: GPUs per node, nodes, memory, and the speeds the time model uses.

Speeds are datasheet peaks scaled to what collectives reach in practice (bus bandwidth of a
ring all-reduce, not link speed); they are constants on purpose, documented in docs/plan.md.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from toolkit.errors import ConfigError

GIB = 1024**3


@dataclass(frozen=True)
class GPUKind:
    """Per-GPU speeds: dense bf16 peak, HBM bandwidth, NVLink and network bus bandwidth (bytes/s)."""

    name: str
    memory: int
    peak_flops: float
    hbm_bandwidth: float
    intra_node_bandwidth: float
    inter_node_bandwidth: float


# Bus bandwidths: NVLink 4 (H100/H200) reaches ~360 GB/s in NCCL all-reduce, one 400 Gb/s NIC
# per GPU ~40 GB/s; A100 NVLink 3 ~230 GB/s with 200 Gb/s NICs ~20 GB/s.
GPU_KINDS = {
    "h100": GPUKind("h100", 80 * GIB, 989e12, 3.35e12, 360e9, 40e9),
    "h200": GPUKind("h200", 141 * 10**9, 989e12, 4.8e12, 360e9, 40e9),
    "a100": GPUKind("a100", 80 * GIB, 312e12, 2.0e12, 230e9, 20e9),
    "a100-40": GPUKind("a100-40", 40 * GIB, 312e12, 1.55e12, 230e9, 20e9),
    "l40s": GPUKind("l40s", 48 * GIB, 362e12, 0.86e12, 25e9, 12e9),
    "cpu": GPUKind("cpu", 16 * GIB, 1e12, 0.05e12, 10e9, 1e9),
}


@dataclass(frozen=True)
class Cluster:
    """``nodes`` x ``gpus_per_node`` GPUs of one kind; ``gpu_memory`` may override the kind's."""

    gpus_per_node: int
    nodes: int
    gpu: GPUKind

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.nodes

    @property
    def gpu_memory(self) -> int:
        return self.gpu.memory

    def bandwidth(self, spans_nodes: bool) -> float:
        return self.gpu.inter_node_bandwidth if spans_nodes else self.gpu.intra_node_bandwidth

    def describe(self) -> str:
        return (f"{self.nodes} node(s) x {self.gpus_per_node} {self.gpu.name.upper()} "
                f"({self.gpu_memory / GIB:.0f} GiB each)")


def parse_memory(text: str | int | float, flag: str = "--gpu-memory") -> int:
    """'80GiB' / '80G' / '80' (GiB) / '141GB' (10^9 bytes) -> bytes."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        return int(text * GIB)
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(gib|gb|g|mib|mb|tib|tb)?\s*", str(text).lower())
    if not match:
        raise ConfigError(f"{flag}: cannot read {text!r} as a memory size; write e.g. 80GiB, 141GB or 80")
    number, unit = float(match.group(1)), match.group(2) or "gib"
    scale = {"gib": GIB, "g": GIB, "gb": 10**9, "mib": 2**20, "mb": 10**6, "tib": 2**40, "tb": 10**12}[unit]
    value = int(number * scale)
    if value <= 0:
        raise ConfigError(f"{flag}: memory must be positive, got {text!r}")
    return value


def make_cluster(gpus: int, nodes: int = 1, gpu_memory: str | int | None = None, gpu_kind: str = "h100") -> Cluster:
    """``gpus`` in total over ``nodes`` nodes; errors name the flag and the arithmetic."""
    problems = []
    if gpus < 1:
        problems.append(f"--gpus must be at least 1, got {gpus}")
    if nodes < 1:
        problems.append(f"--nodes must be at least 1, got {nodes}")
    elif gpus >= 1 and gpus % nodes:
        problems.append(f"--gpus {gpus} does not split evenly over --nodes {nodes}; give the total GPU count, "
                        f"a multiple of the node count (e.g. --gpus {nodes * max(1, gpus // nodes)})")
    kind = GPU_KINDS.get(gpu_kind.lower())
    if kind is None:
        problems.append(f"--gpu {gpu_kind!r} is unknown; known: {', '.join(GPU_KINDS)}")
    if problems:
        raise ConfigError(problems)
    if gpu_memory is not None:
        kind = replace(kind, memory=parse_memory(gpu_memory))
    return Cluster(gpus_per_node=gpus // nodes, nodes=nodes, gpu=kind)


def detect_gpu_kind(device_name: str) -> str:
    """Map ``torch.cuda.get_device_name()`` to a known kind (H100 when unsure)."""
    lowered = device_name.lower()
    for key, kind in (("h200", "h200"), ("h100", "h100"), ("h800", "h100"), ("a100", "a100"), ("l40", "l40s")):
        if key in lowered:
            return kind
    return "h100"
