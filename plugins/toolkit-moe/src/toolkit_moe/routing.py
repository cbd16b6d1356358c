"""Top-k routing: family normalisation, capacity with dropped-token accounting, aux and z losses.

The losses can leave out padding positions (``real``): padding must not steer the router.

Everything here stays on the device (no ``.item()``, no ``nonzero``), so a routed layer never
waits for the host; counts are built with ``scatter_add_`` rather than ``bincount``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class Routing:
    """How one micro-batch of ``N`` tokens is routed to ``E`` experts, ``k`` per token.

    Assignments are the ``N * k`` (token, slot) pairs flattened token-major; ``order`` lists them
    sorted by expert with kept assignments first (ties keep token order), so one gather builds
    the expert-major input of a grouped matmul and dropped assignments sit at the end.
    """

    weights: torch.Tensor
    """``[N, k]`` combine weights (zero where an assignment was dropped)."""
    experts: torch.Tensor
    """``[N, k]`` selected expert ids."""
    order: torch.Tensor
    """``[N * k]`` assignment indices, expert-major, kept ones first."""
    kept_per_expert: torch.Tensor
    """``[E]`` int64 assignments each expert computes (``min(count, capacity)``)."""
    kept: torch.Tensor
    """``[N * k]`` bool, assignment kept (token-major)."""
    tokens_per_expert: torch.Tensor
    """``[E]`` int64 assignments routed to each expert before capacity."""
    probs: torch.Tensor
    """``[N, E]`` fp32 router probabilities (softmax over all experts, with grad)."""
    logsumexp: torch.Tensor
    """``[N]`` fp32 ``logsumexp`` of the router logits (with grad)."""

    @property
    def aux_loss(self) -> torch.Tensor:
        """Switch load-balancing loss (unweighted) over every token: see :func:`load_balancing_loss`."""
        return load_balancing_loss(self.probs, self.experts)

    @property
    def z_loss(self) -> torch.Tensor:
        """Router z-loss (unweighted) over every token: see :func:`router_z_loss`."""
        return router_z_loss(self.logsumexp)

    @property
    def dropped(self) -> torch.Tensor:
        """Number of dropped assignments (a 0-d int64 tensor)."""
        return (self.tokens_per_expert - self.kept_per_expert).sum()


def capacity(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int | None:
    """Per-expert capacity ``ceil(factor * N * k / E)``; ``None`` when ``factor <= 0`` (no dropping)."""
    if capacity_factor <= 0:
        return None
    return max(1, math.ceil(capacity_factor * num_tokens * top_k / num_experts))


def route(
    logits: torch.Tensor,
    top_k: int,
    *,
    normalize: bool,
    capacity_factor: float = 0.0,
    weight_dtype: torch.dtype | None = None,
) -> Routing:
    """Route ``logits`` ``[N, E]``: softmax over experts in fp32, top-k, optional renormalisation.

    ``normalize=True`` renormalises the top-k probabilities to sum to one: this is Mixtral's
    top-k-then-softmax (identical maths) and Qwen's ``norm_topk_prob``. ``capacity_factor > 0``
    keeps at most ``capacity`` assignments per expert, earliest tokens first.
    """
    num_tokens, num_experts = logits.shape
    logits32 = logits.float()
    probs = torch.softmax(logits32, dim=-1)
    top_probs, experts = torch.topk(probs, top_k, dim=-1)
    if normalize:
        top_probs = top_probs / top_probs.sum(dim=-1, keepdim=True)

    flat = experts.reshape(-1)
    ones = torch.ones_like(flat)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=logits.device).scatter_add_(0, flat, ones)
    order = torch.argsort(flat, stable=True)
    limit = capacity(num_tokens, top_k, num_experts, capacity_factor)
    if limit is None:
        kept = torch.ones_like(flat, dtype=torch.bool)
        kept_per_expert = counts
    else:
        starts = torch.cumsum(counts, 0) - counts
        sorted_experts = flat[order]
        rank_in_expert = torch.arange(flat.numel(), device=flat.device) - starts[sorted_experts]
        kept_sorted = rank_in_expert < limit
        kept = torch.empty_like(kept_sorted).scatter_(0, order, kept_sorted)
        kept_per_expert = counts.clamp(max=limit)
        # Dropped assignments move behind every kept one, so the grouped matmul never sees them.
        order = order[torch.argsort((~kept_sorted).to(torch.int8), stable=True)]
        top_probs = top_probs * kept.view_as(top_probs)

    return Routing(
        weights=top_probs.to(weight_dtype or logits.dtype),
        experts=experts,
        order=order,
        kept_per_expert=kept_per_expert,
        kept=kept,
        tokens_per_expert=counts,
        probs=probs,
        logsumexp=torch.logsumexp(logits32, dim=-1),
    )


def load_balancing_loss(probs: torch.Tensor, experts: torch.Tensor, real: torch.Tensor | None = None) -> torch.Tensor:
    """Switch load-balancing loss (unweighted) ``E * sum_e f_e * P_e`` of one layer.

    ``f_e`` is the number of assignments to expert ``e`` over the number of tokens, ``P_e`` the mean
    router probability of ``e`` (``probs [N, E]``, ``experts [N, k]``). ``real`` (``[N]`` bool) counts
    only those tokens, as transformers' ``load_balancing_loss_func`` does with an attention mask.
    """
    num_tokens, num_experts = probs.shape
    weight = None if real is None else real.reshape(-1).to(probs.device, probs.dtype)
    per_assignment = torch.ones_like(experts, dtype=probs.dtype) if weight is None else weight[:, None].expand_as(experts)
    counts = probs.new_zeros(num_experts).scatter_add_(0, experts.reshape(-1), per_assignment.reshape(-1))
    fraction = counts / (num_tokens if weight is None else weight.sum().clamp(min=1))
    return num_experts * torch.sum(fraction * _token_mean(probs, weight))


def router_z_loss(logsumexp: torch.Tensor, real: torch.Tensor | None = None) -> torch.Tensor:
    """Router z-loss (unweighted) ``mean(logsumexp(logits) ** 2)`` of one layer, over the ``real`` tokens when given."""
    weight = None if real is None else real.reshape(-1).to(logsumexp.device, logsumexp.dtype)
    return _token_mean(logsumexp.square(), weight)


def _token_mean(values: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
    """Mean over tokens (dim 0); weighted by ``weight`` (1 real, 0 padding) rather than indexed, so the host never waits."""
    if weight is None:
        return values.mean(dim=0)
    weight = weight.reshape(-1, *[1] * (values.dim() - 1))
    return (values * weight).sum(dim=0) / weight.sum().clamp(min=1)


def route_reference(logits: torch.Tensor, top_k: int, *, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Mixtral's original formulation, top-k on logits then softmax over the k (for tests/docs)."""
    top_logits, experts = torch.topk(logits.float(), top_k, dim=-1)
    weights = F.softmax(top_logits, dim=-1) if normalize else torch.softmax(logits.float(), -1).gather(1, experts)
    return weights, experts
