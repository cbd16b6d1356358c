"""Expert computation on expert-major rows: grouped matmul on GPU, a reference loop elsewhere.

Weights keep the transformers 5.x fused layout (``gate_up_proj [E, 2I, H]``, ``down_proj
[E, H, I]``), so a patched model has the same parameter names and shapes as the original.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

_GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def grouped_mm_available(device: torch.device, dtype: torch.dtype) -> bool:
    """torch's grouped GEMM kernels: CUDA sm80+ (bf16 is the fast path); CPU uses the loop."""
    if _GROUPED_MM is None or device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device) >= (8, 0) and dtype in (torch.bfloat16, torch.float16, torch.float32)


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


def swiglu(gate_up: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return act(gate) * up


def expert_ffn(
    rows: torch.Tensor,
    counts: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    act: Callable[[torch.Tensor], torch.Tensor],
    *,
    use_grouped_mm: bool,
) -> torch.Tensor:
    """SwiGLU experts over expert-major ``rows`` ``[M, H]``; ``counts`` ``[E]`` rows per expert.

    Rows after ``sum(counts)`` belong to no expert (dropped): the grouped path lets the last
    expert compute them (their combine weight is zero; no host sync needed to cut them off),
    the loop path returns zeros for them.
    """
    if use_grouped_mm:
        offsets = torch.cumsum(counts, 0).to(torch.int32)
        offsets[-1] = rows.shape[0]
        rows = rows.to(gate_up_proj.dtype)
        hidden = swiglu(grouped_linear(rows, gate_up_proj, offsets), act)
        return grouped_linear(hidden, down_proj, offsets)
    host_counts = counts.tolist()
    hidden = swiglu(loop_linear(rows, gate_up_proj, host_counts), act)
    return loop_linear(hidden, down_proj, host_counts)
