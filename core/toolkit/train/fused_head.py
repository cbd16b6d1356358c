"""Label log-probs through the output head with the gradient made in forward (fused linear + cross-entropy).

For a loss whose gradient with respect to every label log-prob is the same number (token-averaged
cross-entropy: ``pt``/``sft``, which declare ``uniform_token_gradient = True``), the head's input
and weight gradients can be formed while each chunk's logits exist: logits -> log-sum-exp -> label
log-prob -> ``onehot - softmax`` -> two GEMMs, and the chunk's logits are dropped. Nothing of the
vocabulary size is kept for backward but the weight gradient itself, and backward is a scale.
"""

from __future__ import annotations

from typing import Any

import torch


class FusedLinearLogps(torch.autograd.Function):
    """``log p(labels)`` for ``hidden [N, H]`` through ``weight [V, H]`` (no bias), gradients made in forward.

    The input gradient is exact for any incoming gradient (it is kept per token); the weight gradient
    is summed over tokens in forward, so backward scales it by the mean incoming gradient, which is
    exact only when every token gets the same one. Callers must check that (see module docstring).
    """

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor, chunk: int, ops: Any) -> torch.Tensor:
        device_type = hidden.device.type
        dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else hidden.dtype
        train_weight = weight.requires_grad
        # dtypes are handled here (autocast rejects ``out=``); no graph is recorded: backward is a scale
        with torch.no_grad(), torch.autocast(device_type, enabled=False):
            h, w = hidden.to(dtype), weight.to(dtype)
            picked = torch.empty(h.shape[0], dtype=torch.float32, device=h.device)
            grad_hidden = torch.empty_like(h)
            grad_weight = torch.zeros(w.shape, dtype=weight.dtype, device=w.device) if train_weight else None
            for start in range(0, h.shape[0], chunk):
                h_chunk = h[start:start + chunk]
                logits = h_chunk @ w.t()
                picked[start:start + chunk], direction = ops.logps_and_grad(logits, labels[start:start + chunk])
                del logits  # the Triton op reuses its storage for ``direction``
                torch.mm(direction, w, out=grad_hidden[start:start + chunk])
                if grad_weight is not None:
                    accumulate_weight_grad(grad_weight, direction, h_chunk)
                del direction
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.hidden_dtype = hidden.dtype
        return picked

    @staticmethod
    def backward(ctx: Any, grad_picked: torch.Tensor) -> tuple[Any, ...]:
        d_hidden, d_weight = scaled_gradients(ctx, grad_picked)
        return d_hidden, None, d_weight, None, None


def accumulate_weight_grad(grad_weight: torch.Tensor, direction: torch.Tensor, rows: torch.Tensor) -> None:
    """``grad_weight += direction^T rows`` in place: one GEMM accumulating into it when the dtypes match."""
    if grad_weight.dtype == direction.dtype:
        grad_weight.addmm_(direction.t(), rows)
    else:
        grad_weight += (direction.t() @ rows).to(grad_weight.dtype)


def scaled_gradients(ctx: Any, grad_picked: torch.Tensor) -> tuple[Any, Any]:
    """Backward of a head whose forward saved ``(grad_hidden, grad_weight)`` (inputs 0 and 2 of its
    ``apply``): the input gradient scaled per token, the weight gradient by the mean incoming gradient
    (zero for no tokens, not 0/0); ``ctx.hidden_dtype``, when set, is the input gradient's dtype."""
    grad_hidden, grad_weight = ctx.saved_tensors
    d_hidden = d_weight = None
    if ctx.needs_input_grad[0]:
        d_hidden = grad_picked[:, None].to(grad_hidden.dtype) * grad_hidden
        d_hidden = d_hidden.to(getattr(ctx, "hidden_dtype", d_hidden.dtype))
    if ctx.needs_input_grad[2] and grad_weight is not None:
        mean = grad_picked.sum() / max(grad_picked.numel(), 1)
        d_weight = grad_weight * mean.to(grad_weight.dtype)
    return d_hidden, d_weight


def fused_label_logps(head: torch.nn.Module, hidden: torch.Tensor, labels: torch.Tensor, chunk: int, ops: Any = None) -> torch.Tensor:
    """:class:`FusedLinearLogps` through a plain bias-free linear ``head`` (``ops``: a kernel backend, torch by default)."""
    if ops is None:
        from toolkit.train.kernels.reference import TorchOps as ops
    return FusedLinearLogps.apply(hidden, labels, head.weight, chunk, ops)
