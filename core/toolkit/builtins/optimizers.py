"""Core built-in plugin: the ``adamw`` and ``adafactor`` optimizers (``--optimizer``), both torch's own."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from toolkit import hookimpl
from toolkit.config import option
from toolkit.train.optim import decay_groups, strategy_problems


@dataclasses.dataclass(kw_only=True)
class AdamWConfig:
    """torch.optim.AdamW with the recipe's --lr, --adam-beta1/2, --adam-eps and --weight-decay."""


class AdamW:
    """torch's AdamW (fused on CUDA): two fp32 moments per trained parameter."""

    name: ClassVar[str] = "adamw"
    Config: ClassVar[type] = AdamWConfig

    def __init__(self, config: Any = None):
        self.config = config or self.Config()

    def validate(self, recipe: Any) -> list[str]:
        return []

    def build(self, named_params: list[tuple[str, Any]], recipe: Any) -> Any:
        import torch

        fused = all(p.is_cuda for _, p in named_params)  # one kernel over all tensors on GPU: the step is memory-bound
        return torch.optim.AdamW(decay_groups(named_params, recipe.weight_decay), lr=recipe.lr,
                                 betas=(recipe.adam_beta1, recipe.adam_beta2), eps=recipe.adam_eps, fused=fused or None)


@dataclasses.dataclass(kw_only=True)
class AdafactorConfig:
    beta2_decay: float = option(-0.8, help="Decay rate of the second moment: beta2 at step t is 1 - t**beta2_decay.")
    eps: float = option(1e-3, help="Relative step floor (Adafactor's epsilon2): updates are at least eps x the weight's RMS.")
    clip_threshold: float = option(1.0, help="Clip each update's RMS to this (Adafactor's d).")

    def check(self) -> list[str]:
        problems = []
        if not self.beta2_decay <= 0:
            problems.append(f"adafactor beta2_decay must be 0 or negative, got {self.beta2_decay}")
        if not self.eps > 0 or not self.clip_threshold > 0:
            problems.append(f"adafactor eps and clip_threshold must be positive, got {self.eps} and {self.clip_threshold}")
        return problems


class Adafactor:
    """torch.optim.Adafactor: factored second moments (a row and a column vector per matrix), no first
    moment, so optimizer state is O(rows + columns) instead of 2 x rows x columns."""

    name: ClassVar[str] = "adafactor"
    Config: ClassVar[type] = AdafactorConfig
    # torch's Adafactor runs in-place norms that DTensor cannot keep sharded (FSDP2 fails inside step()),
    # and a per-shard factorisation would be another optimizer.
    strategies: ClassVar[tuple[str, ...]] = ("local",)

    def __init__(self, config: Any = None):
        self.config = config or self.Config()

    def validate(self, recipe: Any) -> list[str]:
        return strategy_problems(self.name, recipe, self.strategies)

    def build(self, named_params: list[tuple[str, Any]], recipe: Any) -> Any:
        import torch

        return torch.optim.Adafactor(decay_groups(named_params, recipe.weight_decay), lr=recipe.lr,
                                     beta2_decay=self.config.beta2_decay, eps=(None, self.config.eps),
                                     d=self.config.clip_threshold)


@hookimpl
def toolkit_register_optimizers(register):
    register(AdamW)
    register(Adafactor)
