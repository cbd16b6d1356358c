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
    aux_loss_coef: float | None = option(None, help="Load-balancing loss weight; unset uses the model config's router_aux_loss_coef.")
    z_loss_coef: float = option(0.0, help="Router z-loss weight (ST-MoE); 0 disables it.")
    experts_backend: Literal["auto", "grouped_mm", "loop"] = option(
        "auto", help="Expert matmuls: grouped_mm (torch grouped GEMM, CUDA), loop (one matmul per expert), auto picks.")
    expert_parallel: int = option(1, help="Spread experts over this many ranks with all-to-all (library API; see docs/moe.md).")

    def check(self) -> list[str]:
        problems = []
        if self.capacity_factor < 0:
            problems.append(f"capacity_factor must be 0 (no dropping) or positive, got {self.capacity_factor}")
        if self.z_loss_coef < 0 or (self.aux_loss_coef is not None and self.aux_loss_coef < 0):
            problems.append("aux_loss_coef and z_loss_coef must not be negative")
        if self.expert_parallel < 1:
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

    def patch(self, model: Any, source: Any = None) -> int:
        """Patch ``model`` according to ``self.config``; returns the number of replaced blocks."""
        from toolkit.errors import ConfigError
        from toolkit_moe.patch import patch_moe_blocks

        if self.config.expert_parallel > 1:
            raise ConfigError(
                f"moe.expert_parallel {self.config.expert_parallel}: expert parallelism is available through "
                "toolkit_moe.patch_moe_blocks(expert_group=new_expert_groups(N)) but the local/fsdp/deepspeed engines "
                "do not yet skip expert weights in data-parallel reduction; use --moe-expert-parallel 1 "
                "(or --strategy megatron --ep N)", source="--moe-expert-parallel")
        return patch_moe_blocks(model, capacity_factor=self.config.capacity_factor, aux_loss_coef=self.config.aux_loss_coef,
                                z_loss_coef=self.config.z_loss_coef, experts_backend=self.config.experts_backend)
