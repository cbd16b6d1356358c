"""A test plugin that makes chosen samples produce a non-finite loss or gradient.

Records with ``"poison": "loss"`` add a constant NaN to the loss (gradients stay finite);
``"poison": "grad"`` keeps the loss finite and makes its gradient infinite; ``"exit"`` ends the
process that meets the sample (a dead rank) and ``"hang"`` makes it sleep for an hour. Use
``--dataset-format poisoned --loss nan-sft``. Loaded in-process or as an installed
distribution (``toolkit.testing.write_plugin_distribution``) for subprocess runs.
"""

from __future__ import annotations

import os
import time
from typing import Any, ClassVar

from toolkit import hookimpl
from toolkit.builtins.formats import Messages
from toolkit.builtins.losses import SFTLoss
from toolkit.contracts import Example, LossOutput

POISON = {"loss": 1.0, "grad": 2.0, "exit": 3.0, "hang": 4.0}


class PoisonedMessages(Messages):
    name: ClassVar[str] = "poisoned"

    def encode(self, record: dict[str, Any], tokenizer: Any, template: Any, where: str = "record") -> Example:
        kind = record.pop("poison", None)
        example = super().encode(record, tokenizer, template, where=where)
        if kind:
            for seq in example.sequences:
                seq.meta["poison"] = POISON[kind]
        return example


def _infinite_gradient(loss: Any) -> Any:
    import torch

    class InfiniteGradient(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            return grad * float("inf")

    return InfiniteGradient.apply(loss)


class NanSFTLoss(SFTLoss):
    """SFT whose poisoned samples make the step non-finite."""

    name: ClassVar[str] = "nan-sft"

    def __call__(self, out, ctx) -> LossOutput:
        result = super().__call__(out, ctx)
        poison = out.sequence_meta.get("poison")
        loss = result.loss
        if poison is not None and bool((poison == POISON["loss"]).any()):
            loss = loss + float("nan")
        if poison is not None and bool((poison == POISON["grad"]).any()):
            loss = _infinite_gradient(loss)
        if poison is not None and bool((poison == POISON["exit"]).any()):
            os._exit(3)
        if poison is not None and bool((poison == POISON["hang"]).any()):
            time.sleep(3600)
        return LossOutput(loss=loss, metrics=result.metrics)


@hookimpl
def toolkit_register_dataset_formats(register):
    register(PoisonedMessages)


@hookimpl
def toolkit_register_losses(register):
    register(NanSFTLoss)
