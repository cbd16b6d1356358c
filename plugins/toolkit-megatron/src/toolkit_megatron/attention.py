"""Core attention on torch SDPA for Megatron's layer spec: RoPE by position ids, packing, CP.

Plugged in as ``core_attention`` of Megatron's ``SelfAttention`` (the model is built with
``position_embedding_type="none"``, so RoPE happens here, from explicit position ids, with the
inverse frequencies Hugging Face computes for the checkpoint's rope type). The ``attention_mask``
argument Megatron threads through every layer carries, instead of a boolean mask, a long tensor
``[2, batch, tokens]`` of (position ids, sequence ids) for the whole (context-parallel-gathered)
sequence, or ``None`` for plain causal rows. Tokens attend causally within equal sequence ids
only, which isolates packed samples. On a GPU (``--megatron-packed-attention auto``, the default) packed
rows go through FlexAttention with the core's document ``BlockMask`` (built once per micro-batch and
shared by every layer), so no dense ``[b, 1, s, s]`` mask is made and masked blocks are skipped.

Context parallelism: the sequence is cut into ``2 * cp`` chunks and rank ``r`` holds chunks
``r`` and ``2cp - 1 - r`` (causal load balancing); each rank rotates its own keys, all-gathers
keys and values over the CP group and attends with an explicit mask built from token indices.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from toolkit_megatron.compat import cpu_compat


@dataclass(frozen=True)
class Rope:
    """RoPE as Hugging Face computes it: inverse frequencies, the cos/sin scaling and which dims rotate.

    ``inv_freq`` covers the first ``2 * len(inv_freq)`` dims of each head (partial rotary: the rest pass
    through); ``interleaved``: pairs are (0, 1), (2, 3)... (GLM) instead of the two halves (Llama).
    ``long_inv_freq`` (``longrope``): used instead when the micro-batch's largest position id plus one exceeds ``long_after``.
    """

    inv_freq: tuple[float, ...]
    scaling: float = 1.0
    interleaved: bool = False
    long_inv_freq: tuple[float, ...] | None = None
    long_after: int = 0

    @classmethod
    def from_hf_config(cls, hf_config: Any, interleaved: bool = False, layer_type: str | None = None) -> Rope:
        """``layer_type``: the RoPE of that layer type where ``rope_parameters`` is keyed by layer type (Gemma 3)."""
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        from toolkit.errors import ModelError
        from toolkit_megatron.architectures import rope_type_problem

        if problem := rope_type_problem(hf_config, layer_type):
            raise ModelError(problem)
        params = getattr(hf_config, "rope_parameters", None) or {}
        if layer_type is not None:
            params = params.get(layer_type) or {}
        by_layer = {"layer_type": layer_type} if layer_type is not None else {}
        rope_type = params.get("rope_type", "default")
        if rope_type == "default":
            base = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
            head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
            dim = int(head_dim * params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1.0)))
            inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
            return cls(tuple(inv_freq.tolist()), interleaved=interleaved)
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu", **by_layer)
        long = None
        if rope_type == "longrope":  # HF: the long factors once max(position_ids) + 1 > original_max_position_embeddings
            original = params["original_max_position_embeddings"]
            long = tuple(ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu", seq_len=original + 1, **by_layer)[0].float().tolist())
            return cls(tuple(inv_freq.float().tolist()), float(scaling), interleaved, long, original)
        return cls(tuple(inv_freq.float().tolist()), float(scaling), interleaved)


def load_balanced_indices(tokens: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Token indices context-parallel rank ``cp_rank`` holds: chunks ``r`` and ``2cp-1-r``."""
    if cp_size == 1:
        return torch.arange(tokens)
    chunk = tokens // (2 * cp_size)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk)
    second_start = (2 * cp_size - 1 - cp_rank) * chunk
    return torch.cat([first, torch.arange(second_start, second_start + chunk)])


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float,
               interleaved: bool = False) -> torch.Tensor:
    """Rotate ``x [s, b, h, d]`` by ``positions [b, s]``; cos/sin cast to ``x``'s dtype before multiplying, like HF.
    Only the first ``2 * len(inv_freq)`` dims rotate (partial rotary); ``interleaved``: GLM's pairing of dims."""
    freqs = positions.t()[..., None].float() * inv_freq
    if interleaved:
        emb = freqs.repeat_interleave(2, dim=-1)
    else:
        emb = torch.cat((freqs, freqs), dim=-1)
    cos = (emb.cos() * scaling).to(x.dtype)[:, :, None, :]
    sin = (emb.sin() * scaling).to(x.dtype)[:, :, None, :]
    rotary = emb.shape[-1]
    rot, rest = (x, None) if rotary == x.shape[-1] else (x[..., :rotary], x[..., rotary:])
    if interleaved:
        turned = torch.stack((-rot[..., 1::2], rot[..., 0::2]), dim=-1).flatten(-2)
    else:
        turned = _rotate_half(rot)
    out = rot * cos + turned * sin
    return out if rest is None else torch.cat([out, rest], dim=-1)


_compiled_rope: Any = None


def compiled_apply_rope() -> Any:
    global _compiled_rope
    if _compiled_rope is None:
        _compiled_rope = torch.compile(apply_rope, dynamic=False)
    return _compiled_rope


class _AllGatherSeq(torch.autograd.Function):
    """All-gather along dim 0 over a group; backward sums the gradient and keeps this rank's slice."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        ctx.rank = torch.distributed.get_rank(group)
        ctx.size = tensor.shape[0]
        parts = [torch.empty_like(tensor) for _ in range(torch.distributed.get_world_size(group))]
        torch.distributed.all_gather(parts, tensor.contiguous(), group=group)
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad[ctx.rank * ctx.size:(ctx.rank + 1) * ctx.size], None


class SDPAAttention(torch.nn.Module):
    """Megatron ``core_attention`` on ``torch.nn.functional.scaled_dot_product_attention``."""

    def __init__(self, config: Any, layer_number: int, attn_mask_type: Any, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection: Any = None, rope: Rope | None = None,
                 sliding_window: int | None = None, compiled_rope: bool = False, packed_flex: bool = False,
                 softcap: float | None = None, k_channels: int | None = None, v_channels: int | None = None):
        super().__init__()  # k_channels / v_channels (MLA's head sizes) are read off the tensors
        from megatron.core import parallel_state

        self.config = config
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
        self.rope = rope
        self.rope_fn = compiled_apply_rope() if compiled_rope else apply_rope
        self.sliding_window = sliding_window
        self.packed_flex = packed_flex
        self.softcap = softcap
        self.register_buffer("inv_freq", torch.tensor(rope.inv_freq, dtype=torch.float32) if rope else None,
                             persistent=False)
        self.register_buffer("long_inv_freq", torch.tensor(rope.long_inv_freq, dtype=torch.float32)
                             if rope and rope.long_inv_freq else None, persistent=False)
        self.cp_size = config.context_parallel_size
        self.cp_group = parallel_state.get_context_parallel_group() if self.cp_size > 1 else None
        self.cp_rank = parallel_state.get_context_parallel_rank() if self.cp_size > 1 else 0

    def _rotate(self, x: torch.Tensor, positions: torch.Tensor, longest: int) -> torch.Tensor:
        """``longest``: the largest position id of the micro-batch plus one (HF's ``longrope`` switch)."""
        inv_freq = self.inv_freq
        if self.long_inv_freq is not None and longest > self.rope.long_after:
            inv_freq = self.long_inv_freq
        return self.rope_fn(x, positions, inv_freq.to(x.device), self.rope.scaling, self.rope.interleaved)

    def _mask(self, index_q: torch.Tensor, index_k: torch.Tensor, meta: torch.Tensor | None) -> torch.Tensor:
        """Boolean ``[b, 1, sq, sk]`` mask: causal by token index within equal sequence ids."""
        allowed = index_k[None, :] <= index_q[:, None]
        if meta is None:
            mask = allowed[None, None]
        else:
            seq = meta[1]
            seq_q, seq_k = seq[:, index_q], seq[:, index_k]
            same = (seq_q[:, :, None] == seq_k[:, None, :]) & (seq_q[:, :, None] >= 0)
            diagonal = index_q[:, None] == index_k[None, :]  # padding attends to itself only: no NaN rows
            mask = ((same & allowed[None]) | diagonal[None])[:, None]
        if self.sliding_window:
            mask = mask & ((index_q[:, None] - index_k[None, :]) < self.sliding_window)[None, None]
        return mask

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                attn_mask_type: Any = None, attention_bias: Any = None, packed_seq_params: Any = None) -> torch.Tensor:
        if packed_seq_params is not None or attention_bias is not None:
            raise NotImplementedError("SDPAAttention takes packing through sequence ids, not packed_seq_params")
        with cpu_compat():
            return self._forward(query, key, value, attention_mask)

    def _forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, meta: torch.Tensor | None) -> torch.Tensor:
        local, batch = query.shape[0], query.shape[1]
        total = local * self.cp_size
        index_q = load_balanced_indices(total, self.cp_size, self.cp_rank).to(query.device)
        positions = meta[0][:, index_q] if meta is not None else index_q[None].expand(batch, -1)
        if self.rope is not None:
            longest = int(meta[0].max()) + 1 if self.long_inv_freq is not None and meta is not None else total
            query, key = self._rotate(query, positions, longest), self._rotate(key, positions, longest)
        index_k = index_q
        if self.cp_size > 1:
            key = _AllGatherSeq.apply(key, self.cp_group)
            value = _AllGatherSeq.apply(value, self.cp_group)
            index_k = torch.cat([load_balanced_indices(total, self.cp_size, r) for r in range(self.cp_size)]).to(query.device)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, h, s, d]
        dropout = self.dropout if self.training else 0.0
        gqa = q.shape[1] != k.shape[1]
        if self.packed_flex and not dropout and (self.softcap or self.sliding_window):
            out = flex_masked_attention(q, k, v, index_q, index_k, meta, self.sliding_window, self.scale, self.softcap,
                                        self.cp_rank)
        elif self.softcap:
            out = softcapped_attention(q, k, v, self._mask(index_q, index_k, meta), self.scale, self.softcap, dropout)
        elif meta is None and self.cp_size == 1 and not self.sliding_window:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout, scale=self.scale, enable_gqa=gqa)
        elif self.packed_flex and self.cp_size == 1 and not self.sliding_window and not dropout:
            from toolkit.train.attention import _flex_kernel

            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
            out = _flex_kernel(q.device.type)(q, k, v, block_mask=document_mask(meta), scale=self.scale, enable_gqa=gqa)
        else:
            mask = self._mask(index_q, index_k, meta)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=self.scale, enable_gqa=gqa)
        return out.permute(2, 0, 1, 3).reshape(local, batch, -1)


def softcapped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float, cap: float,
                         dropout: float = 0.0) -> torch.Tensor:
    """Attention with logit soft-capping, as HF's eager Gemma 2 attention computes it: scores ``q k^T * scale`` capped
    to ``cap * tanh(scores / cap)``, then masked (``mask [b, 1, sq, sk]``, True where allowed) and softmaxed in fp32.
    SDPA has no score hook, so the ``[b, h, sq, sk]`` scores exist (``q, k, v``: ``[b, h, s, d]``)."""
    if q.shape[1] != k.shape[1]:  # GQA: each key/value head serves consecutive query heads (HF's repeat_kv)
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / cap) * cap
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    probs = F.dropout(probs, p=dropout, training=dropout > 0)
    return torch.matmul(probs, v)


def flex_masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index_q: torch.Tensor,
                          index_k: torch.Tensor, meta: torch.Tensor | None, window: int | None, scale: float,
                          cap: float | None = None, cp_rank: int = 0) -> torch.Tensor:
    """Attention through FlexAttention (the GPU path) for what SDPA's kernels cannot do without a dense mask: the
    mask of :meth:`SDPAAttention._mask` (causal by token index, packed sequences, a sliding window, CP's token
    order) as a ``BlockMask`` made once per micro-batch and layer type, so fully masked blocks are skipped and no
    ``[b, 1, sq, sk]`` mask is kept; ``cap``: the attention logit soft-capping (:func:`softcapped_attention`) as a
    ``score_mod``, so no ``[b, h, sq, sk]`` scores are kept either."""
    from toolkit.train.attention import _flex_kernel

    block_mask = _flex_block_mask(index_q, index_k, meta, window, cp_rank)
    heads, kv_heads = q.shape[1], k.shape[1]
    if heads != kv_heads and heads & (heads - 1):  # as HF does: the GQA kernels want a power-of-two head count
        k = k.repeat_interleave(heads // kv_heads, dim=1)
        v = v.repeat_interleave(heads // kv_heads, dim=1)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    return _flex_kernel(q.device.type)(q, k, v, score_mod=_softcap_score_mod(cap) if cap else None, block_mask=block_mask,
                                       scale=scale, enable_gqa=k.shape[1] != heads)


@functools.cache
def _softcap_score_mod(cap: float) -> Any:
    """One ``score_mod`` function per cap, so the compiled FlexAttention sees the same object on every call."""

    def capped(score: torch.Tensor, batch: Any, head: Any, query: Any, key: Any) -> torch.Tensor:
        return torch.tanh(score / cap) * cap

    return capped


_FLEX_MASKS: dict[tuple, tuple[Any, Any]] = {}
"""(window, query and key lengths, CP rank, device) -> (weak reference to the micro-batch's meta tensor or None, its
BlockMask): the mask is made once per micro-batch and layer type, not per layer."""


def _flex_block_mask(index_q: torch.Tensor, index_k: torch.Tensor, meta: torch.Tensor | None, window: int | None,
                     cp_rank: int) -> Any:
    import weakref

    from torch.nn.attention.flex_attention import create_block_mask

    cache_key = (window, len(index_q), len(index_k), cp_rank, str(index_q.device))
    cached = _FLEX_MASKS.get(cache_key)
    if cached is not None and (cached[0] is None if meta is None else cached[0] is not None and cached[0]() is meta):
        return cached[1]
    sequence = meta[1] if meta is not None else None

    def allowed(batch: Any, head: Any, query: Any, key: Any) -> Any:
        at_q, at_k = index_q[query], index_k[key]
        mask = at_k <= at_q
        if sequence is not None:
            own = sequence[batch, at_q]
            mask = (mask & (own == sequence[batch, at_k]) & (own >= 0)) | (at_q == at_k)
        if window:
            mask = mask & (at_q - at_k < window)
        return mask

    rows = sequence.shape[0] if sequence is not None else None
    block_mask = create_block_mask(allowed, rows, None, len(index_q), len(index_k), device=index_q.device,
                                   _compile=index_q.device.type == "cuda")
    if len(_FLEX_MASKS) > 8:  # micro-batches of other lengths: keep only the current ones
        _FLEX_MASKS.clear()
    _FLEX_MASKS[cache_key] = (weakref.ref(meta) if meta is not None else None, block_mask)
    return block_mask


_DOCUMENT_MASK: tuple[Any, Any] | None = None
"""(weak reference to the meta tensor of the micro-batch being run, its BlockMask): one mask per forward, not per layer."""


def document_mask(meta: torch.Tensor) -> Any:
    """The FlexAttention ``BlockMask`` of ``meta``'s sequence ids (:func:`toolkit.train.attention.document_block_mask`),
    made once for the tensor every layer of one forward receives (a weak reference: a later micro-batch's
    tensor at the same address is another object, so it never reuses a stale mask)."""
    import weakref

    from toolkit.train.attention import document_block_mask

    global _DOCUMENT_MASK
    if _DOCUMENT_MASK is None or _DOCUMENT_MASK[0]() is not meta:
        _DOCUMENT_MASK = (weakref.ref(meta), document_block_mask(meta[1]))
    return _DOCUMENT_MASK[1]


class LocalAttention(SDPAAttention):
    """Megatron's unfused local attention kernel (baseline/fallback) behind the same RoPE and masks."""

    def __init__(self, config: Any, layer_number: int, attn_mask_type: Any, attention_type: str, **kwargs: Any):
        super().__init__(config, layer_number, attn_mask_type, attention_type, **kwargs)
        from megatron.core.transformer.dot_product_attention import DotProductAttention

        if self.cp_size > 1:
            raise NotImplementedError("the local attention kernel has no context parallelism; use attention=sdpa")
        if self.softcap:
            from toolkit.errors import ConfigError

            raise ConfigError("--megatron-attention local has no attention logit soft-capping (Gemma 2's "
                              "attn_logit_softcapping): use --megatron-attention sdpa")
        self.kernel = DotProductAttention(config, layer_number, attn_mask_type, attention_type,
                                          attention_dropout=kwargs.get("attention_dropout"),
                                          softmax_scale=kwargs.get("softmax_scale"))

    def _forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, meta: torch.Tensor | None) -> torch.Tensor:
        local, batch = query.shape[0], query.shape[1]
        index = torch.arange(local, device=query.device)
        positions = meta[0] if meta is not None else index[None].expand(batch, -1)
        if self.rope is not None:
            longest = int(positions.max()) + 1 if self.long_inv_freq is not None else local
            query, key = self._rotate(query, positions, longest), self._rotate(key, positions, longest)
        blocked = ~self._mask(index, index, meta).expand(batch, 1, local, local)  # Megatron masks where True
        return self.kernel(query, key, value, blocked)
