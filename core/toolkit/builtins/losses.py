"""Core built-in plugin: the ``pt`` and ``sft`` objectives (token-averaged cross-entropy on label log-probs)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from toolkit import hookimpl
from toolkit.contracts import LossOutput, StepContext, TokenLogps


@dataclasses.dataclass(kw_only=True)
class CrossEntropyConfig:
    """Cross-entropy has no options: it is normalised by the step's global label-token count."""


class SFTLoss:
    """Supervised fine-tuning: cross-entropy on assistant tokens only."""

    name: ClassVar[str] = "sft"
    Config: ClassVar[type] = CrossEntropyConfig
    consumes: ClassVar[str] = "logps"
    needs_reference: ClassVar[bool] = False
    example_kinds: ClassVar[tuple[str, ...]] = ("lm",)
    train_on: ClassVar[str] = "assistant"
    uniform_token_gradient: ClassVar[bool] = True
    """d loss / d logp is ``-1 / label_tokens`` for every label: engines may fuse the head's gradient into forward."""

    def __init__(self, config: CrossEntropyConfig | None = None):
        self.config = config or CrossEntropyConfig()

    def __call__(self, out: TokenLogps, ctx: StepContext) -> LossOutput:
        summed = -(out.logps * out.mask).sum()
        loss = summed / max(ctx.label_tokens, 1)
        return LossOutput(loss=loss, metrics={"nll": loss.detach()})


class PTLoss(SFTLoss):
    """Continued pre-training: cross-entropy on every token."""

    name: ClassVar[str] = "pt"
    train_on: ClassVar[str] = "all"


@hookimpl
def toolkit_register_losses(register):
    register(PTLoss)
    register(SFTLoss)
