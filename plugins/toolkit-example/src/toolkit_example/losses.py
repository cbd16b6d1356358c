"""Focal cross-entropy over label log-probabilities (Lin et al. 2017, "Focal Loss for Dense Object Detection").

Per label token with probability ``p = exp(logp)``: ``-(1 - p) ** gamma * logp``. Tokens the model
already predicts well weigh less; ``gamma = 0`` is plain cross-entropy (the ``sft`` loss).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from toolkit.config import option
from toolkit.contracts import LossOutput, StepContext, TokenLogps


@dataclasses.dataclass(kw_only=True)
class FocalConfig:
    gamma: float = option(2.0, help="Focusing strength; 0 gives plain cross-entropy.")
    detach_weight: bool = option(False, help="Treat (1 - p)^gamma as a constant in the backward pass.")

    def check(self) -> list[str]:
        return [] if self.gamma >= 0 else [f"gamma must be 0 or more, got {self.gamma}"]


class FocalLoss:
    """Supervised fine-tuning with focal cross-entropy: down-weights tokens the model already gets right."""

    name: ClassVar[str] = "focal"
    Config: ClassVar[type] = FocalConfig
    consumes: ClassVar[str] = "logps"          # per-token label log-probs, from any strategy
    needs_reference: ClassVar[bool] = False    # no frozen reference model
    example_kinds: ClassVar[tuple[str, ...]] = ("lm",)  # plain (prompt, completion) examples
    train_on: ClassVar[str] = "assistant"      # which tokens carry labels: assistant replies only

    def __init__(self, config: FocalConfig | None = None):
        self.config = config or FocalConfig()

    def __call__(self, out: TokenLogps, ctx: StepContext) -> LossOutput:
        import torch

        # Loss contract: return this micro-batch's CONTRIBUTION to the step loss, normalised by
        # the step's global label-token count, so micro-batches and DP ranks sum to the step loss.
        mask = out.mask.to(out.logps.dtype)
        # 1 - p as -expm1(logp): exact near p = 1; the clamp keeps a fractional gamma's gradient
        # finite where p = 1 (padding has logp = 0).
        weight = (-torch.expm1(out.logps)).clamp(min=1e-12) ** self.config.gamma
        if self.config.detach_weight:
            weight = weight.detach()
        tokens = max(ctx.label_tokens, 1)
        loss = -(weight * out.logps * mask).sum() / tokens
        metrics = {
            "nll": (-(out.logps * mask).sum() / tokens).detach(),  # plain cross-entropy, for comparison
            "focal_weight": ((weight * mask).sum() / tokens).detach(),
        }
        return LossOutput(loss=loss, metrics=metrics)
