"""Run by tests/test_kernels.py with TRITON_INTERPRET=1: each Triton kernel against its torch reference.

Prints one line per check ending in OK or FAIL (relative max difference of outputs and input gradients).
"""

from __future__ import annotations

import os
import sys

import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1 (Triton's CPU interpreter)"

from toolkit.train.kernels import reference as ref  # noqa: E402
from toolkit.train.kernels import triton_ops as tri  # noqa: E402


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / a.float().abs().max().clamp(min=1e-12)).item()


def compare(name: str, f_ref, f_tri, inputs: list[torch.Tensor], tol: float) -> bool:
    a = [x.clone().requires_grad_() for x in inputs]
    b = [x.clone().requires_grad_() for x in inputs]
    ya, yb = f_ref(*a), f_tri(*b)
    ya, yb = (ya if isinstance(ya, tuple) else (ya,)), (yb if isinstance(yb, tuple) else (yb,))
    fused = all(type(y.grad_fn).__name__.startswith("_") for y in yb)  # our autograd Functions, not a fallback
    upstream = [torch.randn_like(y) for y in ya]
    sum((y.float() * g.float()).sum() for y, g in zip(ya, upstream)).backward()
    sum((y.float() * g.float()).sum() for y, g in zip(yb, upstream)).backward()
    out = max(relative(x, y) for x, y in zip(ya, yb))
    grad = max(relative(x.grad, y.grad) for x, y in zip(a, b))
    ok = fused and out <= tol and grad <= tol
    print(f"{name}: fused={fused} output {out:.2e} grad {grad:.2e} {'OK' if ok else 'FAIL'}")
    return ok


def main() -> int:
    torch.manual_seed(0)
    results = []
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1.6e-2)):
        x, w = torch.randn(3, 5, 48, dtype=dtype), (1 + 0.1 * torch.randn(48)).to(dtype)
        results.append(compare(f"rms_norm {dtype}", lambda x, w: ref.rms_norm(x, w, 1e-6), lambda x, w: tri.rms_norm(x, w, 1e-6), [x, w], tol))
        gate, up = torch.randn(4, 7, 40, dtype=dtype), torch.randn(4, 7, 40, dtype=dtype)
        results.append(compare(f"swiglu {dtype}", ref.swiglu, tri.swiglu, [gate, up], tol))
        batch, q_heads, k_heads, length, dim = 2, 4, 2, 6, 16
        q = torch.randn(batch, length, q_heads, dim, dtype=dtype).transpose(1, 2)  # HF's layout: a transposed view
        k = torch.randn(batch, length, k_heads, dim, dtype=dtype).transpose(1, 2)
        angles = torch.randn(1, length, dim // 2)
        emb = torch.cat([angles, angles], -1)
        cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
        results.append(compare(f"rope {dtype}", lambda q, k, c=cos, s=sin: ref.rope(q, k, c, s), lambda q, k, c=cos, s=sin: tri.rope(q, k, c, s), [q, k], tol))
        logits, labels = torch.randn(5, 37, dtype=dtype) * 3, torch.randint(0, 37, (5,))
        picked_ref, grad_ref = ref.logps_and_grad(logits, labels)
        picked, grad = tri.logps_and_grad(logits.clone(), labels)
        diff = max(relative(picked_ref, picked), relative(grad_ref, grad))
        print(f"logps_and_grad {dtype}: {diff:.2e} {'OK' if diff <= tol else 'FAIL'}")
        results.append(diff <= tol)
    from toolkit.train.kernels import self_test

    problem = self_test(tri.TritonOps, torch.device("cpu"))
    print(f"self_test: {problem or 'OK'}")
    results.append(problem is None)

    class Broken(tri.TritonOps):
        rms_norm = staticmethod(lambda x, weight, eps: tri.rms_norm(x, weight * 2, eps))

    results.append(self_test(Broken, torch.device("cpu")) is not None)  # the self-test can fail
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
