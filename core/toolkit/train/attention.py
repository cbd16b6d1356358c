"""Attention for packed rows: the document (block-causal) mask as a FlexAttention ``BlockMask``, and the HF
attention implementation that runs it beside plain SDPA.

A packed row holds several samples; attention stays within one sample (equal ``sequence_ids``) and is
causal there. Masked SDPA takes that as a dense ``[B, 1, T, T]`` boolean mask, which keeps torch off its
flash/cuDNN kernels; FlexAttention takes it as a ``BlockMask`` and skips the blocks nobody attends to.
Models built with ``attn_implementation="sdpa"`` are switched to :data:`ATTENTION_NAME`, which sends a
``BlockMask`` to ``flex_attention`` and anything else (``None`` for plain rows, a dense mask) to HF's own
SDPA forward, so plain rows keep ``is_causal`` SDPA.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from toolkit.models import softcaps_attention

ATTENTION_NAME = "toolkit_sdpa_flex"
"""The name registered in HF's ``AttentionInterface`` / ``AttentionMaskInterface``."""
CHOICES = ("auto", "flex", "sdpa-mask")


def flex_missing() -> str | None:
    """Why this torch cannot run FlexAttention; ``None`` when it can."""
    try:
        from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention  # noqa: F401
    except ImportError as exc:
        return f"torch {torch.__version__} has no FlexAttention ({exc}); it needs torch >= 2.5"
    return None


def flex_backward_refused(device: torch.device) -> bool:
    """Whether torch refuses FlexAttention's backward on ``device`` (torch 2.13: CPU and MPS).

    Asks torch's own input check, so a torch that learns CPU backward is used without a change here.
    """
    from torch.nn.attention import flex_attention as module

    check = getattr(module, "_validate_device", None)
    if check is None:
        return False
    probe = torch.zeros(1, 1, 1, 16, device=device, requires_grad=True)
    try:
        check(probe, probe, probe)
    except NotImplementedError:
        return True
    return False


def flex_problems(model: Any, device: torch.device) -> list[str]:
    """What keeps ``model`` on ``device`` from training packed rows through FlexAttention (empty: nothing)."""
    missing = flex_missing()
    if missing:
        return [missing]
    problems = []
    config = getattr(model, "config", None)
    implementation = getattr(config, "_attn_implementation", None)
    # eager only for the soft cap (toolkit.models.attention_kwargs): FlexAttention applies the cap too
    if implementation not in ("sdpa", ATTENTION_NAME) and not (implementation == "eager" and softcaps_attention(config)):
        problems.append(f"the model runs attn_implementation {implementation!r}; FlexAttention replaces sdpa only")
    elif hasattr(model, "_can_set_attn_implementation") and not model._can_set_attn_implementation():
        problems.append(f"{type(model).__name__} does not dispatch attention through HF's AttentionInterface")
    if float(getattr(config, "attention_dropout", 0.0) or 0.0) > 0:
        problems.append(f"attention_dropout {config.attention_dropout} is set; FlexAttention has no dropout")
    if flex_backward_refused(device):
        problems.append(f"torch {torch.__version__} has no FlexAttention backward on {device.type}")
    return problems


def resolve_packed_attention(choice: str, model: Any, device: torch.device, flag: str) -> str:
    """``flex`` or ``sdpa-mask`` for ``--<strategy>-packed-attention``; ``model`` is the unwrapped HF model.

    ``auto``: ``flex`` on a CUDA device when nothing stands in the way, else ``sdpa-mask`` (CPU runs stay on
    the masked SDPA path they always took). An explicit ``flex`` that cannot run is an error naming why.
    """
    from toolkit.errors import ConfigError

    if choice not in CHOICES:
        raise ConfigError([f"{flag} {choice!r}: expected one of {', '.join(CHOICES)}"], source=flag)
    if choice == "sdpa-mask":
        return choice
    if choice == "auto" and getattr(device, "type", str(device)) != "cuda":
        return "sdpa-mask"
    problems = flex_problems(model, device)
    if not problems:
        return "flex"
    if choice == "auto":
        return "sdpa-mask"
    raise ConfigError([f"{flag} flex: {p}" for p in problems]
                      + [f"use {flag} sdpa-mask (dense block-causal mask) or auto"], source=flag)


def apply_packed_attention(choice: str, model: Any, device: torch.device, flag: str) -> str:
    """Resolve ``--<strategy>-packed-attention`` for ``model`` (wrappers allowed) and switch it to
    :data:`ATTENTION_NAME` when the answer is ``flex``; returns ``flex`` or ``sdpa-mask``."""
    from toolkit.train.logps import unwrap

    inner = unwrap(model)
    resolved = resolve_packed_attention(choice, inner, device, flag)
    if resolved == "flex":
        use_flex(inner)
    return resolved


def use_flex(model: Any) -> None:
    """Register :data:`ATTENTION_NAME` with HF and switch ``model`` (the unwrapped HF model) to it; a model that
    soft-caps its scores (loaded eager for that) to transformers' ``flex_attention`` instead: plain rows get
    transformers' own causal (and windowed) ``BlockMask``, packed rows the document one, and every score the cap."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if softcaps_attention(model.config):
        if model.config._attn_implementation != "flex_attention":
            model.set_attn_implementation("flex_attention")
        return
    AttentionInterface.register(ATTENTION_NAME, attention_forward)
    # plain rows pass no mask: sdpa's mask function answers None, so they keep is_causal SDPA
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
    if model.config._attn_implementation != ATTENTION_NAME:
        model.set_attn_implementation(ATTENTION_NAME)


def document_block_mask(sequence_ids: torch.Tensor, window: int | None = None) -> Any:
    """The block-causal ``BlockMask`` ``[B, 1, T, T]`` of packed rows: same sequence, causal, not padding, and
    with ``window`` only the keys less than ``window`` positions back (transformers' sliding window).

    Padding (-1) attends to itself only, so no row of the softmax is empty; the same pattern as the dense
    mask of :func:`toolkit.train.logps.attention_mask_for`.
    """
    from torch.nn.attention.flex_attention import create_block_mask

    def document_causal(batch: Any, head: Any, query: Any, key: Any) -> Any:
        own = sequence_ids[batch, query]
        allowed = (own == sequence_ids[batch, key]) & (query >= key) & (own >= 0)
        if window:
            allowed = allowed & (query - key < window)
        return allowed | (query == key)

    rows, length = sequence_ids.shape
    # compiled on a GPU: built block by block instead of materialising the T x T pattern once
    return create_block_mask(document_causal, rows, None, length, length, device=sequence_ids.device,
                             _compile=sequence_ids.device.type == "cuda")


@functools.cache
def _compiled_flex() -> Any:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


def _flex_kernel(device_type: str) -> Any:
    """``flex_attention`` compiled once on a GPU (eager it is an unfused reference); as is inside a compiled region."""
    from torch.nn.attention.flex_attention import flex_attention

    if device_type != "cuda" or torch.compiler.is_compiling():
        return flex_attention
    return _compiled_flex()


def attention_forward(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                      scaling: float | None = None, dropout: float = 0.0, **kwargs: Any) -> tuple[torch.Tensor, Any]:
    """HF attention interface: a ``BlockMask`` goes to FlexAttention, anything else to HF's SDPA forward."""
    from torch.nn.attention.flex_attention import BlockMask

    if not isinstance(attention_mask, BlockMask):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    if dropout:
        from toolkit.errors import ModelError

        raise ModelError(f"attention dropout {dropout} under FlexAttention: it has none; use --local-packed-attention sdpa-mask")
    if any(kwargs.get(name) is not None for name in ("softcap", "s_aux", "position_bias")):
        from transformers.integrations.flex_attention import flex_attention_forward

        return flex_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    heads, kv_heads = query.shape[1], key.shape[1]
    if heads != kv_heads and heads & (heads - 1):  # as HF does: the GQA kernels want a power-of-two head count
        key = key.repeat_interleave(heads // kv_heads, dim=1)
        value = value.repeat_interleave(heads // kv_heads, dim=1)
    output = _flex_kernel(query.device.type)(query, key, value, block_mask=attention_mask, scale=scaling,
                                             enable_gqa=key.shape[1] != heads)
    return output.transpose(1, 2).contiguous(), None
