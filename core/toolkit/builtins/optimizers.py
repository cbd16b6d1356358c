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
    # Under FSDP2 the parameters are DTensors sharded on rows: ShardedAdafactor steps the local rows with
    # the column statistics and norms all-reduced, so the steps are torch's full-matrix Adafactor (tested).
    strategies: ClassVar[tuple[str, ...]] = ("local", "fsdp")

    def __init__(self, config: Any = None):
        self.config = config or self.Config()

    def validate(self, recipe: Any) -> list[str]:
        return strategy_problems(self.name, recipe, self.strategies)

    def build(self, named_params: list[tuple[str, Any]], recipe: Any) -> Any:
        import torch

        sharded = any(is_dtensor(p) for _, p in named_params)
        cls = sharded_adafactor() if sharded else torch.optim.Adafactor
        return cls(decay_groups(named_params, recipe.weight_decay), lr=recipe.lr,
                                     beta2_decay=self.config.beta2_decay, eps=(None, self.config.eps),
                                     d=self.config.clip_threshold)


def is_dtensor(tensor: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def _adafactor_class() -> type:
    import torch

    class ShardedAdafactor(torch.optim.Adafactor):
        """torch's Adafactor (its ``_single_tensor_adafactor``, step for step) on FSDP2 parameters: DTensors
        sharded on dim 0 (rows) over a 1-D mesh, plain tensors stepped by torch's own code.

        Each rank holds whole rows, so the row statistics (mean of g^2 over the columns) are local; the column
        statistics (mean of g^2 over all rows), the mean of the row statistics, the weight's RMS and the
        update's RMS are sums over every row: they are all-reduced. The result is the full-matrix optimizer,
        not a per-shard factorisation. State: ``row_var`` and ``variance`` sharded like the weight,
        ``col_var`` replicated; all DTensors, so FSDP checkpoints save and reshard them.
        """

        @torch.no_grad()
        def step(self, closure: Any = None) -> Any:
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            plain = []
            for group in self.param_groups:
                dense = [p for p in group["params"] if not is_dtensor(p)]
                if dense:
                    plain.append((group, dense))
                for param in group["params"]:
                    if param.grad is not None and is_dtensor(param):
                        self._step_sharded(param, group)
            if plain:  # torch's own step over the non-DTensor parameters, group by group
                for group, dense in plain:
                    saved = group["params"]
                    group["params"] = dense
                    try:
                        super().step()
                    finally:
                        group["params"] = saved
            return loss

        def _step_sharded(self, param: Any, group: dict[str, Any]) -> None:
            import torch.distributed as dist
            from torch.distributed.tensor import DTensor, Replicate, Shard

            if param.grad.is_complex() or len(param.placements) != 1 or param.placements[0] != Shard(0):
                raise NotImplementedError(f"adafactor on a DTensor supports one Shard(0) placement, got {param.placements}")
            mesh, pg = param.device_mesh, param.device_mesh.get_group()

            def total(value: Any) -> Any:  # a sum over every rank's rows
                if value.device.type != mesh.device_type:  # --fsdp-cpu-offload: CPU shards, NCCL collectives
                    moved = value.to(mesh.device_type)
                    dist.all_reduce(moved, group=pg)
                    return value.copy_(moved)
                dist.all_reduce(value, group=pg)
                return value

            local, grad = param.to_local(), param.grad.to_local()
            if group["maximize"]:
                grad = -grad
            state = self.state[param]
            if not state:
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                if grad.dim() > 1:
                    row_shape = (*param.shape[:-1], 1)
                    state["row_var"] = DTensor.from_local(  # sharded like the weight (FSDP2's chunks may be uneven)
                        grad.new_zeros((*grad.shape[:-1], 1)), mesh, [Shard(0)], run_check=False, shape=row_shape,
                        stride=torch.empty(row_shape, device="meta").stride())
                    col = torch.zeros([*param.shape[:-2], 1, param.shape[-1]], dtype=grad.dtype, device=grad.device)
                    state["col_var"] = DTensor.from_local(col, mesh, [Replicate()], run_check=False)
                else:
                    state["variance"] = torch.zeros_like(param.grad)
            eps1, eps2 = group["eps"]
            eps1 = torch.finfo(param.dtype).eps if eps1 is None else eps1
            lr, d, weight_decay = float(group["lr"]), group["d"], group["weight_decay"]
            state["step"] += 1
            step = state["step"].item()
            one_minus_beta2 = step ** group["beta2_decay"]
            rho = min(lr, 1 / step ** 0.5)
            weight_rms = total(local.float().square().sum()).sqrt().item() / param.numel() ** 0.5
            alpha = max(eps2, weight_rms) * rho
            if weight_decay != 0:
                local.mul_(1 - lr * weight_decay)
            if grad.dim() > 1:
                row_var, col_var = state["row_var"].to_local(), state["col_var"].to_local()
                row_var.lerp_(grad.square().sum(-1, keepdim=True).div_(grad.size(-1)), one_minus_beta2)
                col_sum = grad.square().sum(-2, keepdim=True)
                if grad.dim() == 2:  # dim 0 is the sharded one: the column sums run over every rank's rows
                    total(col_sum)
                col_var.lerp_(col_sum.div_(param.shape[-2]), one_minus_beta2)
                row_mean = row_var.sum(-2, keepdim=True)
                if grad.dim() == 2:
                    total(row_mean)
                estimate = (row_var @ col_var).div_(row_mean.div_(param.shape[-2]).clamp_(min=eps1))
            else:
                variance = state["variance"].to_local()
                variance.lerp_(grad * grad, one_minus_beta2)
                estimate = variance.clone()
            update = estimate.clamp_(min=eps1 * eps1).rsqrt_().mul_(grad)
            update_rms = total(update.square().sum()).sqrt().item() / param.numel() ** 0.5
            local.add_(update, alpha=-alpha / max(1.0, update_rms / d))

    return ShardedAdafactor


_SHARDED_ADAFACTOR: list[type] = []


def sharded_adafactor() -> type:
    """The ShardedAdafactor class (it subclasses torch's, so it is built on first use: torch imports lazily)."""
    if not _SHARDED_ADAFACTOR:
        _SHARDED_ADAFACTOR.append(_adafactor_class())
    return _SHARDED_ADAFACTOR[0]


@hookimpl
def toolkit_register_optimizers(register):
    register(AdamW)
    register(Adafactor)
