"""The ``local`` engine's speed options applied to a built HF model: kernels, compile, fp8, SDPA choice.

What the engine calls at build time (:func:`apply_speed_options`) and per forward
(:func:`fused_head_ops`, :func:`sdpa_preference`); the kernels and patches themselves live in
:mod:`toolkit.train.kernels`.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any


def apply_speed_options(model: Any, config: Any, device: Any) -> tuple[Any, bool]:
    """Apply ``--local-fp8``, ``--local-kernels`` and ``--local-compile`` to a built model, saying what changed.

    Returns the kernel ops (``None``: none requested) and whether compilation is still to happen.
    """
    from toolkit.errors import ConfigError

    def say(message: str) -> None:
        print(f"toolkit: {message}", file=sys.stderr)

    if not (config.fp8 or config.compile or config.kernels != "none"):
        return None, False
    from toolkit.train.kernels import load_ops, patch

    if config.fp8:
        problem = patch.fp8_problem(device)
        if problem:
            raise ConfigError([problem], source="--local-fp8")
        say(f"--local-fp8: {patch.convert_to_float8(model)} linear layers train in float8 (torchao)")
    ops = load_ops(config.kernels)
    family = patch.model_family(model)
    if ops is not None and config.kernels == "auto" and family not in patch.FAMILIES:
        # the default must not refuse a model: other families keep HF's modules; the ops still serve the fused loss
        say(f"--local-kernels auto: no fused kernels for the {family!r} family; its HF modules stay")
    elif ops is not None and not config.compile:
        counts = patch.apply_kernels(model, ops)
        say(f"--local-kernels {ops.name}: {counts['rms_norm']} RMSNorm, {counts['mlp']} MLP and "
            f"{counts['rope']} RoPE site(s) fused")
    elif ops is not None:
        say(f"--local-kernels {ops.name}: the compiler fuses the decoder layers itself; the kernels serve the fused loss only")
    if config.compile:
        say(f"--local-compile: {patch.compile_decoder_layers(model)} decoder layers compile at the first step")
    return ops, config.compile


def resolve_fused_loss(choice: Any, device: Any) -> bool:
    """``--local-fused-loss``: true/false as given; ``auto`` is on for a CUDA device only, so the CPU path
    (tests, the planner's CPU allocator checks) stays the chunked one."""
    if choice == "auto":
        return getattr(device, "type", str(device)) == "cuda"
    return bool(choice)


def report_levers(config: Any, kernel_ops: Any, fused_loss: bool, loss: Any, packed_attention: str = "sdpa-mask") -> None:
    """One stderr line naming the speed levers that are on (nothing when none is, as on CPU by default)."""
    on = []
    if kernel_ops is not None:
        on.append(f"kernels {kernel_ops.name}" + (" (auto)" if config.kernels == "auto" else ""))
    if fused_loss:
        name = loss.name
        how = " (auto)" if config.fused_loss == "auto" else ""
        on.append(f"fused loss{how}" if declares_uniform_gradient(loss)
                  else f"fused loss{how} unused: the {name} loss does not give every token the same gradient")
    on += [flag for flag, active in (("compile", config.compile), ("fp8", config.fp8)) if active]
    if config.attention != "auto":
        on.append(f"attention {config.attention} first")
    if packed_attention == "flex":
        on.append("packed rows through FlexAttention" + (" (auto)" if config.packed_attention == "auto" else "")
                  + " (the first step compiles its kernels: a minute or more)")
    if on:
        off = [flag for flag, active in (("--local-compile", config.compile), ("--local-fp8", config.fp8)) if not active]
        print(f"toolkit: local engine speed levers: {', '.join(on)}" + (f"; off: {', '.join(off)}" if off else "")
              + " (--local-kernels none --no-local-fused-loss: HF's modules and the chunked loss)", file=sys.stderr)


def declares_uniform_gradient(loss: Any) -> bool:
    """Whether the class whose ``__call__`` computes ``loss`` (an instance or a loss class) declares
    ``uniform_token_gradient``.

    Read from that class itself, so a subclass of ``sft`` that re-weights tokens in its own
    ``__call__`` does not inherit the promise.
    """
    for cls in (loss if isinstance(loss, type) else type(loss)).__mro__:
        if "__call__" in vars(cls):
            return bool(vars(cls).get("uniform_token_gradient", False))
    return False


def sdpa_preference(choice: str) -> Any:
    """A context preferring one torch SDPA kernel (``auto``: none); the backward pass follows the forward's kernel."""
    if choice == "auto":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    first = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
             "efficient": SDPBackend.EFFICIENT_ATTENTION}[choice]
    order = [first] + [b for b in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                                   SDPBackend.MATH) if b != first]
    try:
        return sdpa_kernel(order, set_priority=True)
    except TypeError:  # torch without priorities: allow only the chosen kernel and the math fallback
        return sdpa_kernel([first, SDPBackend.MATH])


def fused_head_ops(loss: Any, kernel_ops: Any) -> Any:
    """The ops for the fused head when ``loss`` declares a uniform token gradient, else ``None``."""
    if not declares_uniform_gradient(loss):
        return None
    if kernel_ops is not None:
        return kernel_ops
    from toolkit.train.kernels.reference import TorchOps

    return TorchOps
