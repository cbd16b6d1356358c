"""The ``moe`` architecture entry: per-family facts plus the options of the ``moe:`` section.

Imported when the plugin registers, so it must stay free of torch.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Literal

from toolkit.config import option
from toolkit_moe.families import FAMILIES, MoeFamily


@dataclasses.dataclass(kw_only=True)
class MoeConfig:
    enabled: bool = option(False, help="Replace the HF sparse MoE blocks (qwen2_moe, qwen3_moe, mixtral) with toolkit-moe's routed experts.")
    capacity_factor: float = option(0.0, help="Per-expert capacity as a multiple of the even share (N*k/E); 0 never drops tokens.")
    aux_loss_coef: float | None = option(None, replaced_by="router_aux_loss_coef")
    z_loss_coef: float | None = option(None, replaced_by="router_z_loss_coef")
    experts_backend: Literal["auto", "grouped_mm", "loop"] = option(
        "auto", help="Expert matmuls: grouped_mm (torch grouped GEMM, CUDA), loop (one matmul per expert), auto picks.")
    expert_parallel: int | None = option(None, replaced_by="expert_parallel")

    def check(self) -> list[str]:
        problems = []
        if self.capacity_factor < 0:
            problems.append(f"capacity_factor must be 0 (no dropping) or positive, got {self.capacity_factor}")
        if any(value is not None and value < 0 for value in (self.aux_loss_coef, self.z_loss_coef)):
            problems.append("aux_loss_coef and z_loss_coef must not be negative")
        if self.expert_parallel is not None and self.expert_parallel < 1:
            problems.append(f"expert_parallel must be at least 1, got {self.expert_parallel}")
        return problems


class MoeArchitecture:
    """MoE routing facts for the families toolkit-moe patches (``--moe-enabled`` turns it on)."""

    name: ClassVar[str] = "moe"
    Config: ClassVar[type] = MoeConfig
    families: ClassVar[tuple[str, ...]] = tuple(FAMILIES)
    facts: ClassVar[dict[str, MoeFamily]] = FAMILIES

    def __init__(self, config: MoeConfig | None = None):
        self.config = config or MoeConfig()

    def patch(self, model: Any, source: Any = None, strategy: str | None = None, expert_parallel: int = 1,
              aux_loss_coef: float | None = None, z_loss_coef: float | None = None) -> int:
        """Patch ``model`` according to ``self.config``; returns the number of replaced blocks.

        Under torchrun with ``expert_parallel > 1`` (the layout's ep axis, ``--ep``) the experts are split
        over groups of that many ranks (``strategy`` must be ``local``). ``aux_loss_coef`` / ``z_loss_coef``
        are the recipe's ``--router-aux-loss-coef`` / ``--router-z-loss-coef``; ``None`` takes the model config's.
        """
        from toolkit_moe.patch import patch_moe_blocks

        expert_group = self._expert_group(strategy, expert_parallel)
        aux = self.config.aux_loss_coef if aux_loss_coef is None else aux_loss_coef
        z = self.config.z_loss_coef if z_loss_coef is None else z_loss_coef
        return patch_moe_blocks(model, capacity_factor=self.config.capacity_factor, aux_loss_coef=aux, z_loss_coef=z,
                                experts_backend=self.config.experts_backend, expert_group=expert_group)

    @staticmethod
    def _expert_group(strategy: str | None, size: int) -> Any:
        """The expert-parallel group of this process, ``None`` when experts are not split."""
        if size <= 1:
            return None
        import warnings

        import torch.distributed as dist

        from toolkit.errors import ConfigError
        from toolkit_moe.parallel import new_expert_groups

        if strategy not in (None, "local"):
            raise ConfigError(
                f"--ep {size} with --moe-enabled works with --strategy local (one process per GPU under torchrun, DDP "
                f"for the rest of the model), not --strategy {strategy}: FSDP/ZeRO would shard and average the expert "
                "slices over all ranks. Use --strategy local, or --strategy megatron --ep N.", source="--ep")
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if world == 1:
            # One process holds every expert (also when a checkpoint is exported): same model, nothing to split.
            warnings.warn(f"--ep {size} in a single process: all experts stay here", stacklevel=2)
            return None
        if world % size:
            raise ConfigError(f"--ep {size} must divide the number of processes ({world}): launch a multiple of "
                              f"{size} processes", source="--ep")
        group = new_expert_groups(size)
        if dist.get_rank() == 0:
            print(f"toolkit-moe: experts split over groups of {size} ranks (expert parallelism)", flush=True)
        return group
