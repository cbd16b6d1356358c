"""Running micro-batches through Megatron's pipeline schedules (no pipelining, 1F1B, interleaved).

A micro-batch here is a dict with ``input_ids`` ``[B, T]`` and optional ``meta`` ``[2, B, T]``
(position ids, sequence ids) for :class:`toolkit_megatron.attention.SDPAAttention`. Inputs are
cut for context parallelism here (each CP rank keeps its two load-balanced chunks).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from toolkit_megatron.attention import load_balanced_indices
from toolkit_megatron.compat import cpu_compat


def cp_slice(tensor: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """This context-parallel rank's load-balanced part of ``tensor`` along ``dim``."""
    from megatron.core import parallel_state as ps

    size = ps.get_context_parallel_world_size()
    if size == 1:
        return tensor
    index = load_balanced_indices(tensor.shape[dim], size, ps.get_context_parallel_rank()).to(tensor.device)
    return tensor.index_select(dim, index)


def run_schedule(models: list[Any], micro_batches: list[dict], loss_func: Callable | None, *, forward_only: bool,
                 fp32_logits: bool = True) -> list[Any]:
    """Run every micro-batch through the model chunks; returns what the last stage collected.

    ``loss_func(micro_batch, output)`` receives this rank's logits shard ``[B, T/cp, V/tp]``
    and returns Megatron's ``(loss, num_tokens, reduced)`` triple; with ``loss_func=None`` the
    last stage collects the logits themselves (inference/tests). ``fp32_logits=False`` keeps a
    bf16 model's logits in bf16 (Megatron's ``Float16Module`` upcasts them by default: a
    full-size fp32 copy of ``[B, T, V/tp]``).
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.module import Float16Module

    batch, tokens = micro_batches[0]["input_ids"].shape
    chunks = len(models)
    if not fp32_logits and isinstance(getattr(models[-1], "module", None), Float16Module):
        extra_kwargs = {"fp32_output": False}
    else:
        extra_kwargs = {}

    def forward_step(data_iterator: Any, model: Any) -> tuple[torch.Tensor, Any]:
        micro = next(data_iterator)
        input_ids = cp_slice(micro["input_ids"])
        extra = {"padding_mask": cp_slice(micro["padding_mask"])} if "padding_mask" in micro else {}
        output = model(input_ids, None, micro.get("meta"), **extra, **extra_kwargs)
        if loss_func is None:
            return output, None
        return output, lambda out, non_loss_data=False: loss_func(micro, out)

    iterators = [iter(micro_batches) for _ in range(chunks)]
    with cpu_compat():
        return get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iterators if chunks > 1 else iterators[0],
            model=models if chunks > 1 else models[0],
            num_microbatches=len(micro_batches),
            seq_length=tokens,
            micro_batch_size=batch,
            forward_only=forward_only,
        )


def gather_logits(models: list[Any], input_ids: torch.Tensor, meta: torch.Tensor | None = None) -> torch.Tensor | None:
    """Full ``[B, T, vocab]`` logits on last-stage ranks (``None`` elsewhere): TP and CP gathered.

    For tests and small-scale inference only; training never gathers the vocabulary.
    """
    from megatron.core import parallel_state as ps

    for model in models:
        model.eval()
    with torch.no_grad():
        # One row per micro-batch: the interleaved schedule needs at least pp micro-batches.
        rows = [{"input_ids": input_ids[i:i + 1], "meta": None if meta is None else meta[:, i:i + 1]}
                for i in range(input_ids.shape[0])]
        collected = run_schedule(models, rows, None, forward_only=True)
    if not ps.is_pipeline_last_stage(ignore_virtual=True):
        return None
    logits = torch.cat(collected, dim=0)
    if ps.get_tensor_model_parallel_world_size() > 1:
        parts = [torch.empty_like(logits) for _ in range(ps.get_tensor_model_parallel_world_size())]
        torch.distributed.all_gather(parts, logits.contiguous(), group=ps.get_tensor_model_parallel_group())
        logits = torch.cat(parts, dim=-1)
    cp = ps.get_context_parallel_world_size()
    if cp > 1:
        parts = [torch.empty_like(logits) for _ in range(cp)]
        torch.distributed.all_gather(parts, logits.contiguous(), group=ps.get_context_parallel_group())
        order = torch.cat([load_balanced_indices(input_ids.shape[1], cp, r) for r in range(cp)]).to(logits.device)
        full = logits.new_empty(logits.shape[0], input_ids.shape[1], logits.shape[2])
        full[:, order] = torch.cat(parts, dim=1)
        logits = full
    return logits[..., : models[-1].toolkit_real_vocab]
