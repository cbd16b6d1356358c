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


def load_ops(backend: str) -> Any:
    """The ops object for ``backend`` (``none`` -> ``None``); falls back to ``torch`` with a message.

    ``auto`` picks ``triton`` on a CUDA device with Triton, else ``none`` (HF's own modules).
    """
    from toolkit.errors import ConfigError

    if backend not in BACKENDS:
        raise ConfigError([f"kernels {backend!r} is not one of {', '.join(BACKENDS)}"], source="--local-kernels")
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
                return _liger_ops()
            except ImportError as exc:
                reason = f"liger-kernel is not installed ({exc}); pip install liger-kernel"
        _say(f"--local-kernels liger unavailable: {reason}; using the torch reference ops")
        from toolkit.train.kernels.reference import TorchOps

        return TorchOps
    reason = triton_available()
    if reason is not None:
        _say(f"--local-kernels triton unavailable: {reason}; using the torch reference ops")
        from toolkit.train.kernels.reference import TorchOps

        return TorchOps
    return _triton_ops()


def _triton_ops() -> Any:
    from toolkit.train.kernels.triton_ops import TritonOps

    return TritonOps


def _liger_ops() -> Any:
    """liger-kernel's Triton ops behind our interface (the label log-prob gradient stays ours)."""
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction
    from liger_kernel.transformers.rope import liger_rotary_pos_emb

    from toolkit.train.kernels.triton_ops import logps_and_grad

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
            return liger_rotary_pos_emb(q, k, cos, sin)

        logps_and_grad = staticmethod(logps_and_grad)

    return LigerOps
