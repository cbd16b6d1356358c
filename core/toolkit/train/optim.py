"""Optimizer and learning-rate schedule from the recipe (AdamW, warmup + cosine/linear/constant)."""

from __future__ import annotations

import math
from typing import Any


def lr_factor(step: int, total: int, warmup: int, schedule: str, min_ratio: float) -> float:
    """Multiplier of the peak learning rate at ``step`` (0-based) of ``total`` steps."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant" or total <= warmup:
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if schedule == "linear":
        decay = 1.0 - progress
    else:
        decay = 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_ratio + (1.0 - min_ratio) * decay


def build_optimizer(params: list[Any], recipe: Any, factory: Any = None) -> Any:
    import torch

    if factory is not None:
        return factory(params, recipe)
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": recipe.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=recipe.lr, betas=(recipe.adam_beta1, recipe.adam_beta2),
                             eps=recipe.adam_eps)


def build_scheduler(optimizer: Any, recipe: Any, total_steps: int) -> Any:
    import torch

    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, total_steps, recipe.warmup_steps, recipe.schedule, recipe.min_lr_ratio))
