"""Torch reference implementations of the fused ops, written to compute what Hugging Face's modules compute.

They are what runs on CPU (and inside ``torch.compile``, where inductor fuses them itself), and the
yardstick every Triton or Liger kernel is compared against. Same dtype rounding as transformers'
Llama/Mistral/Qwen2/Qwen3 code, so swapping them in changes nothing numerically.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x / rms(x))``: statistics in fp32, normalised value rounded to ``x``'s dtype first (as HF)."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` (the Llama MLP's activation)."""
    return F.silu(gate) * up


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding of ``q [B, Hq, T, D]`` and ``k [B, Hk, T, D]`` with ``cos``/``sin [B, T, D]``."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def logps_and_grad(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``log p(label)`` per row (fp32) and ``d log p(label) / d logits = onehot(label) - softmax`` in ``logits``' dtype.

    The softmax is formed in fp32 like autograd's own gradient of ``log_softmax``, then rounded once.
    """
    logps = torch.log_softmax(logits.float(), dim=-1)
    picked = logps.gather(-1, labels[:, None]).squeeze(-1)
    grad = logps.exp_().neg_().scatter_add_(-1, labels[:, None], logps.new_ones(labels.shape[0], 1))
    return picked, grad.to(logits.dtype)


class TorchOps:
    """The reference ops behind the common interface of every kernel backend."""

    name = "torch"

    rms_norm = staticmethod(rms_norm)
    swiglu = staticmethod(swiglu)
    rope = staticmethod(rope)
    logps_and_grad = staticmethod(logps_and_grad)
