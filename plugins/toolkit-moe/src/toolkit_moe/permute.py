"""Token permutation as two adjoint gathers, so neither direction needs atomics or a sort in backward.

``replicate_rows`` builds the expert-major rows (token ``order[i] // k`` for row ``i``);
``reduce_rows`` sums each token's ``k`` rows back. Autograd of a plain ``x[index]`` would
scatter-add with a sort on CUDA; here each backward is the other direction's gather.
"""

from __future__ import annotations

import torch

from toolkit.train.kernels.compiled import fused as compiled


def _gather_sum(rows: torch.Tensor, index: torch.Tensor, top_k: int) -> torch.Tensor:
    """``rows[index]`` summed over groups of ``top_k`` consecutive indices (one kernel on CUDA: the
    ``[N*k, H]`` gathered copy is never written)."""
    return rows[index].view(-1, top_k, rows.shape[-1]).sum(1)


class _ReplicateRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tokens, order, inverse, top_k):
        ctx.save_for_backward(inverse)
        ctx.top_k = top_k
        return tokens[order // top_k]

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        return compiled("moe_gather_sum", _gather_sum, grad.device)(grad, inverse, ctx.top_k), None, None, None


class _ReduceRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, order, inverse, top_k):
        ctx.save_for_backward(order)
        ctx.top_k = top_k
        return compiled("moe_gather_sum", _gather_sum, rows.device)(rows, inverse, top_k)

    @staticmethod
    def backward(ctx, grad):
        (order,) = ctx.saved_tensors
        return grad[order // ctx.top_k], None, None, None


def replicate_rows(tokens: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor, top_k: int) -> torch.Tensor:
    """``[N, H] -> [N*k, H]``: row ``i`` is token ``order[i] // k``."""
    return _ReplicateRows.apply(tokens, order, inverse, top_k)


def reduce_rows(rows: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor, top_k: int) -> torch.Tensor:
    """``[N*k, H] -> [N, H]``: token ``t`` sums rows ``inverse[t*k : t*k+k]``."""
    return _ReduceRows.apply(rows, order, inverse, top_k)


def inverse_permutation(order: torch.Tensor) -> torch.Tensor:
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return inverse


def _swiglu_forward(gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up * weight


def _swiglu_backward(gate_up: torch.Tensor, weight: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    gate, up = gate_up.float().chunk(2, dim=-1)
    grad = grad.float()
    sig = torch.sigmoid(gate)
    silu = gate * sig
    grad_weighted = grad * weight.float()
    grad_gate = grad_weighted * up * sig * (1 + gate * (1 - sig))
    grad_up = grad_weighted * silu
    grad_weight = (grad * silu * up).sum(-1, keepdim=True)
    return torch.cat([grad_gate, grad_up], -1).to(gate_up.dtype), grad_weight.to(weight.dtype)


class _WeightedSwiGLU(torch.autograd.Function):
    """``silu(gate) * up * weight`` saving only its inputs (the router weight folds in here)."""

    @staticmethod
    def forward(ctx, gate_up, weight):
        ctx.save_for_backward(gate_up, weight)
        return compiled("moe_swiglu_fwd", _swiglu_forward, gate_up.device)(gate_up, weight)

    @staticmethod
    def backward(ctx, grad):
        gate_up, weight = ctx.saved_tensors
        return compiled("moe_swiglu_bwd", _swiglu_backward, gate_up.device)(gate_up, weight, grad)


def weighted_swiglu(gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``[M, 2I], [M, 1] -> [M, I]``; silu is the activation of all supported families."""
    return _WeightedSwiGLU.apply(gate_up, weight)
