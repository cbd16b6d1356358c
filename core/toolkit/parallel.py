"""One parallel layout for the whole toolkit: its axes, the world-size arithmetic and its error text.

The role torchtitan's ``ParallelDims`` plays: the runner (which axes the chosen strategy supports),
the planner (which candidate layouts can exist), the megatron engine, its bridge and the ``mcore``
exporter all take a :class:`ParallelLayout` and ask it, so a rule and its message live here once.
Data parallelism is what is left: ``dp = world_size / (tp * pp * cp)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

AXES = ("tp", "pp", "vpp", "cp", "ep", "etp", "sp")
"""Model-splitting axes a strategy may support (``Strategy.parallel_axes``); every strategy supports dp."""

FLAGS = {"tp": "--tp", "pp": "--pp", "vpp": "--vpp", "cp": "--cp", "ep": "--ep", "etp": "--etp", "sp": "--sequence-parallel"}


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a model that a layout must divide."""

    heads: int
    kv_heads: int
    ffn: int
    layers: int
    experts: int = 0
    model_type: str = "model"
    latents: tuple[tuple[str, int], ...] = ()
    """Multi-head latent attention's down-projection widths (named), split over TP like a column-parallel linear."""
    expert_ffn: int = 0
    """Each routed expert's FFN width (``moe_intermediate_size``) where it differs from ``intermediate_size``."""

    @classmethod
    def of(cls, hf_config: Any) -> ModelShape:
        heads = hf_config.num_attention_heads
        experts = getattr(hf_config, "num_experts", None) or getattr(hf_config, "num_local_experts", None) or 0
        latents = ()
        if getattr(hf_config, "kv_lora_rank", None):
            latents = (("kv_lora_rank + qk_rope_head_dim", hf_config.kv_lora_rank + hf_config.qk_rope_head_dim),)
            if getattr(hf_config, "q_lora_rank", None):
                latents += (("q_lora_rank", hf_config.q_lora_rank),)
        return cls(heads=heads, kv_heads=getattr(hf_config, "num_key_value_heads", None) or heads,
                   ffn=hf_config.intermediate_size, layers=hf_config.num_hidden_layers, experts=experts,
                   model_type=hf_config.model_type, latents=latents,
                   expert_ffn=(getattr(hf_config, "moe_intermediate_size", None) or 0) if experts else 0)


@dataclass(frozen=True)
class ParallelLayout:
    """How one model is split: tensor, pipeline (virtual), context, expert (tensor) and sequence parallel."""

    tensor: int = 1
    pipeline: int = 1
    virtual: int = 1
    context: int = 1
    sequence_parallel: bool = False
    expert: int = 1
    expert_tensor: int | None = None
    """Expert tensor-parallel size; ``None``: the tensor-parallel size (Megatron's default)."""

    @classmethod
    def from_recipe(cls, recipe: Any) -> ParallelLayout:
        return cls(tensor=recipe.tensor_parallel, pipeline=recipe.pipeline_parallel, virtual=recipe.virtual_pipeline,
                   context=recipe.context_parallel, sequence_parallel=recipe.sequence_parallel,
                   expert=recipe.expert_parallel, expert_tensor=recipe.expert_tensor_parallel)

    @property
    def model_parallel(self) -> int:
        """Processes that hold one copy of the dense weights: tp * pp * cp."""
        return self.tensor * self.pipeline * self.context

    @property
    def expert_group(self) -> int:
        """Processes that hold one copy of the expert weights: ep * etp * pp."""
        return self.expert * (self.expert_tensor or self.tensor) * self.pipeline

    def needed_processes(self) -> int:
        """The smallest world size this layout runs on (world sizes are multiples of it)."""
        return math.lcm(self.model_parallel, self.expert_group)

    def data_parallel(self, world_size: int) -> int:
        return world_size // self.model_parallel

    def sizes(self) -> dict[str, int]:
        """Axis -> size (``sp``: 1 or 2 for off/on), for the axes' names in AXES."""
        return {"tp": self.tensor, "pp": self.pipeline, "vpp": self.virtual, "cp": self.context, "ep": self.expert,
                "etp": self.expert_tensor or 1, "sp": 2 if self.sequence_parallel else 1}

    def axes_in_use(self) -> list[str]:
        return [axis for axis, size in self.sizes().items() if size > 1]

    def describe(self) -> str:
        text = f"tp={self.tensor} pp={self.pipeline}"
        for label, value in (("vpp", self.virtual), ("cp", self.context), ("ep", self.expert)):
            if value > 1:
                text += f" {label}={value}"
        if self.expert_tensor is not None and self.expert_tensor != self.tensor:
            text += f" etp={self.expert_tensor}"
        return text + (" sp" if self.sequence_parallel else "")

    def flags(self) -> str:
        """The command-line flags that ask for this layout (``--tp 2 --pp 2``)."""
        return " ".join(FLAGS[a] if a == "sp" else f"{FLAGS[a]} {size}" for a, size in self.sizes().items() if size > 1)

    # ------------------------------------------------------------------------- rules

    def unsupported(self, strategy: str, supported: frozenset[str] | set[str], providers: dict[str, str] | None = None) -> list[str]:
        """One problem per axis in use that ``strategy`` does not support (``providers``: axis -> a strategy that does)."""
        problems = []
        for axis in self.axes_in_use():
            if axis in supported:
                continue
            flag = FLAGS[axis] if axis == "sp" else f"{FLAGS[axis]} {self.sizes()[axis]}"
            where = f" needs --strategy {providers[axis]}" if providers and axis in providers else ""
            can = ", ".join(a for a in AXES if a in supported) or "data parallelism only"
            problems.append(f"{flag}{where}: --strategy {strategy} splits models along {can}")
        return problems

    def world_problems(self, world_size: int) -> list[str]:
        """Why ``world_size`` processes cannot hold this layout, with the arithmetic and what to launch."""
        problems = []
        if self.tensor < 1 or self.pipeline < 1 or self.virtual < 1 or self.context < 1 or self.expert < 1 or (self.expert_tensor or 1) < 1:
            return [f"{self.describe()}: every size must be at least 1"]
        needed = self.needed_processes()
        if world_size == 1 and needed > 1:
            from toolkit.commands.launch import launch_advice

            return [f"{self.describe()} needs a multiple of {needed} processes and this is one process; {launch_advice(needed)}"]
        if world_size % self.model_parallel:
            problems.append(f"world size {world_size} is not divisible by tp*pp*cp = {self.tensor}*{self.pipeline}*"
                            f"{self.context} = {self.model_parallel}; launch a multiple of {self.model_parallel} processes")
        elif world_size % self.expert_group:
            etp = self.expert_tensor or self.tensor
            problems.append(f"world size {world_size} is not divisible by ep*etp*pp = {self.expert}*{etp}*{self.pipeline}; "
                            f"launch a multiple of {self.expert_group} processes")
        return problems

    def model_problems(self, shape: ModelShape, seq_len: int | None = None) -> list[str]:
        """Why this layout cannot split a model of ``shape`` (and rows of ``seq_len`` tokens)."""
        tp, pp, vpp, cp = self.tensor, self.pipeline, self.virtual, self.context
        problems = []
        for what, count in (("attention heads", shape.heads), ("key/value heads", shape.kv_heads),
                            ("intermediate_size", shape.ffn), *shape.latents):
            if count % tp:
                problems.append(f"{what} {count} / tp {tp} = {count / tp:.2f} is not a whole number")
        if shape.layers % (pp * vpp):
            problems.append(f"num_hidden_layers {shape.layers} / (pp {pp} * vpp {vpp}) = {shape.layers / (pp * vpp):.2f} "
                            "layers per virtual stage is not a whole number")
        if vpp > 1 and pp < 2:
            problems.append(f"vpp {vpp} needs pp >= 2 (interleaved pipeline), got pp {pp}")
        if self.expert > 1 and not shape.experts:
            problems.append(f"ep {self.expert} needs a mixture-of-experts model ({shape.model_type} has no experts)")
        elif shape.experts and shape.experts % self.expert:
            problems.append(f"num_experts {shape.experts} / ep {self.expert} = {shape.experts / self.expert:.2f} is not a whole number")
        if (self.expert_tensor or 1) > 1 and not shape.experts:
            problems.append(f"etp {self.expert_tensor} needs a mixture-of-experts model ({shape.model_type} has no experts)")
        if shape.experts and tp > 1 and not self.sequence_parallel:
            problems.append("MoE with tp > 1 needs --sequence-parallel (Megatron-Core requirement)")
        if self.sequence_parallel and tp < 2:
            problems.append("sequence parallelism needs tp >= 2")
        if seq_len is not None:
            if cp > 1 and seq_len % (2 * cp):
                problems.append(f"seq_len {seq_len} % (2 * cp {cp}) = {seq_len % (2 * cp)}: context parallelism cuts "
                                f"the sequence into {2 * cp} equal chunks")
            if self.sequence_parallel and (seq_len // cp) % tp:
                problems.append(f"seq_len {seq_len} / cp {cp} / tp {tp} is not a whole number (sequence parallelism)")
        return problems

    def serving_problems(self, shape: ModelShape, engine: str) -> list[str]:
        """Why a serving engine's tensor parallelism (vLLM, LMDeploy: ``engine`` names it) cannot split a model of
        ``shape`` at this tp: attention heads and the MLPs split evenly; key/value heads split, or, fewer than tp,
        are replicated (tp a multiple of them). Serving engines take no other axis of this layout."""
        tp = self.tensor
        others = [axis for axis in self.axes_in_use() if axis != "tp"]
        if others:
            return [f"{', '.join(FLAGS[a] for a in others)}: {engine} serves with tensor parallelism only (--tp)"]
        if tp < 1:
            return [f"--tp {tp}: must be at least 1"]
        sizes = [("attention heads", shape.heads), ("intermediate_size", shape.ffn)]
        if shape.expert_ffn:
            sizes.append(("moe_intermediate_size", shape.expert_ffn))
        problems = [f"{what} {count} / tp {tp} = {count / tp:.2f} is not a whole number" for what, count in sizes if count % tp]
        if shape.kv_heads % tp and tp % shape.kv_heads:
            problems.append(f"key/value heads {shape.kv_heads} neither split over tp {tp} nor replicate evenly "
                            f"(tp must divide them or be a multiple of them)")
        return [f"{engine} at --tp {tp}: {p}" for p in problems]

    def check(self, hf_config: Any, world_size: int, seq_len: int | None = None) -> None:
        """Raise :class:`LayoutError` (before anything is allocated) when the layout cannot work."""
        from toolkit.errors import LayoutError

        problems = self.world_problems(world_size) + self.model_problems(ModelShape.of(hf_config), seq_len)
        if problems:
            raise LayoutError(f"layout {self.describe()} cannot run {hf_config.model_type} "
                              f"({hf_config.num_hidden_layers} layers) on {world_size} processes:\n"
                              + "\n".join(f"  - {p}" for p in problems))

