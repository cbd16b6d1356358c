"""Tensor math of the preference losses: pairing sequences, per-sequence statistics, objectives.

Imported lazily by :mod:`toolkit_dpo.losses` (it imports torch). Every function returns
per-pair (or per-sequence) values; the loss classes turn them into step contributions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from toolkit.contracts import StepContext, TokenLogps
from toolkit.errors import ToolkitError

CHOSEN, REJECTED = 0, 1


class PairingError(ToolkitError):
    """A micro-batch whose sequences do not form chosen/rejected pairs."""


def pair_indices(meta: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices of chosen and rejected sequences, aligned so position k of both is one example."""
    if "example_ids" not in meta or "roles" not in meta:
        raise PairingError("the micro-batch has no sequence_meta['example_ids'] / ['roles']; a preference loss needs "
                           "the 'preference' dataset format (prompt/chosen/rejected records)")
    examples, roles = meta["example_ids"], meta["roles"]
    chosen = torch.nonzero(roles == CHOSEN).flatten()
    rejected = torch.nonzero(roles == REJECTED).flatten()
    chosen = chosen[torch.argsort(examples[chosen], stable=True)]
    rejected = rejected[torch.argsort(examples[rejected], stable=True)]
    ok = (chosen.numel() == rejected.numel() and torch.equal(examples[chosen], examples[rejected])
          and torch.unique(examples[chosen]).numel() == chosen.numel())
    if not ok:
        raise PairingError(f"the micro-batch does not hold complete chosen/rejected pairs ({chosen.numel()} chosen, "
                           f"{rejected.numel()} rejected sequences); every example's sequences must share one micro-batch")
    return chosen, rejected


def reference_of(out: TokenLogps, loss_name: str) -> torch.Tensor:
    """The ``[num_sequences]`` summed reference log-probs the engine attached to this micro-batch."""
    ref = out.reference_logps if out.reference_logps is not None else out.sequence_meta.get("reference_logps")
    if ref is None:
        raise ToolkitError(f"loss {loss_name!r} needs reference log-probs, but the strategy passed none. The strategy "
                           "must compute them for losses with needs_reference=True (frozen copy, adapter-disabled base "
                           "or a precomputed cache); use a reference-free loss (simpo, orpo, cpo) otherwise.")
    return ref.to(out.logps.dtype).detach()


@dataclass
class Pairs:
    """Per-pair tensors of one micro-batch (``[pairs]`` each)."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    chosen_logps: torch.Tensor
    rejected_logps: torch.Tensor
    chosen_tokens: torch.Tensor
    rejected_tokens: torch.Tensor
    sums: torch.Tensor
    """``[num_sequences]`` summed label log-probs (all sequences)."""

    @classmethod
    def of(cls, out: TokenLogps) -> Pairs:
        chosen, rejected = pair_indices(out.sequence_meta)
        sums = out.sequence_sums()
        tokens = out.sequence_token_counts()
        return cls(chosen, rejected, sums[chosen], sums[rejected], tokens[chosen], tokens[rejected], sums)

    def mean_logps(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Length-normalised (per-token average) log-probs of chosen and rejected."""
        return self.chosen_logps / self.chosen_tokens.clamp(min=1), self.rejected_logps / self.rejected_tokens.clamp(min=1)


def chosen_nll(out: TokenLogps, pairs: Pairs, ctx: StepContext) -> torch.Tensor:
    """Cross-entropy on the chosen responses as a step contribution: token mean over all chosen tokens of the step.

    Needs the step's chosen label-token count (``ctx.counts['chosen_label_tokens']``); when the engine
    does not provide it, each chosen sequence is averaged over its own tokens and then over examples.
    """
    counts = getattr(ctx, "counts", None) or {}
    total = counts.get("chosen_label_tokens")
    if total:
        return -pairs.chosen_logps.sum() / total
    return -(pairs.chosen_logps / pairs.chosen_tokens.clamp(min=1)).sum() / max(ctx.examples, 1)


def sigmoid_loss(logits: torch.Tensor, beta: float, label_smoothing: float = 0.0) -> torch.Tensor:
    """DPO's logistic loss; with ``label_smoothing`` the conservative (cDPO) mixture."""
    return -(1 - label_smoothing) * F.logsigmoid(beta * logits) - label_smoothing * F.logsigmoid(-beta * logits)


def robust_loss(logits: torch.Tensor, beta: float, label_smoothing: float) -> torch.Tensor:
    """Robust DPO (Chowdhury et al. 2024): unbiased under preference flips of rate ``label_smoothing``."""
    clean = -(1 - label_smoothing) * F.logsigmoid(beta * logits)
    flipped = -label_smoothing * F.logsigmoid(-beta * logits)
    return (clean - flipped) / (1 - 2 * label_smoothing)


def hinge_loss(logits: torch.Tensor, beta: float) -> torch.Tensor:
    return torch.relu(1 - beta * logits)


def ipo_loss(logits: torch.Tensor, beta: float) -> torch.Tensor:
    """IPO (Azar et al. 2023, eq. 17) on per-token-averaged log-ratios; ``beta`` is the paper's tau."""
    return (logits - 1 / (2 * beta)) ** 2


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(x))`` for ``x < 0``, stable on both sides of ``-log 2``."""
    return torch.where(x > -0.6931471805599453, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def odds_ratio(chosen_mean: torch.Tensor, rejected_mean: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ORPO's ``(log sigmoid(log odds ratio), log odds ratio)`` from per-token-averaged log-probs."""
    log_odds = (chosen_mean - rejected_mean) - (log1mexp(chosen_mean) - log1mexp(rejected_mean))
    return F.logsigmoid(log_odds), log_odds


def kto_losses(logratios: torch.Tensor, desirable: torch.Tensor, kl: torch.Tensor, beta: float,
               desirable_weight: float, undesirable_weight: float) -> torch.Tensor:
    """KTO (Ethayarajh et al. 2024, eq. 7) per sequence, against the detached reference point ``kl``."""
    good = desirable_weight * (1 - torch.sigmoid(beta * (logratios - kl)))
    bad = undesirable_weight * (1 - torch.sigmoid(beta * (kl - logratios)))
    return torch.where(desirable, good, bad)


def pair_metrics(chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor, pairs: Pairs,
                 examples: int) -> dict[str, torch.Tensor]:
    """The metrics users expect, as contributions (sums over this micro-batch's pairs / the step's examples)."""
    n = max(examples, 1)
    chosen_rewards, rejected_rewards = chosen_rewards.detach(), rejected_rewards.detach()
    return {
        "rewards/chosen": chosen_rewards.sum() / n,
        "rewards/rejected": rejected_rewards.sum() / n,
        "rewards/margins": (chosen_rewards - rejected_rewards).sum() / n,
        "rewards/accuracies": (chosen_rewards > rejected_rewards).float().sum() / n,
        "logps/chosen": pairs.chosen_logps.detach().sum() / n,
        "logps/rejected": pairs.rejected_logps.detach().sum() / n,
    }
