"""Multi-head latent attention's key/value down-projection with complete gradients under tensor parallelism.

megatron-core's MLA (0.16, 0.19) with the local layer spec builds ``linear_kv_down_proj`` as a ColumnParallelLinear,
gathers its output over TP and splits it into the key/value latent and the rotary key ``k_pos_emb``, which
every head shares. Each TP rank attends with its own heads, so the gradient reaching ``k_pos_emb`` on a rank is
the sum over that rank's heads only; the gather's backward keeps each rank's own columns as if the gradient were
the same everywhere, and the other ranks' heads' part of the rotary key's gradient is lost. (The Transformer
Engine spec replicates the projection and gathers ``k_pos_emb`` over the sequence-parallel region, whose backward
sums it.) :class:`KVDownProjection` hands MLA the whole projection, which takes MLA's other branch, and makes the
gradient whole: under sequence parallelism its output is cut to this rank's tokens, so MLA gathers ``k_pos_emb``
over the sequence (backward: summed over TP); without it the rotary columns' gradient is all-reduced over TP.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear


def sum_rotary_grad(grad: torch.Tensor, latent: int, group: Any) -> torch.Tensor:
    """``grad`` (a copy) with its columns from ``latent`` on, the rotary key's, summed over ``group`` (TP): each
    rank holds that gradient for its own heads only."""
    grad = grad.clone()
    rotary = grad[..., latent:].contiguous()
    torch.distributed.all_reduce(rotary, group=group)
    grad[..., latent:] = rotary
    return grad


class SumRotaryGrad(torch.autograd.Function):
    """Identity; backward: :func:`sum_rotary_grad` (for a delta added to the whole projection, LoRA's)."""

    @staticmethod
    def forward(ctx: Any, delta: torch.Tensor, latent: int, group: Any) -> torch.Tensor:
        ctx.latent, ctx.group = latent, group
        return delta.view_as(delta)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return sum_rotary_grad(grad, ctx.latent, ctx.group), None, None


class _GatherSummingRotary(torch.autograd.Function):
    """All-gather the last dimension over TP; backward: all-reduce the columns from ``latent`` on (the rotary
    key, whose gradient each rank holds for its heads only), then keep this rank's columns."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, latent: int, group: Any) -> torch.Tensor:
        ctx.latent, ctx.group = latent, group
        ctx.rank, ctx.width = torch.distributed.get_rank(group), local.shape[-1]
        parts = [torch.empty_like(local) for _ in range(torch.distributed.get_world_size(group))]
        torch.distributed.all_gather(parts, local.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        grad = sum_rotary_grad(grad, ctx.latent, ctx.group)
        return grad[..., ctx.rank * ctx.width:(ctx.rank + 1) * ctx.width].contiguous(), None, None


class KVDownProjection(ColumnParallelLinear):
    """``linear_kv_down_proj`` whose output is the whole ``[kv_lora_rank + qk_pos_emb_head_dim]`` projection
    (sequence-parallel: for this rank's tokens), with the rotary key's gradient summed over TP's heads."""

    def forward(self, hidden: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel import mappings

        out, bias = super().forward(hidden, *args, **kwargs)
        if ps.get_tensor_model_parallel_world_size() == 1:
            return out, bias
        if self.config.sequence_parallel:
            full = mappings.gather_from_tensor_model_parallel_region(out)
            return mappings.scatter_to_sequence_parallel_region(full), bias
        return _GatherSummingRotary.apply(out, self.config.kv_lora_rank, ps.get_tensor_model_parallel_group()), bias


def latent_attention_class() -> type:
    """megatron-core's ``MLASelfAttention`` with :class:`KVDownProjection` as its key/value down-projection.

    MLA accepts only megatron's own linear classes for that submodule (``in [Linear, TEColumnParallelLinear,
    ColumnParallelLinear]``, compared by identity), so it is built as a ColumnParallelLinear and given the
    subclass afterwards; the subclass adds no state, only ``forward``."""
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    class LatentAttention(MLASelfAttention):
        def __init__(self, *args: Any, **kwargs: Any):
            super().__init__(*args, **kwargs)
            if type(self.linear_kv_down_proj) is ColumnParallelLinear:
                self.linear_kv_down_proj.__class__ = KVDownProjection

        def _resolve_qk_norm_config(self, submodules: Any) -> dict[str, Any]:
            """The spec's own modules (megatron-core 0.19 calls this; 0.16 builds the spec as given).

            0.19 checks the latent norms against ``config.qk_layernorm`` and, with it on and ``q_lora_rank``
            unset (DeepSeek-V2-Lite), wants Transformer Engine's fused norm+linear for ``linear_q_proj``. The
            toolkit's spec names every module: DeepSeek's latent RMSNorms as separate modules, a query norm only
            where ``q_lora_rank`` is set, so it is built as written, as on 0.16."""
            from megatron.core.transformer.spec_utils import build_module

            def norm(spec: Any) -> Any:
                return lambda **kwargs: build_module(spec, **kwargs)

            return dict(linear_q_proj=submodules.linear_q_proj, linear_q_up_proj=submodules.linear_q_up_proj,
                        linear_kv_up_proj=submodules.linear_kv_up_proj, q_layernorm=norm(submodules.q_layernorm),
                        kv_layernorm=norm(submodules.kv_layernorm))

    return LatentAttention
