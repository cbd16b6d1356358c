"""The fused output head at the last pipeline stage: label log-probs from the final hidden states, with the
head's input and weight gradients made in forward, so the ``[tokens, V/tp]`` logits never exist whole.

Only for losses that give every label log-prob the same gradient (``pt``/``sft`` declare
``uniform_token_gradient``): the weight gradient is summed over tokens in forward and backward scales
it by the mean incoming gradient (see :mod:`toolkit.train.fused_head`, the ``local`` engine's lever).
:class:`OutputHeadSwitch` makes the model chunk's ``output_layer`` return its (TP-mapped) input instead
of logits; :func:`fused_label_logps` takes them through the core's ``FusedLinearLogps`` at TP=1, or
:class:`VocabParallelFusedLogps` (one collective per chunk of tokens) under tensor parallelism.
"""

from __future__ import annotations

from typing import Any

import torch

from toolkit.train.fused_head import accumulate_weight_grad, scaled_gradients

FUSED_CHUNK_TOKENS = 2048
"""Tokens per chunk of the fused head: one ``[chunk, V/tp]`` logits block (plus its fp32 softmax) at a time."""


class OutputHeadSwitch:
    """Replaces the ``forward`` of a last-stage ``GPTModel.output_layer`` (a ``ColumnParallelLinear``).

    While :attr:`active`, the layer returns its input after the tensor-parallel mapping the layer applies
    before its GEMM: Megatron's ``gather_from_sequence_parallel_region`` under sequence parallelism
    (backward: reduce-scatter of the partial input gradients), otherwise :class:`_CopyToTensorParallel`
    (backward: all-reduce). ``GPTModel`` then transposes it to ``[b, s, h]`` as it does logits. The weight Megatron passes (the word embeddings when tied, at the
    first stage of a tied model or with PP=1) is kept in :attr:`weight` for the loss function.
    Inactive, the layer is Megatron's own.
    """

    def __init__(self, layer: Any):
        self.layer, self.original = layer, layer.forward
        self.active = False
        self.weight: torch.Tensor | None = None
        layer.forward = self.forward

    def forward(self, input_: torch.Tensor, weight: torch.Tensor | None = None,
                runtime_gather_output: bool | None = None) -> tuple[torch.Tensor, None]:
        if not self.active:
            return self.original(input_, weight=weight, runtime_gather_output=runtime_gather_output)
        from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

        layer = self.layer
        self.weight = layer.weight if weight is None else weight
        if layer.tp_group.size() > 1:
            if layer.sequence_parallel:
                input_ = gather_from_sequence_parallel_region(input_, tensor_parallel_output_grad=True, group=layer.tp_group)
            else:
                input_ = _CopyToTensorParallel.apply(input_, layer.tp_group)
        return input_, None


class _CopyToTensorParallel(torch.autograd.Function):
    """Megatron's ``copy_to_tensor_model_parallel_region`` (identity forward, all-reduce backward) for any gradient layout.

    megatron-core 0.16's ``_reduce`` all-reduces ``grad.contiguous()`` and returns ``grad``: for the
    transposed (non-contiguous) gradient that ``GPTModel``'s ``[s, b, h] -> [b, s, h]`` sends back, the
    sum lands in a temporary and is lost. Its own output layer never meets that (its GEMM's backward
    all-reduces a fresh tensor).
    """

    @staticmethod
    def forward(ctx: Any, input_: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return input_

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad, None


def install_output_switches(chunks: list[Any]) -> list[OutputHeadSwitch]:
    """One :class:`OutputHeadSwitch` per model chunk of this rank that holds the output layer."""
    return [OutputHeadSwitch(chunk.output_layer) for chunk in chunks if getattr(chunk, "post_process", False)]


class TorchShardOps:
    """The per-chunk math of :class:`VocabParallelFusedLogps` on one vocabulary shard, in torch.

    On CUDA each function is one ``torch.compile``-d kernel (:func:`toolkit.train.kernels.compiled.fused`:
    no fp32 copy of the chunk's logits is written); elsewhere eager ops written in place, which hold one
    fp32 copy. A kernel backend (Triton) can replace the class with the same two functions.
    """

    name = "torch"

    @staticmethod
    def shard_stats(logits: torch.Tensor, index: torch.Tensor, local: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 log-sum-exp of each row of ``logits [c, valid]`` and the label's logit where this shard holds it (else 0)."""
        from toolkit_megatron.logps import _chunk_lse

        if logits.shape[1] == 0:
            lse = _chunk_lse(logits, 0)
            return lse, torch.zeros_like(lse)
        if logits.is_cuda:
            from toolkit.train.kernels.compiled import fused

            lse = fused("megatron_shard_lse", _shard_lse, logits.device)(logits)
        else:
            lse = _chunk_lse(logits, logits.shape[1])
        label = logits.gather(1, index[:, None]).squeeze(1).float()
        return lse, torch.where(local, label, 0.0)

    @staticmethod
    def shard_direction(logits: torch.Tensor, lse: torch.Tensor, index: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        """``onehot(label) - softmax`` over this shard (fp32 math, ``lse`` global), in the logits' dtype."""
        if logits.is_cuda:
            from toolkit.train.kernels.compiled import fused

            return fused("megatron_shard_direction", shard_direction_pointwise, logits.device)(logits, lse, index, local)
        direction = torch.sub(logits, lse[:, None]).exp_().neg_()  # promotes to fp32 while subtracting
        if logits.shape[1]:
            direction.scatter_add_(1, index[:, None], local.to(direction.dtype)[:, None])
        return direction.to(logits.dtype)


def _shard_lse(logits: torch.Tensor) -> torch.Tensor:
    return torch.logsumexp(logits.float(), dim=-1)


def shard_direction_pointwise(logits: torch.Tensor, lse: torch.Tensor, index: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """:meth:`TorchShardOps.shard_direction` as one pointwise expression (what ``torch.compile`` fuses on CUDA;
    the one-hot is a comparison, not a scatter)."""
    columns = torch.arange(logits.shape[1], device=logits.device)
    onehot = ((columns[None, :] == index[:, None]) & local[:, None]).float()
    return (onehot - torch.exp(logits.float() - lse[:, None])).to(logits.dtype)


class VocabParallelFusedLogps(torch.autograd.Function):
    """``log p(labels)`` for TP-replicated ``hidden [N, H]`` through this rank's vocabulary shard ``weight [V/tp, H]``.

    Per chunk of tokens: local logits ``[c, valid]`` in the compute dtype (padded vocabulary rows left
    out), fp32 local log-sum-exp and label logit, one all-gather of both over TP (global log-sum-exp;
    only the owning rank has a nonzero label logit), then ``direction = onehot - softmax`` on this
    shard, this shard's part of the input gradient ``direction @ w`` (the TP mapping's backward sums the
    parts) and its weight gradient ``direction^T h``. Backward only scales: the input gradient per token,
    the weight gradient by the mean incoming gradient (exact for a uniform token gradient).
    """

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor, start: int, real_vocab: int,
                group: Any, chunk: int, ops: Any) -> torch.Tensor:
        rows, shard = hidden.shape[0], weight.shape[0]
        valid = max(0, min(shard, real_vocab - start))
        with torch.no_grad():
            w = weight[:valid].to(hidden.dtype)
            local = (labels >= start) & (labels < start + valid)
            index = (labels - start).clamp(0, max(valid - 1, 0))
            picked = torch.empty(rows, dtype=torch.float32, device=hidden.device)
            grad_hidden = torch.empty_like(hidden)
            grad_weight = torch.zeros(weight.shape, dtype=weight.dtype, device=weight.device) if weight.requires_grad else None
            for begin in range(0, rows, chunk):
                end = min(begin + chunk, rows)
                h = hidden[begin:end]
                logits = h @ w.t()
                lse, label = ops.shard_stats(logits, index[begin:end], local[begin:end])
                if group is not None:
                    lse, label = _combine_over_tp(lse, label, group)
                picked[begin:end] = label - lse
                direction = ops.shard_direction(logits, lse, index[begin:end], local[begin:end])
                del logits
                torch.mm(direction, w, out=grad_hidden[begin:end])
                if grad_weight is not None:
                    accumulate_weight_grad(grad_weight[:valid], direction, h)
                del direction
        ctx.save_for_backward(grad_hidden, grad_weight)
        return picked

    @staticmethod
    def backward(ctx: Any, grad_picked: torch.Tensor) -> tuple[Any, ...]:
        d_hidden, d_weight = scaled_gradients(ctx, grad_picked)
        return d_hidden, None, d_weight, None, None, None, None, None


def _combine_over_tp(lse: torch.Tensor, label: torch.Tensor, group: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Global log-sum-exp and label logit from every TP rank's local ones: one all-gather of ``[2, c]``."""
    mine = torch.stack([lse, label])
    parts = [torch.empty_like(mine) for _ in range(torch.distributed.get_world_size(group))]
    torch.distributed.all_gather(parts, mine, group=group)
    gathered = torch.stack(parts)
    return torch.logsumexp(gathered[:, 0], dim=0), gathered[:, 1].sum(dim=0)


def fused_label_logps(hidden: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor, real_vocab: int,
                      kernel_ops: Any = None, chunk: int = FUSED_CHUNK_TOKENS) -> torch.Tensor:
    """fp32 ``log p(labels)`` of ``hidden [N, H]`` (TP-mapped) through the output ``weight`` shard, gradients made in forward.

    TP=1: :class:`toolkit.train.fused_head.FusedLinearLogps` with ``kernel_ops`` (a
    :mod:`toolkit.train.kernels` backend; the torch reference ops when ``None``). Under TP:
    :class:`VocabParallelFusedLogps`.
    """
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    if tp == 1:
        from toolkit.train.fused_head import FusedLinearLogps
        from toolkit.train.kernels.reference import TorchOps

        head = weight if real_vocab == weight.shape[0] else weight[:real_vocab]
        return FusedLinearLogps.apply(hidden, labels, head, chunk, kernel_ops or TorchOps)
    start = ps.get_tensor_model_parallel_rank() * weight.shape[0]
    group = ps.get_tensor_model_parallel_group()
    return VocabParallelFusedLogps.apply(hidden, labels, weight, start, real_vocab, group, chunk, TorchShardOps)
