"""GPU check of the fused kernels before timing: Triton (and Liger) vs the torch reference, numbers and speed.

Called by bench/speed.py in its own process; also runnable alone: ``python bench/kernel_check.py``.
Shapes are those of the 1.24B benchmark (one micro-batch of 4 x 4096 tokens, one head chunk).
"""

from __future__ import annotations

import json
from typing import Any


def _timed_ms(fn, repeats: int = 10) -> float:
    import torch

    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def _fwd_bwd(op, inputs: list) -> tuple[list, list]:
    import torch

    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    out = op(*leaves)
    outs = list(out) if isinstance(out, tuple) else [out]
    gen = torch.Generator(device=outs[0].device).manual_seed(0)
    upstream = [torch.randn(o.shape, generator=gen, device=o.device, dtype=o.dtype) for o in outs]
    torch.autograd.backward(outs, upstream)
    return [o.detach() for o in outs], [x.grad for x in leaves]


def _cases(scale: int) -> list[tuple[str, Any, list]]:
    """(name, builder of the op from an ops object, inputs) at the benchmark's shapes divided by ``scale``."""
    import torch

    dev, bf16 = "cuda", torch.bfloat16
    tokens = 4 * 4096 // scale
    x = torch.randn(4, tokens // 4, 2048, device=dev, dtype=bf16)
    w = (1 + 0.1 * torch.randn(2048, device=dev)).to(bf16)
    gate, up = (torch.randn(tokens, 8192, device=dev, dtype=bf16) for _ in range(2))
    q = torch.randn(4, tokens // 4, 32, 64, device=dev, dtype=bf16).transpose(1, 2)
    k = torch.randn(4, tokens // 4, 8, 64, device=dev, dtype=bf16).transpose(1, 2)
    angles = torch.arange(tokens // 4, device=dev, dtype=torch.float32)[:, None] * 0.01 * torch.arange(32, device=dev)
    emb = torch.cat([angles, angles], -1)[None]
    cos, sin = emb.cos().to(bf16), emb.sin().to(bf16)
    return [
        ("rms_norm [16384, 2048]", lambda ops: (lambda x, w: ops.rms_norm(x, w, 1e-5)), [x, w]),
        ("swiglu [16384, 8192]", lambda ops: ops.swiglu, [gate, up]),
        ("rope q[4,32,4096,64] k[4,8,4096,64]", lambda ops: (lambda q, k: ops.rope(q, k, cos, sin)), [q, k]),
    ]


def check_kernels(args: Any = None) -> dict:
    """Print (and return) max abs differences and fwd+bwd milliseconds of each backend per op."""
    import torch

    from toolkit.train.kernels import reference

    if not torch.cuda.is_available():
        result = {"skipped": "no CUDA device: the Triton kernels are checked on CPU by tests/test_kernels.py (interpreter)"}
        print(f"kernel check skipped: {result['skipped']}")
        print("RESULT " + json.dumps(result), flush=True)
        return result
    backends: dict[str, Any] = {"torch": reference.TorchOps}
    try:
        from toolkit.train.kernels.triton_ops import TritonOps

        backends["triton"] = TritonOps
    except Exception as exc:  # a broken Triton must not hide the rest of the benchmark
        print(f"triton kernels unavailable: {type(exc).__name__}: {exc}")
    try:
        from toolkit.train.kernels import _liger_ops

        backends["liger"] = _liger_ops()
    except ImportError as exc:
        print(f"liger-kernel not installed ({exc}); its column is skipped")
    rows = []
    scale = 16 if getattr(args, "tiny", False) else 1
    for name, build, inputs in _cases(scale):
        ref_out, ref_grad = _fwd_bwd(build(reference.TorchOps), inputs)
        row = {"op": name}
        for backend, ops in backends.items():
            op = build(ops)
            try:
                out, grad = _fwd_bwd(op, inputs)
                row[f"{backend}_out_diff"] = max((a.float() - b.float()).abs().max().item() for a, b in zip(out, ref_out))
                row[f"{backend}_grad_diff"] = max((a.float() - b.float()).abs().max().item() for a, b in zip(grad, ref_grad))
                row[f"{backend}_ms"] = _timed_ms(lambda op=op, inputs=inputs: _fwd_bwd(op, inputs))
            except Exception as exc:
                row[f"{backend}_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        rows.append(row)
    rows.append(_check_logps_grad(backends))
    _print(rows, list(backends))
    result = {"rows": rows, "device": torch.cuda.get_device_name()}
    print("RESULT " + json.dumps(result), flush=True)
    return result


def _check_logps_grad(backends: dict) -> dict:
    import torch

    from toolkit.train.kernels import reference

    logits = torch.randn(2048, 128256, device="cuda", dtype=torch.bfloat16) * 4
    labels = torch.randint(0, 128256, (2048,), device="cuda")
    picked_ref, grad_ref = reference.logps_and_grad(logits, labels)
    row = {"op": "logps_and_grad [2048, 128256]"}
    for backend, ops in backends.items():
        try:
            picked, grad = ops.logps_and_grad(logits.clone(), labels)
            row[f"{backend}_out_diff"] = (picked - picked_ref).abs().max().item()
            row[f"{backend}_grad_diff"] = (grad.float() - grad_ref.float()).abs().max().item()
            row[f"{backend}_ms"] = _timed_ms(lambda ops=ops: ops.logps_and_grad(logits.clone(), labels))
        except Exception as exc:
            row[f"{backend}_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    return row


def _print(rows: list[dict], backends: list[str]) -> None:
    print("\nkernel check (bf16; max |backend - torch reference| of outputs / input grads; fwd+bwd ms)")
    print(f"{'op':40s}" + "".join(f"{b + ' out':>13s}{b + ' grad':>13s}{b + ' ms':>10s}" for b in backends))
    for row in rows:
        cells = []
        for b in backends:
            if f"{b}_error" in row:
                cells.append(f"{'ERROR':>13s}{'':>13s}{'':>10s}")
            else:
                cells.append(f"{row.get(f'{b}_out_diff', float('nan')):13.2e}{row.get(f'{b}_grad_diff', float('nan')):13.2e}"
                             f"{row.get(f'{b}_ms', float('nan')):10.3f}")
        print(f"{row['op']:40s}" + "".join(cells))
    for row in rows:
        for key, value in row.items():
            if key.endswith("_error"):
                print(f"  {row['op']} {key[:-6]}: {value}")


if __name__ == "__main__":
    check_kernels()
