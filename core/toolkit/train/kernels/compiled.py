"""Small elementwise/reduction functions compiled into one fused kernel on CUDA, eager elsewhere.

Used where eager PyTorch would materialise fp32 copies of large tensors (the vocabulary head's
logits, MoE activations). ``TOOLKIT_COMPILE=0`` keeps everything eager; a compilation that fails
falls back to eager for good, with one warning.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import Any

_COMPILED: dict[str, Callable[..., Any]] = {}


def fused(name: str, fn: Callable[..., Any], device: Any) -> Callable[..., Any]:
    """``fn`` compiled (``torch.compile``, dynamic shapes) when ``device`` is CUDA; ``fn`` itself otherwise."""
    if getattr(device, "type", device) != "cuda" or os.environ.get("TOOLKIT_COMPILE", "1") == "0":
        return fn
    if name not in _COMPILED:
        import torch

        compiled = torch.compile(fn, dynamic=True)

        def first_call(*args: Any) -> Any:  # compilation is lazy: guard the first call
            try:
                out = compiled(*args)
                _COMPILED[name] = compiled
            except Exception as exc:  # noqa: BLE001 - compilation is an optimisation only
                warnings.warn(f"toolkit: torch.compile of {name} failed ({type(exc).__name__}: {exc}); using eager ops",
                              stacklevel=2)
                _COMPILED[name] = fn
                out = fn(*args)
            return out

        _COMPILED[name] = first_call
    return _COMPILED[name]
