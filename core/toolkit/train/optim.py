"""Optimizer (the registered ``--optimizer``) and learning-rate schedule (warmup + cosine/linear/constant)."""

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


def build_optimizer(named_params: list[tuple[str, Any]], recipe: Any, factory: Any = None) -> Any:
    """The recipe's ``--optimizer`` over ``(name, tensor)`` pairs. ``factory(params, recipe)`` is a
    tuner's own choice (toolkit-peft's ``--lora-optimizer``), used while ``--optimizer`` is the default."""
    from toolkit.plugins import get_plugin_manager
    from toolkit.recipe import thing_options

    if factory is not None and recipe.optimizer == "adamw":
        return factory([p for _, p in named_params], recipe)
    cls = get_plugin_manager().get("optimizer", recipe.optimizer)
    return cls(thing_options(recipe, cls)).build(named_params, recipe)


def build_scheduler(optimizer: Any, recipe: Any, total_steps: int) -> Any:
    import torch

    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, total_steps, recipe.warmup_steps, recipe.schedule, recipe.min_lr_ratio))


class MasterWeights:
    """bf16 model parameters with fp32 master copies that the optimizer updates (``--precision bf16``).

    Compute runs on bf16 weights and activations (no fp32 residual stream, as under autocast);
    gradients are accumulated into fp32 after every micro-batch, and the updated fp32 masters are
    written back to the bf16 parameters after each optimizer step.
    """

    def __init__(self, named_params: list[tuple[str, Any]]):
        self.names = [name for name, _ in named_params]
        self.params = [param for _, param in named_params]
        self.master = [param.detach().float().clone() for param in self.params]

    def accumulate_grads(self) -> None:
        for param, master in zip(self.params, self.master):
            if param.grad is None:
                continue
            grad = param.grad.float()
            master.grad = grad if master.grad is None else master.grad.add_(grad)
            param.grad = None

    def write_back(self) -> None:
        import torch

        with torch.no_grad():
            if self.params and hasattr(torch, "_foreach_copy_"):
                torch._foreach_copy_(self.params, self.master)  # one launch per dtype/device group, not per tensor
                return
            for param, master in zip(self.params, self.master):
                param.copy_(master)

    def copy_from_params(self) -> None:
        import torch

        with torch.no_grad():
            for param, master in zip(self.params, self.master):
                master.copy_(param)

    def state_dict(self) -> dict[str, Any]:
        return {name: master.detach().contiguous().cpu() for name, master in zip(self.names, self.master)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        import torch

        with torch.no_grad():
            for name, master in zip(self.names, self.master):
                master.copy_(state[name])
        self.write_back()


def cast_float_parameters(model: Any, dtype: Any) -> None:
    """Cast floating-point parameters (not buffers: RoPE frequencies stay fp32) to ``dtype``."""
    for param in model.parameters():
        if param.is_floating_point() and param.dtype != dtype and param.dtype.itemsize >= 2:
            param.data = param.data.to(dtype)


def decay_groups(named_params: list[tuple[str, Any]], weight_decay: float) -> list[dict[str, Any]]:
    """Weight decay on matrices only (not on norms, biases, DoRA magnitudes); empty groups dropped."""
    params = [p for _, p in named_params]
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def strategy_problems(optimizer: str, recipe: Any, strategies: tuple[str, ...]) -> list[str]:
    """``--optimizer`` is honoured by the engines that build it through the registry; the others
    (DeepSpeed's and Megatron's own optimizers) would silently train with AdamW."""
    if recipe.strategy in strategies or recipe.strategy == "auto":
        return []
    why = "which steps its own AdamW" if recipe.strategy in ("deepspeed", "megatron") else "its sharded DTensor parameters"
    return [f"--optimizer {optimizer} runs under --strategy {' or '.join(strategies)}, not {recipe.strategy} "
            f"({why}); choose --strategy {strategies[0]} or --optimizer adamw"]
