"""Fused kernels for HF decoder models: RMSNorm, SwiGLU, RoPE and the label log-prob gradient.

Backends share one interface (``rms_norm``, ``swiglu``, ``rope``, ``logps_and_grad``):
``torch`` (the references in :mod:`.reference`, what runs on CPU), ``triton`` (the toolkit's own
kernels in :mod:`.triton_ops`) and ``liger`` (liger-kernel's, when installed). :func:`load_ops`
resolves a requested backend to one that can run here, saying why when it falls back.
"""

from __future__ import annotations

import sys
from typing import Any

BACKENDS = ("none", "torch", "triton", "liger", "auto")


def _say(message: str) -> None:
    print(f"toolkit: {message}", file=sys.stderr)


def triton_available() -> str | None:
    """``None`` when the Triton kernels can run here, else the reason they cannot."""
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        return f"triton is not installed ({exc})"
    return None


def load_ops(backend: str, flag: str = "--local-kernels") -> Any:
    """The ops object for ``backend`` (``none`` -> ``None``); falls back to ``torch`` with a message
    naming ``flag`` (the option the user set).

    ``auto`` picks ``triton`` on a CUDA device with Triton, else ``none`` (the model's own modules).
    """
    from toolkit.errors import ConfigError

    if backend not in BACKENDS:
        raise ConfigError([f"kernels {backend!r} is not one of {', '.join(BACKENDS)}"], source=flag)
    if backend == "none":
        return None
    if backend == "auto":
        return None if triton_available() else _triton_ops()
    if backend == "torch":
        from toolkit.train.kernels.reference import TorchOps

        return TorchOps
    if backend == "liger":
        reason = triton_available()
        if reason is None:
            try:
                return _checked(_liger_ops())
            except ImportError as exc:
                reason = f"liger-kernel is not installed ({exc}); pip install liger-kernel"
        _say(f"{flag} liger unavailable: {reason}; using the torch reference ops")
        from toolkit.train.kernels.reference import TorchOps

        return TorchOps
    reason = triton_available()
    if reason is not None:
        _say(f"{flag} triton unavailable: {reason}; using the torch reference ops")
        from toolkit.train.kernels.reference import TorchOps

        return TorchOps
    return _triton_ops()


def _triton_ops() -> Any:
    from toolkit.train.kernels.triton_ops import TritonOps

    return _checked(TritonOps)


def _checked(ops: Any) -> Any:
    """``ops`` if it passes :func:`self_test` on this device, else the torch reference ops, saying why."""
    import torch

    problem = self_test(ops, torch.device("cuda"))
    if problem is None:
        return ops
    _say(f"{ops.name} kernels failed their self-test ({problem}); using the torch reference ops")
    from toolkit.train.kernels.reference import TorchOps

    return TorchOps


def self_test(ops: Any, device: Any) -> str | None:
    """Each op of ``ops`` once on small bf16 inputs, forward and backward, against the torch reference.

    Returns the first problem (an exception or a relative difference above 5e-2), or ``None``.
    Catches a Triton that cannot compile our kernels before a run depends on them.
    """
    import torch

    from toolkit.train.kernels import reference

    gen = torch.Generator(device="cpu").manual_seed(0)

    def rand(*shape: int) -> Any:
        return torch.randn(*shape, generator=gen).to(device=device, dtype=torch.bfloat16)

    angles = torch.randn(1, 8, 16, generator=gen)
    cos, sin = (torch.cat([angles, angles], -1).cos().to(device, torch.bfloat16),
                torch.cat([angles, angles], -1).sin().to(device, torch.bfloat16))
    weight = 1 + 0.1 * rand(64)
    cases = [("rms_norm", lambda o, x: o.rms_norm(x, weight, 1e-6), [rand(2, 8, 64)]),
             ("swiglu", lambda o, g, u: o.swiglu(g, u), [rand(16, 64), rand(16, 64)]),
             ("rope", lambda o, q, k: o.rope(q, k, cos, sin), [rand(2, 8, 4, 32).transpose(1, 2), rand(2, 8, 2, 32).transpose(1, 2)])]
    name = "setup"
    try:
        for name, op, inputs in cases:
            results = []
            for backend in (reference.TorchOps, ops):
                leaves = [x.detach().clone().requires_grad_() for x in inputs]
                out = op(backend, *leaves)
                outs = list(out) if isinstance(out, tuple) else [out]
                grads = torch.autograd.grad([o.float().square().sum() for o in outs], leaves)
                results.append([*outs, *grads])
            for expected, got in zip(*results):
                if _relative(expected, got) > 5e-2:
                    return f"{name} differs from the reference by {_relative(expected, got):.2e}"
        name = "logps_and_grad"
        logits, labels = rand(8, 300) * 3, torch.arange(8, device=device) * 37
        expected = reference.logps_and_grad(logits, labels)
        got = ops.logps_and_grad(logits.clone(), labels)
        if max(_relative(a, b) for a, b in zip(expected, got)) > 5e-2:
            return "logps_and_grad differs from the reference"
    except Exception as exc:  # a kernel that does not compile here: report it, never crash the run
        return f"{name}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return None


def _relative(expected: Any, got: Any) -> float:
    expected, got = expected.detach().float(), got.detach().float()
    return float((expected - got).abs().max() / expected.abs().max().clamp(min=1e-6))


def _liger_ops() -> Any:
    """liger-kernel's Triton ops behind our interface (the label log-prob gradient stays ours)."""
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    from liger_kernel.ops.rope import LigerRopeFunction
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction

    from toolkit.train.kernels.triton_ops import logps_and_grad as triton_logps_and_grad

    class LigerOps:
        name = "liger"

        @staticmethod
        def rms_norm(x: Any, weight: Any, eps: float) -> Any:
            # in_place=False: the residual stream still needs the incoming gradient after the norm's backward.
            return LigerRMSNormFunction.apply(x, weight, eps, 0.0, "llama", False)

        @staticmethod
        def swiglu(gate: Any, up: Any) -> Any:
            return LigerSiLUMulFunction.apply(gate, up)

        @staticmethod
        def rope(q: Any, k: Any, cos: Any, sin: Any) -> Any:
            return LigerRopeFunction.apply(q, k, cos, sin)

        logps_and_grad = staticmethod(triton_logps_and_grad)

    return LigerOps
