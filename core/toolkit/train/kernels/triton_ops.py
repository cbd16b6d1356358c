"""Triton kernels for RMSNorm, SwiGLU, RoPE and the label log-prob gradient, each an autograd Function.

Imported only when Triton is installed. Every op falls back to the torch reference
(:mod:`toolkit.train.kernels.reference`) for inputs it does not handle (CPU tensors, unusual
shapes or strides), so a model patched with these ops stays correct everywhere. On CPU the
kernels themselves can be checked with ``TRITON_INTERPRET=1`` (Triton's interpreter).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import triton
import triton.language as tl

from toolkit.train.kernels import reference

_ELEMENTWISE_BLOCK = 1024
_MAX_FUSED_COLS = 65536
_RMS_ROWS_PER_PROGRAM = 32


def _usable(*tensors: torch.Tensor) -> bool:
    """Tensors the kernels handle: on a GPU (or anywhere under the interpreter), floating point."""
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    return all((t.is_cuda or interpret) and t.is_floating_point() for t in tensors)


# ----------------------------------------------------------------------------- RMSNorm


@triton.jit
def _rms_norm_forward(X, W, Y, RSTD, stride_x, stride_y, n_cols, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    tl.store(RSTD + row, rstd)
    normed = (x * rstd).to(X.dtype.element_ty).to(tl.float32)  # HF rounds before the weight multiply
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + cols, (normed * w).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_backward(DY, X, W, RSTD, DX, DW_PARTIAL, stride_dy, stride_x, stride_dx, n_rows, n_cols,
                       rows_per_program, BLOCK: tl.constexpr):
    program = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK,), dtype=tl.float32)
    first = program * rows_per_program
    for offset in range(0, rows_per_program):
        row = first + offset
        if row < n_rows:
            r = row.to(tl.int64)
            dy = tl.load(DY + r * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
            x = tl.load(X + r * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
            rstd = tl.load(RSTD + r)
            normed = x * rstd
            dw += dy * normed.to(X.dtype.element_ty).to(tl.float32)
            g = dy * w
            dx = rstd * (g - normed * (tl.sum(g * normed, axis=0) / n_cols))
            tl.store(DX + r * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=mask)
    tl.store(DW_PARTIAL + program.to(tl.int64) * n_cols + cols, dw, mask=mask)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        rows, cols = x2.shape
        out_dtype = torch.promote_types(x.dtype, weight.dtype)
        y = torch.empty((rows, cols), dtype=out_dtype, device=x.device)
        rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
        block = triton.next_power_of_2(cols)
        _rms_norm_forward[(rows,)](x2, weight, y, rstd, x2.stride(0), y.stride(0), cols, eps, BLOCK=block,
                                   num_warps=min(max(block // 256, 1), 16))
        ctx.save_for_backward(x2, weight, rstd)
        ctx.shape = shape
        return y.view(*shape[:-1], cols)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        x2, weight, rstd = ctx.saved_tensors
        rows, cols = x2.shape
        dy2 = dy.reshape(rows, cols)
        if dy2.stride(-1) != 1:
            dy2 = dy2.contiguous()
        dx = torch.empty_like(x2)
        programs = triton.cdiv(rows, _RMS_ROWS_PER_PROGRAM)
        partial = torch.empty((programs, cols), dtype=torch.float32, device=x2.device)
        block = triton.next_power_of_2(cols)
        _rms_norm_backward[(programs,)](dy2, x2, weight, rstd, dx, partial, dy2.stride(0), x2.stride(0), dx.stride(0),
                                        rows, cols, _RMS_ROWS_PER_PROGRAM, BLOCK=block,
                                        num_warps=min(max(block // 256, 1), 16))
        dw = partial.sum(0).to(weight.dtype) if ctx.needs_input_grad[1] else None
        return dx.view(ctx.shape), dw, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if not _usable(x, weight) or x.shape[-1] > _MAX_FUSED_COLS or weight.shape != x.shape[-1:]:
        return reference.rms_norm(x, weight, eps)
    return _RMSNorm.apply(x, weight, eps)


# ----------------------------------------------------------------------------- SwiGLU


@triton.jit
def _swiglu_forward(G, U, Y, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    g = tl.load(G + offsets, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offsets, mask=mask, other=0.0).to(tl.float32)
    act = (g * tl.sigmoid(g)).to(G.dtype.element_ty).to(tl.float32)  # HF rounds silu(g) before the product
    tl.store(Y + offsets, (act * u).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_backward(DY, G, U, DG, DU, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    dy = tl.load(DY + offsets, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + offsets, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offsets, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    act = g * sig
    tl.store(DU + offsets, (dy * act).to(DU.dtype.element_ty), mask=mask)
    tl.store(DG + offsets, (dy * u * sig * (1.0 + g * (1.0 - sig))).to(DG.dtype.element_ty), mask=mask)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate, up = gate.contiguous(), up.contiguous()
        y = torch.empty_like(gate)
        n = gate.numel()
        _swiglu_forward[(triton.cdiv(n, _ELEMENTWISE_BLOCK),)](gate, up, y, n, BLOCK=_ELEMENTWISE_BLOCK)
        ctx.save_for_backward(gate, up)
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gate, up = ctx.saved_tensors
        dy = dy.contiguous()
        dg, du = torch.empty_like(gate), torch.empty_like(up)
        n = gate.numel()
        _swiglu_backward[(triton.cdiv(n, _ELEMENTWISE_BLOCK),)](dy, gate, up, dg, du, n, BLOCK=_ELEMENTWISE_BLOCK)
        return dg, du


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if not _usable(gate, up) or gate.shape != up.shape or gate.dtype != up.dtype:
        return reference.swiglu(gate, up)
    return _SwiGLU.apply(gate, up)


# ----------------------------------------------------------------------------- RoPE


@triton.jit
def _rope_kernel(X, COS, SIN, Y, seq_len, heads, sxb, sxh, sxt, syb, syh, syt, scb, sct, ssb, sst, half,
                 SIGN: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """One (batch, position): every head. SIGN=-1 applies the transpose (the backward pass)."""
    program = tl.program_id(0).to(tl.int64)
    b = program // seq_len
    t = program % seq_len
    d = tl.arange(0, BLOCK_D)
    h = tl.arange(0, BLOCK_H)
    dmask = d < half
    cos1 = tl.load(COS + b * scb + t * sct + d, mask=dmask, other=0.0).to(tl.float32)
    cos2 = tl.load(COS + b * scb + t * sct + half + d, mask=dmask, other=0.0).to(tl.float32)
    sin1 = tl.load(SIN + b * ssb + t * sst + d, mask=dmask, other=0.0).to(tl.float32) * SIGN
    sin2 = tl.load(SIN + b * ssb + t * sst + half + d, mask=dmask, other=0.0).to(tl.float32) * SIGN
    mask = (h[:, None] < heads) & dmask[None, :]
    x_row = X + b * sxb + t * sxt + h[:, None] * sxh + d[None, :]
    y_row = Y + b * syb + t * syt + h[:, None] * syh + d[None, :]
    x1 = tl.load(x_row, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + half, mask=mask, other=0.0).to(tl.float32)
    if SIGN > 0:  # y = x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1)
        y1 = x1 * cos1 - x2 * sin1
        y2 = x2 * cos2 + x1 * sin2
    else:  # the transpose of that map: dx1 = c1 dy1 + s2 dy2, dx2 = c2 dy2 - s1 dy1 (sin already negated)
        y1 = x1 * cos1 - x2 * sin2
        y2 = x2 * cos2 + x1 * sin1
    tl.store(y_row, y1.to(Y.dtype.element_ty), mask=mask)
    tl.store(y_row + half, y2.to(Y.dtype.element_ty), mask=mask)


def _rope_one(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: int) -> torch.Tensor:
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = torch.empty_like(x)
    batch, heads, seq_len, dim = x.shape
    half = dim // 2
    _rope_kernel[(batch * seq_len,)](
        x, cos, sin, y, seq_len, heads, x.stride(0), x.stride(1), x.stride(2), y.stride(0), y.stride(1), y.stride(2),
        cos.stride(0), cos.stride(1), sin.stride(0), sin.stride(1), half,
        SIGN=sign, BLOCK_H=triton.next_power_of_2(heads), BLOCK_D=triton.next_power_of_2(half))
    return y


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = cos.expand(q.shape[0], -1, -1), sin.expand(q.shape[0], -1, -1)
        ctx.save_for_backward(cos, sin)
        return _rope_one(q, cos, sin, 1), _rope_one(k, cos, sin, 1)

    @staticmethod
    def backward(ctx: Any, dq: torch.Tensor, dk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None, None]:
        cos, sin = ctx.saved_tensors
        return _rope_one(dq, cos, sin, -1), _rope_one(dk, cos, sin, -1), None, None


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    shapes_ok = (q.dim() == 4 and k.dim() == 4 and cos.dim() == 3 and cos.shape == sin.shape
                 and cos.shape[-1] == q.shape[-1] == k.shape[-1] and q.shape[-1] % 2 == 0
                 and cos.shape[1] == q.shape[2] == k.shape[2] and cos.shape[0] in (1, q.shape[0])
                 and cos.stride(-1) == 1 and sin.stride(-1) == 1 and q.dtype == k.dtype)
    if not shapes_ok or not _usable(q, k, cos, sin) or cos.requires_grad or sin.requires_grad:
        return reference.rope(q, k, cos, sin)
    return _Rope.apply(q, k, cos, sin)


# ----------------------------------------------------------------------------- label log-probs


@triton.jit
def _logps_and_grad_kernel(LOGITS, LABELS, PICKED, stride, n_cols, BLOCK: tl.constexpr):
    """Per row: log p(label) and, written over the logits, onehot(label) - softmax (two passes)."""
    row = tl.program_id(0).to(tl.int64)
    base = LOGITS + row * stride
    label = tl.load(LABELS + row)
    running_max = float("-inf")
    running_sum = 0.0
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(running_max, tl.max(x, axis=0))
        running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(x - new_max), axis=0)
        running_max = new_max
    lse = running_max + tl.log(running_sum)
    tl.store(PICKED + row, tl.load(base + label).to(tl.float32) - lse)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
        grad = tl.where(cols == label, 1.0, 0.0) - tl.exp(x - lse)
        tl.store(base + cols, grad.to(LOGITS.dtype.element_ty), mask=mask)


def logps_and_grad(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """As :func:`reference.logps_and_grad`, but the gradient overwrites ``logits`` (which the caller gives up)."""
    if not _usable(logits) or logits.dim() != 2 or logits.stride(-1) != 1 or logits.shape[0] == 0:
        return reference.logps_and_grad(logits, labels)
    rows, cols = logits.shape
    picked = torch.empty(rows, dtype=torch.float32, device=logits.device)
    _logps_and_grad_kernel[(rows,)](logits, labels.contiguous(), picked, logits.stride(0), cols, BLOCK=4096, num_warps=16)
    return picked, logits


class TritonOps:
    """The toolkit's own Triton kernels (torch reference for anything they do not cover)."""

    name = "triton"

    rms_norm = staticmethod(rms_norm)
    swiglu = staticmethod(swiglu)
    rope = staticmethod(rope)
    logps_and_grad = staticmethod(logps_and_grad)
