"""Put fused ops, ``torch.compile`` and float8 linears into a built HF decoder (llama, mistral, qwen2, qwen3).

The patches swap the class of each RMSNorm and MLP instance for a subclass whose ``forward``
calls the chosen ops (parameters, names and state dicts stay the same, so tuners, checkpoints and
exports see the HF model), and route the modeling module's ``apply_rotary_pos_emb`` through the
ops. Each returns what it changed so callers can say so.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

import torch
from torch import nn

from toolkit.train.logps import decoder_layers

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
COMPILE_BACKEND = "inductor"
"""What ``compile_decoder_layers`` compiles with (tests on CPU use ``aot_eager``: no C++ toolchain)."""


class _FusedRMSNorm:
    """Mixin over an HF RMSNorm class: ``forward`` through ``self.toolkit_ops``."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.toolkit_ops.rms_norm(hidden_states, self.weight, self.variance_epsilon)


class _FusedMLP:
    """Mixin over an HF gated MLP class (gate/up/down projections, SiLU): the activation product fused."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.toolkit_ops.swiglu(self.gate_proj(x), self.up_proj(x)))


@functools.cache
def _subclass(mixin: type, cls: type) -> type:
    return type(f"Fused{cls.__name__}", (mixin, cls), {"__module__": cls.__module__})


class _RopeDispatch:
    """Replaces ``apply_rotary_pos_emb`` in an HF modeling module; unusual calls go to the original."""

    def __init__(self, original: Any, ops: Any):
        self.original, self.ops = original, ops

    def __call__(self, q: Any, k: Any, cos: Any, sin: Any, *args: Any, **kwargs: Any) -> Any:
        # the signature differs between transformers versions (position_ids came and went): only the
        # plain four-argument call, with the default unsqueeze_dim=1, is ours
        if args or any(key != "unsqueeze_dim" or value != 1 for key, value in kwargs.items()):
            return self.original(q, k, cos, sin, *args, **kwargs)
        return self.ops.rope(q, k, cos, sin)


def _is_rms_norm(module: nn.Module) -> bool:
    return (type(module).__name__.endswith("RMSNorm") and isinstance(getattr(module, "weight", None), torch.Tensor)
            and hasattr(module, "variance_epsilon") and type(module).forward is not _FusedRMSNorm.forward)


def _is_gated_mlp(module: nn.Module, config: Any) -> bool:
    return (all(isinstance(getattr(module, name, None), nn.Module) for name in ("gate_proj", "up_proj", "down_proj"))
            and getattr(config, "hidden_act", None) in ("silu", "swish") and not isinstance(module, _FusedMLP))


def _inner(model: nn.Module) -> nn.Module:
    from toolkit.train.logps import unwrap

    return unwrap(model)


def model_family(model: nn.Module) -> str:
    """The HF ``model_type`` of ``model`` under DDP/PEFT wrappers (``?`` when it has none)."""
    return getattr(getattr(_inner(model), "config", None), "model_type", "?")


def apply_kernels(model: nn.Module, ops: Any) -> dict[str, int]:
    """Route RMSNorm, SwiGLU and RoPE of ``model`` through ``ops``; counts of what was patched.

    Raises :class:`~toolkit.errors.ModelError` for a model family outside :data:`FAMILIES`.
    """
    from toolkit.errors import ModelError

    inner = _inner(model)
    family = model_family(model)
    if family not in FAMILIES:
        raise ModelError(f"--local-kernels supports the {', '.join(FAMILIES)} model families; this model is {family!r}. "
                         "Use --local-kernels none or auto (auto keeps HF's modules for other families).")
    counts = {"rms_norm": 0, "mlp": 0, "rope": 0}
    for module in inner.modules():
        if _is_rms_norm(module):
            module.__class__ = _subclass(_FusedRMSNorm, type(module))
            counts["rms_norm"] += 1
        elif _is_gated_mlp(module, inner.config):
            module.__class__ = _subclass(_FusedMLP, type(module))
            counts["mlp"] += 1
        else:
            continue
        module.toolkit_ops = ops
    modeling = {sys.modules[type(m).__module__] for m in inner.modules() if type(m).__name__.endswith("Attention")}
    for module in modeling:
        current = getattr(module, "apply_rotary_pos_emb", None)
        if current is None:
            continue
        original = current.original if isinstance(current, _RopeDispatch) else current
        module.apply_rotary_pos_emb = _RopeDispatch(original, ops)
        counts["rope"] += 1
    return counts


def restore_rope() -> None:
    """Undo the ``apply_rotary_pos_emb`` routing in every modeling module (tests; a later HF baseline)."""
    for module in list(sys.modules.values()):
        current = getattr(module, "apply_rotary_pos_emb", None)
        if isinstance(current, _RopeDispatch):
            module.apply_rotary_pos_emb = current.original


def compile_decoder_layers(model: nn.Module) -> int:
    """``torch.compile`` each decoder layer in place (static shapes); returns how many.

    Compilation happens at the first forward; :func:`compile_failed_message` words a failure there.
    """
    import torch._dynamo

    layers = decoder_layers(model)
    # identical layers share one compiled graph; the limit only guards against recompiling per layer
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 2 * len(layers))
    for layer in layers:
        layer.compile(backend=COMPILE_BACKEND, dynamic=False)
    return len(layers)


def compile_failed_message(exc: BaseException) -> str:
    return (f"torch.compile of the decoder layers failed ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
            "run without --local-compile (the eager model is the same computation)")


def uncompile_decoder_layers(model: nn.Module) -> None:
    """Back to eager forwards after a compile failure (``nn.Module.compile`` keeps the original)."""
    for layer in decoder_layers(model):
        if getattr(layer, "_compiled_call_impl", None) is not None:
            layer._compiled_call_impl = None


def fp8_problem(device: torch.device) -> str | None:
    """``None`` when float8 training can run here, else what is missing."""
    if device.type != "cuda":
        return "float8 training needs a CUDA GPU (Hopper, compute capability 8.9 or newer); this run is on CPU"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        return f"float8 training needs compute capability 8.9 or newer (Ada/Hopper); {torch.cuda.get_device_name(device)} is {major}.{minor}"
    try:
        import torchao.float8  # noqa: F401
    except ImportError as exc:
        return f"torchao is not installed ({exc}): pip install torchao (a version matching torch {torch.__version__})"
    return None


def convert_to_float8(model: nn.Module) -> int:
    """Swap the decoder's ``nn.Linear`` layers (not the output head) for torchao ``Float8Linear`` (dynamic
    tensorwise scaling); returns how many. Dimensions must be multiples of 16 for the fp8 GEMMs."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    decoder = _inner(model).get_decoder()
    converted = []

    def keep(module: nn.Module, name: str) -> bool:
        ok = isinstance(module, nn.Linear) and module.in_features % 16 == 0 and module.out_features % 16 == 0
        if ok:
            converted.append(name)
        return ok

    convert_to_float8_training(decoder, config=Float8LinearConfig(), module_filter_fn=keep)
    return len(converted)
