"""The sparse MoE block that replaces transformers' own: route, permute once, grouped experts, reduce.

It adopts the original block's submodules (``gate``, ``experts``, ``shared_expert``,
``shared_expert_gate``), so parameter names, shapes and checkpoints are unchanged; only the
forward differs. Under expert parallelism ``experts`` keeps this rank's slice of the fused
weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from toolkit_moe.experts import compute_dtype, expert_ffn, grouped_mm_available
from toolkit_moe.families import MoeFamily
from toolkit_moe.parallel import ExpertGroup, expert_parallel_ffn
from toolkit_moe.permute import inverse_permutation, reduce_rows, replicate_rows
from toolkit_moe.routing import Routing, load_balancing_loss, route, router_z_loss


@dataclass
class BlockOptions:
    capacity_factor: float = 0.0
    experts_backend: str = "auto"
    """``auto`` (grouped_mm on CUDA, loop elsewhere), ``grouped_mm`` or ``loop``."""


@dataclass
class AuxCollector:
    """The routings of the MoE layers in one forward pass, turned into weighted aux/z losses on ``pop``.

    ``pop(tokens=None)`` returns ``(loss, metrics)``: ``loss`` is ``aux_loss_coef * mean_layers(aux) +
    z_loss_coef * mean_layers(z)`` for the last forward (``None`` before any), ``metrics`` detached
    tensors. ``tokens`` (bool, the real positions of that forward flattened as the blocks saw them)
    leaves padding out of the aux and z losses; the dropped and load counts still include it.
    """

    aux_loss_coef: float = 0.0
    z_loss_coef: float = 0.0
    routings: list[Routing] = field(default_factory=list)

    def clear(self, *_: Any) -> None:
        self.routings.clear()

    def record(self, routing: Routing) -> None:
        self.routings.append(routing)

    def pop(self, tokens: torch.Tensor | None = None) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
        if not self.routings:
            return None, {}
        routings, layers = self.routings, len(self.routings)
        aux = [load_balancing_loss(r.probs, r.experts, tokens) for r in routings]
        z = [router_z_loss(r.logsumexp, tokens) for r in routings]
        loss = torch.stack([self.aux_loss_coef * a + self.z_loss_coef * b for a, b in zip(aux, z, strict=True)]).sum() / layers
        metrics = {"moe_aux_loss": torch.stack(aux).detach().mean(), "moe_z_loss": torch.stack(z).detach().mean()}
        counts = torch.stack([r.tokens_per_expert for r in routings])
        dropped = torch.stack([r.dropped for r in routings]).sum()
        metrics["moe_dropped_fraction"] = dropped.float() / counts.sum().clamp(min=1).float()
        metrics["moe_dropped_tokens"] = dropped.float()
        loads = counts.max(dim=1).values.float() * counts.shape[1] / counts.sum(dim=1).clamp(min=1).float()
        metrics["moe_max_load"] = loads.max()
        self.clear()
        return loss, metrics


class GroupedExperts(nn.Module):
    """The experts, adopting the HF module's fused weights (same names), run on expert-major rows.

    A module of its own (rather than weights read by the block) so that wrappers which gather
    parameters around a module's forward (DeepSpeed ZeRO-3, FSDP) see them used.
    """

    def __init__(self, original: nn.Module, backend: str):
        super().__init__()
        self.gate_up_proj = original.gate_up_proj
        self.down_proj = original.down_proj
        self.act_fn = original.act_fn
        self.backend = backend

    def _use_grouped_mm(self, rows: torch.Tensor) -> bool:
        if self.backend in ("loop", "grouped_mm"):
            return self.backend == "grouped_mm"
        return grouped_mm_available(rows.device, compute_dtype(rows, self.gate_up_proj))

    def forward(self, rows: torch.Tensor, row_weights: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``rows [M, H]`` expert-major, ``row_weights [M, 1]`` router weights, ``counts [E_local]``."""
        return expert_ffn(rows, row_weights, counts, self.gate_up_proj, self.down_proj, self.act_fn,
                          use_grouped_mm=self._use_grouped_mm(rows))

    def keep_slice(self, group: ExpertGroup, num_experts: int) -> None:
        """Keep this rank's experts of the full weights (expert parallelism); full state dicts still load."""
        self.local = local = group.local_slice(num_experts)
        for name in ("gate_up_proj", "down_proj"):
            full = getattr(self, name)
            param = nn.Parameter(full.data[local].clone(), requires_grad=full.requires_grad)
            param.toolkit_expert_parallel = True  # strategies must not average it over data parallel
            param.toolkit_shard = group  # the core engines' contract for split parameters (a Shard)
            param.allreduce = False  # DeepSpeed's marker for expert parameters
            setattr(self, name, param)
        self._register_load_state_dict_pre_hook(self._slice_full_state)

    def _slice_full_state(self, state_dict, prefix, *_args) -> None:
        for name in ("gate_up_proj", "down_proj"):
            tensor = state_dict.get(prefix + name)
            if tensor is not None and tensor.shape[0] != getattr(self, name).shape[0]:
                state_dict[prefix + name] = tensor[self.local]

    def extra_repr(self) -> str:
        return f"experts={self.gate_up_proj.shape[0]}, backend={self.backend}"


class MoeBlock(nn.Module):
    """Drop-in replacement of an HF sparse MoE block (Qwen2-MoE, Qwen3-MoE, Mixtral)."""

    def __init__(self, original: nn.Module, family: MoeFamily, config: Any, options: BlockOptions,
                 expert_group: ExpertGroup | None = None, collector: AuxCollector | None = None):
        super().__init__()
        self.family = family
        self.num_experts = family.num_experts(config)
        self.top_k = family.top_k(config)
        self.normalize = family.normalize(config)
        self.jitter = family.jitter(config)
        self.options = options
        self.expert_group = expert_group
        self.collector = collector
        self.gate = original.gate
        self.experts = GroupedExperts(original.experts, options.experts_backend)
        if family.shared_expert:
            self.shared_expert = original.shared_expert
            self.shared_expert_gate = original.shared_expert_gate
        if expert_group is not None:
            self._keep_local_experts(expert_group)

    def _keep_local_experts(self, group: ExpertGroup) -> None:
        if self.num_experts % group.size:
            from toolkit.errors import LayoutError

            raise LayoutError(f"{self.num_experts} experts cannot be split over {group.size} expert-parallel ranks (--moe-expert-parallel): "
                              f"choose an expert-parallel size that divides {self.num_experts}")
        self.experts.keep_slice(group, self.num_experts)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        tokens = hidden_states.reshape(-1, shape[-1])
        if self.training and self.jitter > 0:
            tokens = tokens * torch.empty_like(tokens).uniform_(1.0 - self.jitter, 1.0 + self.jitter)
        # Through the HF router module, so its hooks (ZeRO-3 gathering, router-logit recording) fire.
        logits = self.gate(tokens)[0]
        routing = route(logits, self.top_k, normalize=self.normalize,
                        capacity_factor=self.options.capacity_factor if self.training else 0.0,
                        weight_dtype=tokens.dtype)
        order = routing.order
        inverse = inverse_permutation(order)
        rows = replicate_rows(tokens, order, inverse, self.top_k)
        row_weights = routing.weights.reshape(-1, 1)[order]
        if self.expert_group is None:
            expert_out = self.experts(rows, row_weights, routing.kept_per_expert)
        else:
            expert_out = expert_parallel_ffn(rows, row_weights, routing.kept_per_expert, self.experts, self.expert_group)
        out = reduce_rows(expert_out, order, inverse, self.top_k).to(tokens.dtype)
        if self.family.shared_expert:
            out = out + torch.sigmoid(self.shared_expert_gate(tokens)) * self.shared_expert(tokens)
        if self.training and self.collector is not None:
            self.collector.record(routing)
        return out.reshape(shape).to(hidden_states.dtype)

    def extra_repr(self) -> str:
        ep = f", expert_parallel={self.expert_group.size}" if self.expert_group else ""
        return (f"family={self.family.model_type}, experts={self.num_experts}, top_k={self.top_k}, "
                f"normalize={self.normalize}, capacity_factor={self.options.capacity_factor}{ep}")
