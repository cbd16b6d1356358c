"""``--optimizer adamw-8bit`` (bitsandbytes' block-wise 8-bit AdamW) and ``--optimizer galore``
(galore-torch's GaLoreAdamW: AdamW on a low-rank projection of each matrix's gradient).

Both are the libraries' own optimizers; what lives here is the recipe -> constructor mapping, the
choice of which matrices GaLore projects, and a tensor-only form of GaLore's projector state so a
checkpoint loads with ``weights_only`` (galore-torch keeps a Python object in the state).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, ClassVar, Literal

from toolkit.config import option
from toolkit.errors import ToolkitError
from toolkit.plugins import install_hint
from toolkit.train.optim import decay_groups, strategy_problems


def require(module: str, package: str, extra: str, what: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ToolkitError(f"{what} needs {package}, which is not importable ({exc}); install it with: "
                           f"{install_hint('toolkit-optim', extra)}") from None


def missing(module: str, package: str, extra: str, what: str) -> list[str]:
    import importlib.util

    if importlib.util.find_spec(module) is None:
        return [f"{what} needs {package}, which is not installed: {install_hint('toolkit-optim', extra)}"]
    return []


CPU_8BIT_OPTIMIZER = "0.50"
"""bitsandbytes' 8-bit optimizer kernels run on CPU from 0.50.0; before, on CUDA and XPU only."""


def bitsandbytes_cpu_problems(what: str) -> list[str]:
    """On a machine without a CUDA GPU: a bitsandbytes too old to run its 8-bit optimizer there, named with its
    version, before the model loads (older versions fail inside the first step)."""
    import importlib.metadata

    import torch
    from packaging.version import Version

    if torch.cuda.is_available():
        return []
    try:
        installed = importlib.metadata.version("bitsandbytes")
    except importlib.metadata.PackageNotFoundError:
        return []  # `missing` names the install command
    if Version(installed) >= Version(CPU_8BIT_OPTIMIZER):
        return []
    return [f"{what} without a CUDA GPU needs bitsandbytes >= {CPU_8BIT_OPTIMIZER} (its 8-bit optimizer runs on CPU "
            f"since 0.50.0), but {installed} is installed: pip install -U 'bitsandbytes>={CPU_8BIT_OPTIMIZER}', or "
            "use --optimizer adamw or adafactor here"]


@dataclasses.dataclass(kw_only=True)
class AdamW8bitConfig:
    min_8bit_size: int = option(4096, help="Tensors with fewer elements keep 32-bit states (bitsandbytes' default).")

    def check(self) -> list[str]:
        return [] if self.min_8bit_size >= 0 else [f"adamw-8bit min_8bit_size must be 0 or more, got {self.min_8bit_size}"]


class AdamW8bit:
    """bitsandbytes.optim.AdamW8bit: both moments stored in 8 bits (block-wise quantised), 2 bytes per
    parameter instead of 8. Runs on CUDA and, with bitsandbytes >= 0.50, on CPU."""

    name: ClassVar[str] = "adamw-8bit"
    Config: ClassVar[type] = AdamW8bitConfig
    # FSDP2 hands the optimizer DTensor shards, which bitsandbytes' kernels do not take: sharded_adamw_8bit
    # steps each rank's local shard with bitsandbytes' kernel (block-wise state is per block, so on a shard
    # it is 8-bit AdamW of that shard) and keeps the state as DTensors, so FSDP checkpoints save every rank's.
    strategies: ClassVar[tuple[str, ...]] = ("local", "fsdp")

    def __init__(self, config: Any = None):
        self.config = config or self.Config()

    def validate(self, recipe: Any) -> list[str]:
        return (strategy_problems(self.name, recipe, self.strategies)
                + missing("bitsandbytes", "bitsandbytes", "bnb", f"--optimizer {self.name}")
                + bitsandbytes_cpu_problems(f"--optimizer {self.name}"))

    def build(self, named_params: list[tuple[str, Any]], recipe: Any) -> Any:
        bnb = require("bitsandbytes", "bitsandbytes", "bnb", f"--optimizer {self.name}")
        from torch.distributed.tensor import DTensor

        sharded = any(isinstance(p, DTensor) for _, p in named_params)
        return (sharded_adamw_8bit(bnb) if sharded else bnb.optim.AdamW8bit)(decay_groups(named_params, recipe.weight_decay), lr=recipe.lr,
                                   betas=(recipe.adam_beta1, recipe.adam_beta2), eps=recipe.adam_eps,
                                   min_8bit_size=self.config.min_8bit_size)


@dataclasses.dataclass(kw_only=True)
class GaLoreConfig:
    rank: int = option(128, help="Rank of the gradient projection (the paper: 128 for 60M-350M models, 512 for 1B, 1024 for 7B).")
    update_proj_gap: int = option(200, help="Steps between recomputing each projection (an SVD of the gradient).")
    scale: float = option(0.25, help="Scale of the projected-back update (the paper's alpha).")
    proj_type: Literal["std", "reverse_std", "right", "left", "full"] = option(
        "std", help="Which side is projected: std projects the shorter side (galore-torch's choice).")
    targets: str = option(r"\.(self_attn|mlp)\.", help="Regex of parameter names whose matrices are projected; the "
                                                       "rest (embeddings, head, norms) train with plain AdamW.")

    def check(self) -> list[str]:
        problems = [f"galore {name} must be at least 1, got {getattr(self, name)}"
                    for name in ("rank", "update_proj_gap") if getattr(self, name) < 1]
        try:
            re.compile(self.targets)
        except re.error as exc:
            problems.append(f"--galore-targets {self.targets!r} is not a valid regex: {exc}")
        return problems


class GaLore:
    """galore_torch.GaLoreAdamW: matrices matching ``--galore-targets`` keep AdamW moments of their
    ``rank``-dimensional projected gradient; everything else is plain AdamW."""

    name: ClassVar[str] = "galore"
    Config: ClassVar[type] = GaLoreConfig
    # Under FSDP2 the gradients are DTensor shards: DTensor gathers a matrix for the SVD (every
    # update_proj_gap steps) and keeps the projections' placements, so the steps equal one process's (tested).
    strategies: ClassVar[tuple[str, ...]] = ("local", "fsdp")

    def __init__(self, config: Any = None):
        self.config = config or self.Config()

    def validate(self, recipe: Any) -> list[str]:
        return (strategy_problems(self.name, recipe, self.strategies)
                + missing("galore_torch", "galore-torch", "galore", f"--optimizer {self.name}"))

    def param_groups(self, named_params: list[tuple[str, Any]], weight_decay: float) -> list[dict[str, Any]]:
        pattern = re.compile(self.config.targets)
        projected = [(n, p) for n, p in named_params if p.ndim == 2 and pattern.search(n)]
        if not projected:
            raise ToolkitError(f"--optimizer galore: no trained matrix matches --galore-targets {self.config.targets!r} "
                               f"(first trained names: {', '.join(n for n, _ in named_params[:3])}); nothing would be projected")
        ids = {id(p) for _, p in projected}
        groups = decay_groups([(n, p) for n, p in named_params if id(p) not in ids], weight_decay)
        c = self.config
        groups.append({"params": [p for _, p in projected], "weight_decay": weight_decay, "rank": c.rank,
                       "update_proj_gap": c.update_proj_gap, "scale": c.scale, "proj_type": c.proj_type})
        return groups

    def build(self, named_params: list[tuple[str, Any]], recipe: Any) -> Any:
        galore_torch = require("galore_torch", "galore-torch", "galore", f"--optimizer {self.name}")
        optimizer = galore_torch.GaLoreAdamW(self.param_groups(named_params, recipe.weight_decay), lr=recipe.lr,
                                             betas=(recipe.adam_beta1, recipe.adam_beta2), eps=recipe.adam_eps,
                                             no_deprecation_warning=True)
        optimizer.register_state_dict_post_hook(projectors_as_tensors)
        optimizer.register_load_state_dict_post_hook(projectors_from_tensors)
        return optimizer


PROJECTION = "galore_projection"


def projectors_as_tensors(optimizer: Any, state_dict: dict[str, Any]) -> dict[str, Any]:
    """Replace each GaLoreProjector object by its projection matrix (or the pair, for ``full``): the
    rest of the projector (rank, gap, scale, type) is in the parameter group."""
    state = {}
    for index, entry in state_dict["state"].items():
        entry = dict(entry)
        projector = entry.pop("projector", None)
        if projector is not None:
            matrix = projector.ortho_matrix
            entry[PROJECTION] = list(matrix) if isinstance(matrix, (list, tuple)) else matrix
        state[index] = entry
    return {**state_dict, "state": state}


def projectors_from_tensors(optimizer: Any) -> None:
    from galore_torch.galore_projector import GaLoreProjector

    for group in optimizer.param_groups:
        if "rank" not in group:
            continue
        for param in group["params"]:
            entry = optimizer.state.get(param)
            if not entry or PROJECTION not in entry:
                continue
            projector = GaLoreProjector(group["rank"], update_proj_gap=group["update_proj_gap"], scale=group["scale"],
                                        proj_type=group["proj_type"])
            projector.ortho_matrix = entry.pop(PROJECTION)
            entry["projector"] = projector


def sharded_adamw_8bit(bnb: Any) -> type:
    """bitsandbytes' AdamW8bit over FSDP2 parameters (DTensors sharded on dim 0).

    Each step runs bitsandbytes' own ``init_state``/``update_step`` on the rank's local shard (a plain tensor
    sharing the DTensor's storage, with the local gradient). Its 8-bit moments are quantised in blocks of 256
    elements with one absmax per block, so the state of a shard is the block-wise 8-bit AdamW state of those
    elements; where a shard starts on a block boundary of the whole tensor (every shard of a matrix whose
    per-rank element count is a multiple of 256) the blocks, and so the steps, are the unsharded optimizer's.
    The state is stored as DTensors (moments sharded like the weight, absmax sharded by blocks, the quantisation
    maps replicated) so that FSDP's distributed checkpoints save and reload every rank's part.
    """
    import torch
    from torch.distributed.tensor import DTensor, Replicate, Shard

    class ShardedAdamW8bit(bnb.optim.AdamW8bit):
        @staticmethod
        def _local(param: Any) -> Any:
            local = param.to_local()
            local.grad = param.grad.to_local()
            return local

        def _wrap(self, param: Any, state: dict[str, Any]) -> dict[str, Any]:
            mesh, world = param.device_mesh, param.device_mesh.size()
            wrapped = {}
            for key, value in state.items():
                if not isinstance(value, torch.Tensor) or isinstance(value, DTensor):
                    wrapped[key] = value
                elif key.startswith("qmap") or key == "unorm_vec":
                    wrapped[key] = DTensor.from_local(value, mesh, [Replicate()], run_check=False)
                elif value.shape == param.to_local().shape:
                    wrapped[key] = DTensor.from_local(value, mesh, [Shard(0)], run_check=False, shape=param.shape,
                                                      stride=param.stride())
                else:  # absmax: one per block of the local shard, the same count on every rank (checked)
                    wrapped[key] = DTensor.from_local(value, mesh, [Shard(0)], run_check=False,
                                                      shape=(value.shape[0] * world,), stride=(1,))
            return wrapped

        @staticmethod
        def _unwrap(state: dict[str, Any]) -> dict[str, Any]:
            return {k: v.to_local() if isinstance(v, DTensor) else v for k, v in state.items()}

        @torch.no_grad()
        def init_state(self, group: Any, p: Any, gindex: int, pindex: int) -> None:
            if not isinstance(p, DTensor):
                return super().init_state(group, p, gindex, pindex)
            if len(p.placements) != 1 or p.placements[0] != Shard(0) or p.shape[0] % p.device_mesh.size():
                raise ToolkitError(f"--optimizer adamw-8bit under --strategy fsdp needs parameters sharded evenly on their "
                                   f"first dimension, got a {tuple(p.shape)} tensor placed {p.placements} on "
                                   f"{p.device_mesh.size()} ranks: use --optimizer adamw, or a data-parallel size that "
                                   "divides every parameter's first dimension")
            local = self._local(p)
            self.state[local] = {}
            super().init_state(group, local, gindex, pindex)
            self.state[p] = self._wrap(p, self.state.pop(local))

        @torch.no_grad()
        def update_step(self, group: Any, p: Any, gindex: int, pindex: int) -> None:
            if not isinstance(p, DTensor):
                return super().update_step(group, p, gindex, pindex)
            local = self._local(p)
            self.state[local] = self._unwrap(self.state[p])
            try:
                super().update_step(group, local, gindex, pindex)
            finally:
                self.state[p] = self._wrap(p, self.state.pop(local))
                local.grad = None

    return ShardedAdamW8bit
