"""Label log-probs at the last pipeline stage, vocabulary-parallel, handed to the core's Loss.

Each tensor-parallel rank holds logits for ``V/tp`` vocabulary entries; the log-softmax
normaliser and the label's logit are reduced over the TP group (Megatron's
``reduce_from_tensor_model_parallel_region``: all-reduce forward, identity backward), so the
full-vocabulary logits never exist on one rank. Padded vocabulary rows are masked out. The
default kernel never makes a full-size fp32 copy of the logits (:class:`VocabParallelLogps`). With the
fused head (:mod:`toolkit_megatron.fused_head`) the model hands over its final hidden states instead
and no logits exist beyond one chunk of tokens.
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from toolkit.contracts import IGNORE_INDEX, StepContext, TokenLogps

LogpsKernel = Literal["chunked", "compiled", "reference"]
CHUNK_TOKENS = 1024
"""Tokens per chunk of the fused log-probs: one fp32 ``[chunk, V/tp]`` temporary at a time."""


def vocab_parallel_logps(logits: torch.Tensor, labels: torch.Tensor, real_vocab: int,
                         kernel: LogpsKernel = "chunked") -> torch.Tensor:
    """``log p(labels)`` in fp32 from this rank's logits shard ``[B, T, V/tp]`` (labels >= 0).

    ``chunked``: :class:`VocabParallelLogps` (fp32 math a chunk of tokens at a time, the logits
    kept in their own dtype for backward); ``compiled``: the same with its two chunk kernels
    under ``torch.compile``; ``reference``: plain autograd over fp32 logits (several full-size
    fp32 temporaries; what the engine did first, kept to measure against).
    """
    if kernel == "reference":
        return _reference_logps(logits, labels, real_vocab)
    from megatron.core import parallel_state as ps

    shard = logits.shape[-1]
    start = ps.get_tensor_model_parallel_rank() * shard
    group = ps.get_tensor_model_parallel_group() if ps.get_tensor_model_parallel_world_size() > 1 else None
    flat = VocabParallelLogps.apply(logits.reshape(-1, shard), labels.reshape(-1), start, real_vocab, group,
                                    kernel == "compiled")
    return flat.view(labels.shape)


def _reference_logps(logits: torch.Tensor, labels: torch.Tensor, real_vocab: int) -> torch.Tensor:
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    logits = logits.float()
    shard = logits.shape[-1]
    start = ps.get_tensor_model_parallel_rank() * shard
    vocab_ids = torch.arange(start, start + shard, device=logits.device)
    logits = logits.masked_fill(vocab_ids >= real_vocab, float("-inf"))
    peak = logits.detach().max(dim=-1, keepdim=True).values
    if ps.get_tensor_model_parallel_world_size() > 1:
        torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX, group=ps.get_tensor_model_parallel_group())
    shifted = logits - peak
    sum_exp = reduce_from_tensor_model_parallel_region(shifted.exp().sum(dim=-1))
    local = (labels >= start) & (labels < start + shard)
    index = (labels - start).clamp(0, shard - 1)
    picked = shifted.gather(-1, index[..., None]).squeeze(-1) * local
    picked = reduce_from_tensor_model_parallel_region(picked)
    return picked - sum_exp.log()


def _chunk_lse(logits: torch.Tensor, valid: int) -> torch.Tensor:
    """fp32 log-sum-exp over the first ``valid`` columns of a ``[n, V/tp]`` chunk (the rest is vocabulary padding).

    The max is taken in the logits' dtype (exact) and ``logits - max`` promotes to fp32 in the same
    kernel, so no separate fp32 copy of the chunk is made.
    """
    if valid == 0:
        return torch.full(logits.shape[:1], float("-inf"), dtype=torch.float32, device=logits.device)
    shard = logits[:, :valid]
    peak = shard.amax(dim=-1, keepdim=True).float()
    return torch.sub(shard, peak).exp_().sum(dim=-1).log_().add_(peak.squeeze(-1))


def _chunk_grad(logits: torch.Tensor, lse: torch.Tensor, grad: torch.Tensor, index: torch.Tensor, local: torch.Tensor,
                valid: int) -> torch.Tensor:
    """``grad * (onehot(label) - softmax)`` of one chunk in fp32 (in-place steps); padding columns get 0."""
    probs = torch.sub(logits, lse[:, None]).exp_()  # promotes to fp32 while subtracting
    if valid < logits.shape[1]:
        probs[:, valid:] = 0.0
    out = probs.mul_(-grad[:, None])
    return out.scatter_add_(1, index[:, None], torch.where(local, grad, 0.0)[:, None])


def _chunk_grad_pointwise(logits: torch.Tensor, lse: torch.Tensor, grad: torch.Tensor, index: torch.Tensor,
                          local: torch.Tensor, valid: int) -> torch.Tensor:
    """:func:`_chunk_grad` as one pointwise expression in the logits' dtype (``torch.compile`` fuses it into one kernel)."""
    columns = torch.arange(logits.shape[1], device=logits.device)
    probs = torch.where(columns < valid, torch.exp(logits.float() - lse[:, None]), 0.0)
    onehot = ((columns[None] == index[:, None]) & local[:, None]).float()
    return (grad[:, None] * (onehot - probs)).to(logits.dtype)


_COMPILED: dict[str, Any] = {}


def _kernels(compiled: bool) -> tuple[Any, Any]:
    if not compiled:
        return _chunk_lse, _chunk_grad
    if not _COMPILED:
        _COMPILED["lse"] = torch.compile(_chunk_lse, dynamic=False)
        _COMPILED["grad"] = torch.compile(_chunk_grad_pointwise, dynamic=False)
    return _COMPILED["lse"], _COMPILED["grad"]


class VocabParallelLogps(torch.autograd.Function):
    """Label log-probs from a vocabulary shard ``[N, V/tp]``, fp32 math one chunk of tokens at a time.

    Forward keeps only the logits (in their dtype, bf16 under mixed precision: no full-size fp32
    copy) and the per-token fp32 log-sum-exp; the TP ranks combine their local log-sum-exps and
    label logits with one all-gather and one all-reduce of ``N`` values. Backward writes
    ``grad * (onehot - softmax)`` into the saved logits in place (nothing reads them after this
    node) and needs no communication: each rank's gradient is for its own shard.
    """

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, labels: torch.Tensor, start: int, real_vocab: int, group: Any,
                compiled: bool) -> torch.Tensor:
        rows, shard = logits.shape
        valid = max(0, min(shard, real_vocab - start))
        local = (labels >= start) & (labels < start + shard)
        index = (labels - start).clamp(0, shard - 1)
        lse_fn, _ = _kernels(compiled)
        lse = torch.empty(rows, dtype=torch.float32, device=logits.device)
        for begin in range(0, rows, CHUNK_TOKENS):
            lse[begin:begin + CHUNK_TOKENS] = lse_fn(logits[begin:begin + CHUNK_TOKENS], valid)
        picked = torch.where(local, logits.gather(1, index[:, None]).squeeze(1).float(), 0.0)
        if group is not None:
            parts = [torch.empty_like(lse) for _ in range(torch.distributed.get_world_size(group))]
            torch.distributed.all_gather(parts, lse, group=group)
            lse = torch.logsumexp(torch.stack(parts), dim=0)
            torch.distributed.all_reduce(picked, group=group)
        ctx.save_for_backward(logits, lse, index, local)
        ctx.valid, ctx.compiled = valid, compiled
        return picked - lse

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        logits, lse, index, local = ctx.saved_tensors
        _, grad_fn = _kernels(ctx.compiled)
        grad = grad.float().contiguous()
        for begin in range(0, logits.shape[0], CHUNK_TOKENS):
            end = begin + CHUNK_TOKENS
            logits[begin:end] = grad_fn(logits[begin:end], lse[begin:end], grad[begin:end], index[begin:end],
                                        local[begin:end], ctx.valid)  # one copy, converting to the logits' dtype
        return logits, None, None, None, None, None


class _GatherCP(torch.autograd.Function):
    """All-gather log-probs along tokens over CP; backward keeps this rank's slice (every rank computes the same loss)."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, tokens: int) -> torch.Tensor:
        from megatron.core import parallel_state as ps

        from toolkit_megatron.attention import load_balanced_indices

        size, rank = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
        parts = [torch.empty_like(local) for _ in range(size)]
        torch.distributed.all_gather(parts, local.contiguous(), group=ps.get_context_parallel_group())
        order = torch.cat([load_balanced_indices(tokens, size, r) for r in range(size)]).to(local.device)
        full = local.new_empty(local.shape[0], tokens)
        full[:, order] = torch.cat(parts, dim=1)
        ctx.mine = load_balanced_indices(tokens, size, rank).to(local.device)
        return full

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad[:, ctx.mine], None


def make_loss_func(loss: Any, ctx: StepContext, kernel: LogpsKernel = "chunked", fused_head: Any = None) -> Any:
    """Megatron's ``loss_func`` for one micro-batch: logits shard -> TokenLogps -> the core Loss.

    ``fused_head``: an active :class:`~toolkit_megatron.fused_head.OutputHeadSwitch` (the model returns
    the final hidden states, not logits) and its kernel ops, ``(switch, ops)``; the label log-probs of
    the trained positions (``label_index``, from :func:`prepare_micro_batches`) go through the fused
    head. Only for a loss with a uniform token gradient.
    """
    from megatron.core import parallel_state as ps

    from toolkit_megatron.schedule import cp_slice

    def loss_func(micro: dict, output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
        labels = micro["labels"]
        mask = labels != IGNORE_INDEX
        local_labels = cp_slice(labels.clamp(min=0))
        if fused_head is None:
            logps = vocab_parallel_logps(output, local_labels, micro["real_vocab"], kernel)
        else:
            logps = _fused_logps(output, local_labels, micro, *fused_head)
        if ps.get_context_parallel_world_size() > 1:
            logps = _GatherCP.apply(logps, labels.shape[1])
        logps = logps * mask
        meta = micro["sequence_meta"]
        out = TokenLogps(logps=logps, mask=mask, sequence_ids=micro["sequence_ids"], num_sequences=micro["num_sequences"],
                         sequence_meta=meta, reference_logps=meta.get("reference_logps"),
                         token_meta=micro.get("token_meta", {}))
        result = loss(out, ctx)
        reported = {"loss": result.loss.detach(), **{k: v.detach() for k, v in result.metrics.items()}}
        return result.loss, torch.tensor(1, dtype=torch.int, device=output.device), reported

    return loss_func


def _fused_logps(hidden: torch.Tensor, local_labels: torch.Tensor, micro: dict, switch: Any, ops: Any) -> torch.Tensor:
    """``[B, T/cp]`` fp32 log-probs from the hidden states ``[B, T/cp, H]``: the trained positions through the
    fused head, zeros elsewhere (masked out after the CP gather, as on the logits path)."""
    from toolkit_megatron.fused_head import fused_label_logps

    index = micro["label_index"]
    rows = hidden.reshape(-1, hidden.shape[-1]).index_select(0, index)
    picked = fused_label_logps(rows, local_labels.reshape(-1).index_select(0, index), switch.weight, micro["real_vocab"], ops)
    logps = torch.zeros(local_labels.numel(), dtype=torch.float32, device=hidden.device)
    return logps.index_copy(0, index, picked).view(local_labels.shape)


def _plain_causal(position_ids: torch.Tensor, sequence_ids: torch.Tensor) -> bool:
    """True when every row is one sequence from position 0 followed only by padding (no mask needed)."""
    valid = sequence_ids >= 0
    arange = torch.arange(position_ids.shape[1])[None].expand_as(position_ids)
    trailing_pad = bool((valid[:, :-1] | ~valid[:, 1:]).all())
    one_sequence = bool(((sequence_ids == sequence_ids[:, :1]) | ~valid).all())
    return trailing_pad and one_sequence and bool(((position_ids == arange) | ~valid).all())


def prepare_micro_batches(micro_batches: list[dict], layout: Any, real_vocab: int, device: torch.device,
                          longest: int | None = None, label_positions: bool = False) -> list[dict]:
    """Pad every micro-batch to one length (at least ``longest``) that splits over CP/SP, and attach the attention meta.

    ``label_positions``: also ``label_index``, the flat positions of the trained labels in this CP rank's
    ``[B, T/cp]`` slice (for the fused head), found on the host so the device is never waited for.
    """
    from toolkit_megatron.schedule import cp_slice

    multiple = (2 * layout.context if layout.context > 1 else 1) * (layout.tensor if layout.sequence_parallel else 1)
    longest = max(longest or 0, *(mb["input_ids"].shape[1] for mb in micro_batches))
    length = -(-longest // multiple) * multiple
    prepared = []
    for mb in micro_batches:
        pad = length - mb["input_ids"].shape[1]
        padded = {k: torch.nn.functional.pad(mb[k], (0, pad), value=v)
                  for k, v in (("input_ids", 0), ("labels", IGNORE_INDEX), ("position_ids", 0), ("sequence_ids", -1))}
        if "token_meta" in mb:  # per-token loss inputs (toolkit-rl's rollout log-probs) stay aligned with labels
            padded["token_meta"] = {k: torch.nn.functional.pad(v, (0, pad)) for k, v in mb["token_meta"].items()}
        plain = _plain_causal(padded["position_ids"].cpu(), padded["sequence_ids"].cpu())
        micro = {**mb, **padded, "meta": None if plain else torch.stack([padded["position_ids"], padded["sequence_ids"]])}
        if label_positions:
            micro["label_index"] = (cp_slice(padded["labels"].cpu()) != IGNORE_INDEX).flatten().nonzero().squeeze(1)
        prepared.append({**_to(micro, device), "real_vocab": real_vocab})
    return prepared


def _to(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=True)
    if isinstance(value, dict):
        return {k: _to(v, device) for k, v in value.items()}
    return value
