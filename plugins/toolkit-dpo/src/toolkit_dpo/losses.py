"""Preference losses (dpo, ipo, hinge, kto, simpo, orpo, cpo) and reward modeling (rm), as registered classes.

Each ``__call__`` returns the micro-batch's CONTRIBUTION to the step loss: a sum over its
pairs (or sequences) divided by the step's global count from :class:`~toolkit.contracts.StepContext`,
so contributions add up over micro-batches and data-parallel ranks. No strategy-specific code:
the losses read only :class:`~toolkit.contracts.TokenLogps`. Torch is imported inside the calls.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Literal

from toolkit.config import option
from toolkit.contracts import LossOutput, StepContext, TokenLogps


class _PreferenceLoss:
    """Shared plumbing: options, protocol class variables, the shape of ``__call__``."""

    name: ClassVar[str]
    Config: ClassVar[type]
    consumes: ClassVar[str] = "logps"
    needs_reference: ClassVar[bool] = False
    example_kinds: ClassVar[tuple[str, ...]] = ("preference",)
    train_on: ClassVar[str] = "assistant"

    def __init__(self, config=None):
        self.config = config or self.Config()
        check = getattr(self.config, "check", None)
        problems = check() if callable(check) else []
        if problems:
            from toolkit.errors import ConfigError

            raise ConfigError(problems, source=f"{self.name} options")

    def pairwise_output(self, per_pair, chosen_rewards, rejected_rewards, pairs, out: TokenLogps,
                        ctx: StepContext) -> LossOutput:
        """Per-pair losses and rewards -> the contribution, the metrics and the optional ``sft_weight`` term."""
        from toolkit_dpo import functional as fn

        loss = per_pair.sum() / max(ctx.examples, 1)
        metrics = fn.pair_metrics(chosen_rewards, rejected_rewards, pairs, ctx.examples)
        sft_weight = getattr(self.config, "sft_weight", 0.0)
        if sft_weight:
            nll = fn.chosen_nll(out, pairs, ctx)
            loss = loss + sft_weight * nll
            metrics["nll"] = nll.detach()
        return LossOutput(loss=loss, metrics=metrics)


def _check_beta(config) -> list[str]:
    return [f"beta must be positive, got {config.beta}"] if config.beta <= 0 else []


def _check_smoothing(config, upper: float = 1.0) -> list[str]:
    ok = 0.0 <= config.label_smoothing < upper
    return [] if ok else [f"label_smoothing must lie in [0, {upper}), got {config.label_smoothing}"]


@dataclasses.dataclass(kw_only=True)
class DPOConfig:
    beta: float = option(0.1, help="Strength of the KL penalty towards the reference model (higher: stay closer).")
    label_smoothing: float = option(0.0, help="Assumed rate of flipped preference labels: conservative DPO (sigmoid) "
                                              "or robust DPO (variant robust, must be < 0.5).")
    variant: Literal["sigmoid", "robust"] = option("sigmoid", help="sigmoid: DPO / conservative DPO; robust: "
                                                                   "Robust DPO, unbiased under label noise.")
    sft_weight: float = option(0.0, help="Weight of an extra cross-entropy term on the chosen responses (RPO alpha).")

    def check(self) -> list[str]:
        return _check_beta(self) + _check_smoothing(self, 0.5 if self.variant == "robust" else 1.0) + (
            [f"sft_weight must be 0 or more, got {self.sft_weight}"] if self.sft_weight < 0 else [])


class DPOLoss(_PreferenceLoss):
    """Direct Preference Optimization on chosen/rejected pairs (needs a reference model)."""

    name: ClassVar[str] = "dpo"
    Config: ClassVar[type] = DPOConfig
    needs_reference: ClassVar[bool] = True

    def logits(self, pairs, out: TokenLogps):
        """``(chosen log-ratio, rejected log-ratio)`` against the reference."""
        from toolkit_dpo import functional as fn

        ref = fn.reference_of(out, self.name)
        return pairs.chosen_logps - ref[pairs.chosen], pairs.rejected_logps - ref[pairs.rejected]

    def per_pair(self, chosen_ratio, rejected_ratio, pairs):
        from toolkit_dpo import functional as fn

        c = self.config
        delta = chosen_ratio - rejected_ratio
        if c.variant == "robust":
            return fn.robust_loss(delta, c.beta, c.label_smoothing)
        return fn.sigmoid_loss(delta, c.beta, c.label_smoothing)

    def __call__(self, out: TokenLogps, ctx: StepContext) -> LossOutput:
        from toolkit_dpo import functional as fn

        pairs = fn.Pairs.of(out)
        chosen_ratio, rejected_ratio = self.logits(pairs, out)
        beta = self.config.beta
        return self.pairwise_output(self.per_pair(chosen_ratio, rejected_ratio, pairs), beta * chosen_ratio,
                                    beta * rejected_ratio, pairs, out, ctx)


@dataclasses.dataclass(kw_only=True)
class IPOConfig:
    beta: float = option(0.1, help="IPO's regularisation tau: the target log-ratio margin is 1/(2*beta).")

    def check(self) -> list[str]:
        return _check_beta(self)


class IPOLoss(DPOLoss):
    """Identity Preference Optimization: squared loss on per-token-averaged log-ratios (needs a reference)."""

    name: ClassVar[str] = "ipo"
    Config: ClassVar[type] = IPOConfig

    def per_pair(self, chosen_ratio, rejected_ratio, pairs):
        from toolkit_dpo import functional as fn

        delta = chosen_ratio / pairs.chosen_tokens.clamp(min=1) - rejected_ratio / pairs.rejected_tokens.clamp(min=1)
        return fn.ipo_loss(delta, self.config.beta)


@dataclasses.dataclass(kw_only=True)
class HingeConfig:
    beta: float = option(0.1, help="Scale of the log-ratio margin; the loss is relu(1 - beta * margin).")

    def check(self) -> list[str]:
        return _check_beta(self)


class HingeLoss(DPOLoss):
    """SLiC-style hinge loss on the DPO log-ratio margin (needs a reference)."""

    name: ClassVar[str] = "hinge"
    Config: ClassVar[type] = HingeConfig

    def per_pair(self, chosen_ratio, rejected_ratio, pairs):
        from toolkit_dpo import functional as fn

        return fn.hinge_loss(chosen_ratio - rejected_ratio, self.config.beta)


@dataclasses.dataclass(kw_only=True)
class KTOConfig:
    beta: float = option(0.1, help="Strength of the KL penalty towards the reference model.")
    desirable_weight: float = option(1.0, help="Weight of the loss on desirable (label true / chosen) completions.")
    undesirable_weight: float = option(1.0, help="Weight of the loss on undesirable (label false / rejected) completions.")
    # The 'kto' dataset format shares this section (one name, one set of options).
    kl: bool = option(True, help="kto format: add a mismatched (prompt, previous record's completion) sequence per "
                                 "record to estimate KTO's KL reference point, as TRL does.")
    raw_text: bool = option(False, help="kto format: concatenate prompt and completion as plain text instead of "
                                        "applying the chat template (base models).")

    def check(self) -> list[str]:
        bad = [f"{k} must be positive, got {getattr(self, k)}" for k in ("desirable_weight", "undesirable_weight")
               if getattr(self, k) <= 0]
        return _check_beta(self) + bad


class KTOLoss(_PreferenceLoss):
    """Kahneman-Tversky Optimization on unpaired (prompt, completion, label) data or on preference pairs."""

    name: ClassVar[str] = "kto"
    Config: ClassVar[type] = KTOConfig
    needs_reference: ClassVar[bool] = True
    example_kinds: ClassVar[tuple[str, ...]] = ("unpaired", "preference")

    def __call__(self, out: TokenLogps, ctx: StepContext) -> LossOutput:
        import torch

        from toolkit_dpo import functional as fn

        c = self.config
        meta = out.sequence_meta
        logratios = out.sequence_sums() - fn.reference_of(out, self.name)
        kl_rows = meta["kto_kl"] > 0 if "kto_kl" in meta else torch.zeros_like(logratios, dtype=torch.bool)
        desirable = meta["kto_label"] > 0 if "kto_label" in meta else meta["roles"] == fn.CHOSEN
        scored = ~kl_rows
        # The reference point z0: mean log-ratio of mismatched (prompt, other completion) pairs, no gradient.
        kl = logratios[kl_rows].detach().mean().clamp(min=0) if bool(kl_rows.any()) else logratios.new_zeros(())
        losses = fn.kto_losses(logratios[scored], desirable[scored], kl, c.beta, c.desirable_weight, c.undesirable_weight)
        # Every example of a format holds the same number of scored sequences (1 for kto, 2 for pairs).
        local_examples = max(int(torch.unique(meta["example_ids"]).numel()), 1)
        total = max(ctx.examples, 1) * int(scored.sum()) / local_examples
        rewards = c.beta * logratios[scored].detach()
        good = desirable[scored]
        sums = out.sequence_sums().detach()[scored]
        metrics = {
            "kl": kl.detach() * int(scored.sum()) / total,
            "rewards/chosen": rewards[good].sum() / total,
            "rewards/rejected": rewards[~good].sum() / total,
            "rewards/margins": (rewards[good].sum() - rewards[~good].sum()) / total,
            "logps/chosen": sums[good].sum() / total,
            "logps/rejected": sums[~good].sum() / total,
            "kto/desirable_fraction": good.float().sum() / total,
        }
        return LossOutput(loss=losses.sum() / total, metrics=metrics)


@dataclasses.dataclass(kw_only=True)
class SimPOConfig:
    beta: float = option(2.0, help="Scale of the length-normalised reward.")
    gamma: float = option(0.5, help="Target reward margin between chosen and rejected.")
    label_smoothing: float = option(0.0, help="Assumed rate of flipped preference labels (conservative loss).")
    sft_weight: float = option(0.0, help="Weight of an extra cross-entropy term on the chosen responses (CPO-SimPO).")

    def check(self) -> list[str]:
        return _check_beta(self) + _check_smoothing(self)


class SimPOLoss(_PreferenceLoss):
    """SimPO: reference-free, length-normalised log-probs as rewards, with a target margin."""

    name: ClassVar[str] = "simpo"
    Config: ClassVar[type] = SimPOConfig

    def __call__(self, out: TokenLogps, ctx: StepContext) -> LossOutput:
        from toolkit_dpo import functional as fn

        c = self.config
        pairs = fn.Pairs.of(out)
        chosen, rejected = pairs.mean_logps()
        losses = fn.sigmoid_loss(chosen - rejected - c.gamma / c.beta, c.beta, c.label_smoothing)
        return self.pairwise_output(losses, c.beta * chosen, c.beta * rejected, pairs, out, ctx)


@dataclasses.dataclass(kw_only=True)
class ORPOConfig:
    beta: float = option(0.1, help="Weight (lambda) of the odds-ratio term added to the chosen cross-entropy.")

    def check(self) -> list[str]:
        return _check_beta(self)


class ORPOLoss(_PreferenceLoss):
    """ORPO: cross-entropy on chosen responses plus an odds-ratio preference term; no reference model."""

    name: ClassVar[str] = "orpo"
    Config: ClassVar[type] = ORPOConfig

    def __call__(self, out: TokenLogps, ctx: StepContext) -> LossOutput:
        from toolkit_dpo import functional as fn

        beta = self.config.beta
        pairs = fn.Pairs.of(out)
        chosen, rejected = pairs.mean_logps()
        ratio, log_odds = fn.odds_ratio(chosen, rejected)
        n = max(ctx.examples, 1)
        nll = fn.chosen_nll(out, pairs, ctx)
        loss = nll - beta * ratio.sum() / n
        metrics = fn.pair_metrics(beta * chosen, beta * rejected, pairs, ctx.examples)
        metrics.update({"nll": nll.detach(), "log_odds_ratio": ratio.detach().sum() / n,
                        "log_odds_chosen": log_odds.detach().sum() / n})
        return LossOutput(loss=loss, metrics=metrics)


@dataclasses.dataclass(kw_only=True)
class CPOConfig:
    beta: float = option(0.1, help="Temperature of the sigmoid preference term on summed log-probs.")
    label_smoothing: float = option(0.0, help="Assumed rate of flipped preference labels (conservative loss).")
    sft_weight: float = option(1.0, help="Weight (alpha) of the cross-entropy term on the chosen responses.")

    def check(self) -> list[str]:
        return _check_beta(self) + _check_smoothing(self)


class CPOLoss(_PreferenceLoss):
    """Contrastive Preference Optimization: reference-free DPO-style term plus chosen cross-entropy."""

    name: ClassVar[str] = "cpo"
    Config: ClassVar[type] = CPOConfig

    def __call__(self, out: TokenLogps, ctx: StepContext) -> LossOutput:
        from toolkit_dpo import functional as fn

        c = self.config
        pairs = fn.Pairs.of(out)
        losses = fn.sigmoid_loss(pairs.chosen_logps - pairs.rejected_logps, c.beta, c.label_smoothing)
        return self.pairwise_output(losses, c.beta * pairs.chosen_logps, c.beta * pairs.rejected_logps, pairs, out, ctx)


@dataclasses.dataclass(kw_only=True)
class RewardConfig:
    center_rewards_coefficient: float = option(0.0, help="Weight of a penalty on (chosen + rejected score)^2 that "
                                                         "keeps rewards centred on zero (0: off).")

    def check(self) -> list[str]:
        bad = self.center_rewards_coefficient < 0
        return [f"center_rewards_coefficient must be 0 or more, got {self.center_rewards_coefficient}"] if bad else []


class RewardLoss(_PreferenceLoss):
    """Reward modeling: a scalar score per sequence, Bradley-Terry loss on chosen/rejected pairs.

    An optional per-record ``margin`` column (sequence meta ``margin``) is subtracted from the
    score difference. Needs a strategy that provides per-sequence scores (``consumes = 'scores'``).
    """

    name: ClassVar[str] = "rm"
    Config: ClassVar[type] = RewardConfig
    consumes: ClassVar[str] = "scores"

    def __call__(self, out: TokenLogps, ctx: StepContext) -> LossOutput:
        import torch.nn.functional as F

        from toolkit.errors import ToolkitError
        from toolkit_dpo import functional as fn

        if out.scores is None:
            raise ToolkitError("loss 'rm' needs per-sequence scores from a value head, but the strategy passed none; "
                               "this strategy does not support reward modeling yet")
        chosen, rejected = fn.pair_indices(out.sequence_meta)
        scores = out.scores.float()
        diff = scores[chosen] - scores[rejected]
        if "margin" in out.sequence_meta:
            diff = diff - out.sequence_meta["margin"].to(scores.dtype)[chosen]
        n = max(ctx.examples, 1)
        loss = -F.logsigmoid(diff).sum() / n
        if self.config.center_rewards_coefficient:
            centre = (scores[chosen] + scores[rejected]) ** 2
            loss = loss + self.config.center_rewards_coefficient * centre.sum() / n
        margin = (scores[chosen] - scores[rejected]).detach()
        metrics = {"rewards/chosen": scores[chosen].detach().sum() / n, "rewards/rejected": scores[rejected].detach().sum() / n,
                   "rewards/margins": margin.sum() / n, "rewards/accuracies": (margin > 0).float().sum() / n}
        return LossOutput(loss=loss, metrics=metrics)


LOSSES = (DPOLoss, IPOLoss, HingeLoss, KTOLoss, SimPOLoss, ORPOLoss, CPOLoss, RewardLoss)
