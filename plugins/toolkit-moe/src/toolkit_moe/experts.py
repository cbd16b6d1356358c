"""Expert computation on expert-major rows: grouped matmul on GPU, a reference loop elsewhere.

Weights keep the transformers 5.x fused layout (``gate_up_proj [E, 2I, H]``, ``down_proj
[E, H, I]``), so a patched model has the same parameter names and shapes as the original.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from toolkit_moe.permute import weighted_swiglu

_GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


@functools.cache
def _capability(index: int | None) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def grouped_mm_available(device: torch.device, dtype: torch.dtype) -> bool:
    """torch's grouped GEMM kernels: CUDA sm80+ in bf16 (what they are built for); else the loop."""
    if _GROUPED_MM is None or device.type != "cuda":
        return False
    return _capability(device.index) >= (8, 0) and dtype == torch.bfloat16


def grouped_linear(rows: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``rows [M, in] @ weight[e].T`` for the rows of each expert ``e`` (``weight [E, out, in]``).

    ``offsets`` ``[E]`` int32 are cumulative row counts; the last must equal ``M``.
    """
    return _GROUPED_MM(rows, weight.transpose(-2, -1), offs=offsets)


def loop_linear(rows: torch.Tensor, weight: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Reference: one matmul per expert over its contiguous rows (CPU and tests)."""
    pieces = [rows[start:start + n] @ weight[e].T for e, (start, n) in enumerate(_spans(counts)) if n]
    tail = rows.shape[0] - sum(counts)
    if tail:  # rows past the last expert (dropped assignments) produce zeros
        pieces.append(rows.new_zeros(tail, weight.shape[1]))
    return torch.cat(pieces) if pieces else rows.new_zeros(0, weight.shape[1])


def _spans(counts: list[int]) -> list[tuple[int, int]]:
    spans, start = [], 0
    for n in counts:
        spans.append((start, n))
        start += n
    return spans


def compute_dtype(rows: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The autocast dtype when autocast is on (fp32 master weights, bf16 maths), else the weights'."""
    device_type = rows.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return weight.dtype


def activate(gate_up: torch.Tensor, row_weights: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``act(gate) * up * router_weight``; SiLU (every supported family) takes the fused path."""
    row_weights = row_weights.to(gate_up.dtype)
    if isinstance(act, torch.nn.SiLU) or type(act).__name__ == "SiLUActivation":
        return weighted_swiglu(gate_up, row_weights)
    gate, up = gate_up.chunk(2, dim=-1)
    return act(gate) * up * row_weights


def expert_ffn(
    rows: torch.Tensor,
    row_weights: torch.Tensor,
    counts: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    act: Callable[[torch.Tensor], torch.Tensor],
    *,
    use_grouped_mm: bool,
) -> torch.Tensor:
    """Weighted SwiGLU experts over expert-major ``rows`` ``[M, H]``; ``counts`` ``[E]`` rows per expert.

    ``row_weights`` ``[M, 1]`` are the router weights of the rows, applied before the down
    projection (on ``I`` rather than ``H`` columns). Rows after ``sum(counts)`` belong to no
    expert (dropped, weight zero): the grouped path lets the last expert compute them (no host
    sync to cut them off), the loop path returns zeros for them.
    """
    dtype = compute_dtype(rows, gate_up_proj)
    rows, gate_up_proj, down_proj = rows.to(dtype), gate_up_proj.to(dtype), down_proj.to(dtype)
    with torch.autocast(rows.device.type, enabled=False):
        if use_grouped_mm:
            offsets = torch.cumsum(counts, 0).to(torch.int32)
            offsets[-1] = rows.shape[0]
            hidden = activate(grouped_linear(rows, gate_up_proj, offsets), row_weights, act)
            return grouped_linear(hidden, down_proj, offsets)
        host_counts = counts.tolist()
        hidden = activate(loop_linear(rows, gate_up_proj, host_counts), row_weights, act)
        return loop_linear(hidden, down_proj, host_counts)
