"""Expert parallelism over torch.distributed: experts split over ranks, tokens moved by all-to-all.

Rank ``r`` of an expert-parallel group of size ``P`` owns experts ``[r*E/P, (r+1)*E/P)``.
A layer exchanges per-expert counts (one small all-to-all and the only host sync, for the
split sizes), sends each token row to the rank of its expert, runs the local experts on
expert-major rows and sends the results back. Gradients flow through the same all-to-alls
reversed, so each rank's expert weights receive the gradient of every token they served.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from toolkit.train.sharded import Shard


@dataclass(frozen=True)
class ExpertGroup(Shard):
    """An expert-parallel process group and this process's place in it.

    It is also the core's :class:`~toolkit.train.sharded.Shard` of every expert weight split over
    the group (``replicas``: the ranks holding the same experts in the other groups, ``None`` when
    expert parallelism spans the world), so the engines reduce, clip and gather those weights.
    """

    def local_slice(self, num_experts: int) -> slice:
        per_rank = num_experts // self.size
        return slice(self.rank * per_rank, (self.rank + 1) * per_rank)


def new_expert_groups(expert_parallel: int) -> ExpertGroup | None:
    """Split the world into consecutive groups of ``expert_parallel`` ranks; ``None`` for EP1.

    Ranks ``r, r + P, r + 2P, ...`` hold the same experts; when the world is larger than ``P``
    they form the ``replicas`` group over which expert gradients are summed. Every rank must
    call this (``new_group`` is collective).
    """
    if expert_parallel <= 1:
        return None
    world, rank = dist.get_world_size(), dist.get_rank()
    mine, replicas = None, None
    for start in range(0, world, expert_parallel):
        ranks = list(range(start, start + expert_parallel))
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = ExpertGroup(group=group, rank=ranks.index(rank), size=expert_parallel)
    if world > expert_parallel:
        for offset in range(expert_parallel):
            group = dist.new_group(list(range(offset, world, expert_parallel)))
            if rank % expert_parallel == offset:
                replicas = group
    return ExpertGroup(group=mine.group, rank=mine.rank, size=mine.size, replicas=replicas)


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` on rows; backward is the same exchange with the splits swapped."""

    @staticmethod
    def forward(ctx, rows, output_splits, input_splits, group):
        ctx.splits, ctx.group = (output_splits, input_splits), group
        out = rows.new_empty((sum(output_splits), *rows.shape[1:]))
        dist.all_to_all_single(out, rows.contiguous(), output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        return _AllToAll.apply(grad.contiguous(), input_splits, output_splits, ctx.group), None, None, None


def all_to_all(rows: torch.Tensor, output_splits: list[int], input_splits: list[int], group: object) -> torch.Tensor:
    return _AllToAll.apply(rows, output_splits, input_splits, group)


def expert_parallel_ffn(
    rows: torch.Tensor,
    row_weights: torch.Tensor,
    kept_per_expert: torch.Tensor,
    local_ffn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    ep: ExpertGroup,
) -> torch.Tensor:
    """Run expert-major ``rows`` ``[M, H]`` (global expert order, kept rows first) on their owners.

    ``row_weights`` ``[M, 1]`` (router weights) travel with the rows.
    ``local_ffn(rows, row_weights, counts)`` computes this rank's experts on expert-major rows. Returns
    ``[M, H]`` results in the order of ``rows``; rows beyond the kept ones come back as zeros.
    """
    num_experts = kept_per_expert.numel()
    per_rank = num_experts // ep.size
    send_counts = kept_per_expert.view(ep.size, per_rank).contiguous()
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts.view(-1), send_counts.view(-1), group=ep.group)
    splits = torch.stack([send_counts.sum(1), recv_counts.sum(1)]).tolist()
    input_splits, output_splits = splits
    sent = sum(input_splits)

    received = all_to_all(rows[:sent], output_splits, input_splits, ep.group)
    received_weights = all_to_all(row_weights[:sent], output_splits, input_splits, ep.group)
    # Received rows are source-major then expert; the grouped matmul needs expert-major.
    segment_expert = torch.arange(per_rank, device=rows.device).repeat(ep.size)
    expert_of_row = torch.repeat_interleave(segment_expert, recv_counts.view(-1), output_size=received.shape[0])
    to_expert_major = torch.argsort(expert_of_row, stable=True)
    local_out = local_ffn(received[to_expert_major], received_weights[to_expert_major], recv_counts.sum(0))
    back = torch.empty_like(to_expert_major)
    back[to_expert_major] = torch.arange(to_expert_major.numel(), device=rows.device)
    returned = all_to_all(local_out[back], input_splits, output_splits, ep.group)
    if sent < rows.shape[0]:
        returned = torch.cat([returned, returned.new_zeros(rows.shape[0] - sent, returned.shape[1])])
    return returned


def is_expert_parallel(param: torch.Tensor) -> bool:
    return bool(getattr(param, "toolkit_expert_parallel", False))


def grad_norm(params: list[torch.Tensor], ep: ExpertGroup | None) -> torch.Tensor:
    """Global L2 norm of the gradients when expert weights are split over ``ep``.

    Replicated parameters count once (their gradients are equal on every rank after the
    data-parallel reduction); expert slices differ per rank, so their squares are summed over
    the group. Every rank gets the same value, hence clips by the same factor.
    """
    from toolkit.train import sharded

    shards = {id(p): ep for p in params if is_expert_parallel(p)} if ep is not None else {}
    return sharded.grad_norm(params, shards)


def gather_experts(local: torch.Tensor, ep: ExpertGroup) -> torch.Tensor:
    """The full ``[E, ...]`` tensor from each rank's ``[E/P, ...]`` slice (for export)."""
    return ep.gather(local)
