"""Label log-probs at the last pipeline stage, vocabulary-parallel, handed to the core's Loss.

Each tensor-parallel rank holds logits for ``V/tp`` vocabulary entries; the log-softmax
normaliser and the label's logit are reduced over the TP group (Megatron's
``reduce_from_tensor_model_parallel_region``: all-reduce forward, identity backward), so the
full-vocabulary logits never exist on one rank. Padded vocabulary rows are masked out.
"""

from __future__ import annotations

from typing import Any

import torch

from toolkit.contracts import IGNORE_INDEX, StepContext, TokenLogps


def vocab_parallel_logps(logits: torch.Tensor, labels: torch.Tensor, real_vocab: int) -> torch.Tensor:
    """``log p(labels)`` in fp32 from this rank's logits shard ``[B, T, V/tp]`` (labels >= 0)."""
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


def make_loss_func(loss: Any, ctx: StepContext) -> Any:
    """Megatron's ``loss_func`` for one micro-batch: logits shard -> TokenLogps -> the core Loss."""
    from megatron.core import parallel_state as ps

    from toolkit_megatron.schedule import cp_slice

    def loss_func(micro: dict, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
        labels = micro["labels"]
        mask = labels != IGNORE_INDEX
        local_labels = cp_slice(labels.clamp(min=0))
        logps = vocab_parallel_logps(logits, local_labels, micro["real_vocab"])
        if ps.get_context_parallel_world_size() > 1:
            logps = _GatherCP.apply(logps, labels.shape[1])
        logps = logps * mask
        meta = micro["sequence_meta"]
        out = TokenLogps(logps=logps, mask=mask, sequence_ids=micro["sequence_ids"], num_sequences=micro["num_sequences"],
                         sequence_meta=meta, reference_logps=meta.get("reference_logps"))
        result = loss(out, ctx)
        reported = {"loss": result.loss.detach(), **{k: v.detach() for k, v in result.metrics.items()}}
        return result.loss, torch.tensor(1, dtype=torch.int, device=logits.device), reported

    return loss_func


def _plain_causal(position_ids: torch.Tensor, sequence_ids: torch.Tensor) -> bool:
    """True when every row is one sequence from position 0 followed only by padding (no mask needed)."""
    valid = sequence_ids >= 0
    arange = torch.arange(position_ids.shape[1])[None].expand_as(position_ids)
    trailing_pad = bool((valid[:, :-1] | ~valid[:, 1:]).all())
    one_sequence = bool(((sequence_ids == sequence_ids[:, :1]) | ~valid).all())
    return trailing_pad and one_sequence and bool(((position_ids == arange) | ~valid).all())


def prepare_micro_batches(micro_batches: list[dict], layout: Any, real_vocab: int, device: torch.device,
                          longest: int | None = None) -> list[dict]:
    """Pad every micro-batch to one length (at least ``longest``) that splits over CP/SP, and attach the attention meta."""
    multiple = (2 * layout.context if layout.context > 1 else 1) * (layout.tensor if layout.sequence_parallel else 1)
    longest = max(longest or 0, *(mb["input_ids"].shape[1] for mb in micro_batches))
    length = -(-longest // multiple) * multiple
    prepared = []
    for mb in micro_batches:
        pad = length - mb["input_ids"].shape[1]
        padded = {k: torch.nn.functional.pad(mb[k], (0, pad), value=v)
                  for k, v in (("input_ids", 0), ("labels", IGNORE_INDEX), ("position_ids", 0), ("sequence_ids", -1))}
        plain = _plain_causal(padded["position_ids"].cpu(), padded["sequence_ids"].cpu())
        micro = {**mb, **padded, "meta": None if plain else torch.stack([padded["position_ids"], padded["sequence_ids"]])}
        prepared.append({**_to(micro, device), "real_vocab": real_vocab})
    return prepared


def _to(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=True)
    if isinstance(value, dict):
        return {k: _to(v, device) for k, v in value.items()}
    return value
