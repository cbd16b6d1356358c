"""Megatron-Core's import-time warnings, replaced by one line that says what is missing and what it costs.

Without Transformer Engine and Apex, megatron-core warns once per module and per rank (about
28 lines on a two-process run) that it falls back to torch; the warnings are silenced here (by
their exact messages, nothing else) and :func:`fallback_notice` says it once, on rank 0.
"""

from __future__ import annotations

import importlib.util
import os
import warnings

SILENCED = (
    "Transformer Engine and Apex are not installed",
    "Apex is not installed",
    "full scope is deprecated",  # megatron-core's own default for cuda_graph_scope, not a setting of ours
    "When using async grad allreduce it is recommended to set the environment variable CUDA_DEVICE_MAX_CONNECTIONS",
)


def silence_fallback_warnings() -> None:
    for message in SILENCED:
        warnings.filterwarnings("ignore", message=message, category=UserWarning)


def fallback_notice(on_cuda: bool, tensor_parallel: int) -> str | None:
    """One line about the missing fused libraries, or None when nothing is missing."""
    missing = [name for name, module in (("Transformer Engine", "transformer_engine"), ("Apex", "apex"))
               if importlib.util.find_spec(module) is None]
    hints = []
    if missing:
        cost = ("a slower optimizer step and norms, no fp8 (pip install transformer-engine[pytorch])" if on_cuda
                else "no cost on CPU")
        hints.append(f"{' and '.join(missing)} not installed: Megatron-Core uses torch's optimizer, norms and "
                     f"multi-tensor ops, toolkit its SDPA attention ({cost})")
    if on_cuda and tensor_parallel > 1 and os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") != "1":
        hints.append("CUDA_DEVICE_MAX_CONNECTIONS is not 1: tensor-parallel communication overlaps less with compute")
    return "toolkit-megatron: " + "; ".join(hints) if hints else None
