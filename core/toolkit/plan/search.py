"""Enumerate candidate layouts for a model on a cluster, drop the impossible ones with reasons,
and rank the rest by estimated step time."""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, field

from toolkit.errors import ConfigError
from toolkit.plan.hardware import GIB, Cluster
from toolkit.plan.memory import STRATEGIES, TUNERS, Layout, MemoryBreakdown, Workload, layout_memory, usable_memory
from toolkit.plan.model import ModelShape
from toolkit.plan.timing import TimeBreakdown, step_time


@dataclass
class Candidate:
    """One layout with its memory and time estimates; ``rejected`` says why it cannot run."""

    layout: Layout
    memory: MemoryBreakdown | None = None
    time: TimeBreakdown | None = None
    rejected: str | None = None
    reasons: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return self.rejected is None

    @property
    def tokens_per_second_per_gpu(self) -> float:
        return self.time.tokens_per_second / self.layout.world_size if self.time else 0.0


@dataclass
class PlanResult:
    shape: ModelShape
    cluster: Cluster
    workload: Workload
    global_rows: int
    ranked: list[Candidate]
    rejected: list[Candidate]
    model: str = ""
    """The ``--model`` the plan was made for (its printed commands train it)."""

    @property
    def best(self) -> Candidate | None:
        return self.ranked[0] if self.ranked else None


def _powers_of_two(limit: int) -> list[int]:
    values, value = [], 1
    while value <= limit:
        values.append(value)
        value *= 2
    return values


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def strategy_axes(strategy: str) -> frozenset[str]:
    """The parallel axes ``strategy`` supports, as the runner reads them (:meth:`toolkit.plugins.Toolkit.parallel_axes`:
    its own ``parallel_axes`` and those plugins add through ``toolkit_strategy_axes``; toolkit-moe adds ``ep`` to
    ``local``). A strategy not installed here is planned with the axes of its first-party plugin (megatron: all), so
    a plan can be made for a machine that will have it."""
    from toolkit.parallel import AXES
    from toolkit.plugins import get_plugin_manager

    manager = get_plugin_manager()
    registry = manager.registry("strategy")
    if strategy in registry:
        return manager.parallel_axes(registry.get(strategy))
    return frozenset(AXES) if strategy == "megatron" else frozenset()


def enumerate_layouts(shape: ModelShape, cluster: Cluster, workload: Workload, strategies: tuple[str, ...]) -> list[Layout]:
    """Every combination worth judging (divisibility is checked later, to report reasons): each strategy's axes
    (:func:`strategy_axes`) sized over the cluster, times the strategy's sharding choices."""
    world = cluster.world_size
    layouts: list[Layout] = []
    for recompute in (False, True):
        for strategy in strategies:
            for split in _splits(shape, cluster, workload, strategy_axes(strategy)):
                dp = world // (split["tp"] * split["pp"] * split["cp"])
                for zero, offload in _sharding(strategy, shape, world, dp, split):
                    layouts.append(Layout(strategy, **split, dp=dp, zero=zero, offload=offload, recompute=recompute))
    return layouts


def _splits(shape: ModelShape, cluster: Cluster, workload: Workload, axes: frozenset[str]) -> list[dict[str, int]]:
    """Sizes of the model-splitting axes a strategy supports (1 for the others): TP in powers of two up to two
    nodes, PP dividing the rest, CP only for rows of 8192 tokens or more, EP dividing the experts."""
    world = cluster.world_size
    tps = [t for t in _powers_of_two(world) if t <= 2 * cluster.gpus_per_node] if "tp" in axes else [1]
    cps = [c for c in _powers_of_two(8) if c == 1 or workload.seq_len >= 8192] if "cp" in axes else [1]
    eps = [e for e in _divisors(shape.experts) if e <= world] if "ep" in axes and shape.is_moe else [1]
    out = []
    for tp in tps:
        for pp in _divisors(world // tp) if "pp" in axes else [1]:
            for cp in cps:
                if world % (tp * pp * cp):
                    continue
                for vpp in ((1, 2, 4) if pp > 1 and "vpp" in axes else (1,)):
                    out += [dict(tp=tp, pp=pp, vpp=vpp, cp=cp, ep=ep) for ep in eps]
    return out


def _sharding(strategy: str, shape: ModelShape, world: int, dp: int, split: dict[str, int]) -> list[tuple[int, bool]]:
    """(zero stage, optimizer offload) choices of a strategy: FSDP shards everything (ZeRO-3), DeepSpeed any stage
    with or without offload, Megatron with or without its distributed optimizer where there is something to shard."""
    if strategy == "fsdp":
        return [(3, False)] if world > 1 else []
    if strategy == "deepspeed":
        return [(zero, offload) for zero in (1, 2, 3) for offload in (False, True) if world > 1 or zero == 1]
    if strategy == "megatron":
        shardable = dp > 1 or (shape.is_moe and split["ep"] < dp * split["tp"] * split["cp"])
        return [(0, False), (1, False)] if shardable else [(0, False)]
    return [(0, False)]


def moe_families() -> frozenset[str] | None:
    """The model types whose experts toolkit-moe's registered ``moe`` architecture patches (and so splits over
    ``--ep`` under the HF-module strategies it adds the axis to); ``None`` when it is not installed."""
    from toolkit.plugins import get_plugin_manager

    registry = get_plugin_manager().registry("architecture")
    return frozenset(registry.get("moe").families) if "moe" in registry else None


def megatron_families() -> frozenset[str]:
    """The model types of the registered ``megatron:*`` architectures (toolkit-megatron's bridge and plugins'),
    empty when no plugin registers one (the plan is then made for a machine that will have it)."""
    from toolkit.plugins import get_plugin_manager

    registry = get_plugin_manager().registry("architecture")
    return frozenset(family for name, cls in registry.items() if name.startswith("megatron:") for family in cls.families)


def megatron_refusal(shape: ModelShape) -> str | None:
    """Why the registered ``megatron:*`` architecture of this family refuses this model's config (its optional
    ``refusal``), None when it takes it, has no such check, or the shape carries no config."""
    if shape.config is None:
        return None
    return _megatron_refusal(shape.model_type, json.dumps(shape.config, sort_keys=True, default=str))


@functools.lru_cache(maxsize=16)  # once per model, not once per candidate layout
def _megatron_refusal(model_type: str, config_json: str) -> str | None:
    from toolkit.contracts import member
    from toolkit.plugins import get_plugin_manager

    registry = get_plugin_manager().registry("architecture")
    for name, architecture in registry.items():
        refusal = member(architecture, "architecture", "refusal")
        if name.startswith("megatron:") and model_type in architecture.families and refusal is not None:
            return refusal(json.loads(config_json))
    return None


def structural_problem(shape: ModelShape, layout: Layout, workload: Workload, global_rows: int) -> str | None:
    """Why ``layout`` cannot be built for this model at all (None when it can): first the rules of
    :class:`toolkit.parallel.ParallelLayout`, which the engines enforce, then the planner's own."""
    from toolkit.parallel import ModelShape as Divisors

    parallel = layout.parallel
    latents = (("kv_lora_rank + qk_rope_head_dim", shape.kv_lora_rank + shape.rope_head_dim),) if shape.is_mla else ()
    latents += (("q_lora_rank", shape.q_lora_rank),) if shape.q_lora_rank else ()
    divisors = Divisors(heads=shape.heads, kv_heads=shape.kv_heads, ffn=shape.ffn, layers=shape.layers,
                        experts=shape.experts, model_type=shape.model_type, latents=latents)
    rules = parallel.world_problems(layout.world_size) + parallel.model_problems(divisors, workload.seq_len)
    if rules:
        return rules[0]
    if global_rows % (layout.dp * workload.micro_batch_size):
        return (f"global batch {global_rows} rows is not a multiple of DP{layout.dp} x micro-batch "
                f"{workload.micro_batch_size}")
    if layout.strategy == "megatron" and (bridged := megatron_families()) and shape.model_type not in bridged:
        return (f"the Megatron bridge has no architecture for {shape.model_type} (it has: {', '.join(sorted(bridged))}); "
                "local, fsdp and deepspeed run the HF model itself")
    if layout.strategy == "megatron" and (refused := megatron_refusal(shape)):
        return f"{refused}; local, fsdp and deepspeed run the HF model itself"
    if layout.ep > 1 and layout.strategy != "megatron":
        families = moe_families()
        if families is not None and shape.model_type not in families:
            return (f"--ep {layout.ep} under --strategy {layout.strategy} splits toolkit-moe's experts, which patches "
                    f"{', '.join(sorted(families))}, not {shape.model_type}")
    if workload.tuner == "qlora" and (layout.strategy == "megatron" or layout.zero >= 3):
        return "QLoRA's 4-bit base weights cannot be sharded by Megatron TP/PP or ZeRO-3 here"
    if workload.tuner != "full" and (layout.zero >= 1 and layout.strategy != "megatron" and layout.dp == 1):
        return "ZeRO with one data-parallel rank shards nothing"
    return None


def _reasons(shape: ModelShape, candidate: Candidate, cluster: Cluster, usable: float) -> list[str]:
    layout, memory, time = candidate.layout, candidate.memory, candidate.time
    gpn = cluster.gpus_per_node
    reasons = [f"fits: {memory.total / GIB:.1f} of {usable / GIB:.1f} GiB usable per GPU ({memory.stage}); "
               + ", ".join(f"{name} {value / GIB:.1f}" for name, value in memory.rows() if value > 0.05 * GIB)]
    if layout.tp > 1:
        where = "inside one node (NVLink)" if layout.tp <= gpn else "across nodes (network): slow"
        reasons.append(f"TP{layout.tp} {where}: splits each layer's weights {layout.tp} ways; "
                       f"TP traffic {time.tensor_parallel:.2f} s/step")
    if layout.pp > 1:
        bubble = (layout.pp - 1) / (layout.vpp * time.micro_batches)
        reasons.append(f"PP{layout.pp}{f' x VPP{layout.vpp}' if layout.vpp > 1 else ''}: "
                       f"{shape.layers // layout.pp} layers per stage, {time.micro_batches} micro-batches per step, "
                       f"bubble {bubble:.1%} of compute")
    if layout.ep > 1:
        reasons.append(f"EP{layout.ep}: {shape.experts // layout.ep} experts per GPU; all-to-all "
                       f"{time.expert_parallel:.2f} s/step")
    if layout.zero and layout.dp > 1:
        what = {1: "optimizer states", 2: "optimizer states and gradients", 3: "optimizer states, gradients and weights"}
        reasons.append(f"{'distributed optimizer' if layout.strategy == 'megatron' else f'ZeRO-{layout.zero}'} "
                       f"shards {what[layout.zero]} over DP{layout.dp}")
    if layout.recompute:
        reasons.append(f"recompute: activations {memory.activations / GIB:.1f} GiB instead of "
                       f"{memory.activations_without_recompute / GIB:.1f} GiB, one extra forward pass")
    if time.data_parallel > 0.01 * time.total:
        reasons.append(f"DP{layout.dp} gradient sync {time.data_parallel:.2f} s/step exposed")
    top = max(time.rows(), key=lambda row: row[1])
    reasons.append(f"step {time.total:.2f} s ({time.tokens_per_step} tokens), {top[0]} dominates; "
                   f"matmul efficiency {time.efficiency:.0%}")
    return reasons


def evaluate(shape: ModelShape, layout: Layout, workload: Workload, cluster: Cluster, global_rows: int) -> Candidate:
    """Memory and time of one layout, or the reason it is impossible."""
    candidate = Candidate(layout)
    problem = structural_problem(shape, layout, workload, global_rows)
    if problem:
        candidate.rejected = problem
        return candidate
    micro_batches = global_rows // (layout.dp * workload.micro_batch_size)
    candidate.memory = layout_memory(shape, layout, workload, micro_batches)
    candidate.time = step_time(shape, layout, workload, cluster, global_rows)
    usable = usable_memory(cluster)
    if candidate.memory.total > usable:
        largest = max(candidate.memory.rows(), key=lambda row: row[1])
        candidate.rejected = (f"needs {candidate.memory.total / GIB:.1f} GiB per GPU, {usable / GIB:.1f} GiB usable "
                              f"(largest: {largest[0]} {largest[1] / GIB:.1f} GiB)")
        return candidate
    candidate.reasons = _reasons(shape, candidate, cluster, usable)
    return candidate


def check_inputs(cluster: Cluster, workload: Workload, strategies: tuple[str, ...]) -> None:
    problems = []
    if workload.seq_len < 1:
        problems.append(f"--seq-len must be at least 1, got {workload.seq_len}")
    if workload.micro_batch_size < 1:
        problems.append(f"--micro-batch-size must be at least 1, got {workload.micro_batch_size}")
    if workload.global_batch_size < 0:
        problems.append(f"--global-batch-size must be 0 (automatic) or more, got {workload.global_batch_size}")
    if workload.tuner not in TUNERS:
        problems.append(f"--tuner {workload.tuner!r} is not planned; choose one of {', '.join(TUNERS)}")
    if workload.lora_rank < 1:
        problems.append(f"--lora-rank must be at least 1, got {workload.lora_rank}")
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown or not strategies:
        problems.append(f"--strategies {','.join(unknown) or '(none)'}: choose from {', '.join(STRATEGIES)}")
    if problems:
        raise ConfigError(problems)


def plan(shape: ModelShape, cluster: Cluster, workload: Workload, strategies: tuple[str, ...] = STRATEGIES,
         model: str = "") -> PlanResult:
    """Judge every candidate layout; feasible ones ranked fastest first. ``model``: the reference the printed
    commands name (default: the shape's name)."""
    check_inputs(cluster, workload, strategies)
    seen: set[Layout] = set()
    ranked, rejected = [], []
    for layout in enumerate_layouts(shape, cluster, workload, strategies):
        if layout in seen:
            continue
        seen.add(layout)
        candidate = evaluate(shape, layout, workload, cluster, global_rows(workload, layout))
        (ranked if candidate.fits else rejected).append(candidate)
    # Fastest first; step times within 0.5% tie (the model is not more precise than that),
    # then less memory, then fewer model-parallel splits.
    ranked.sort(key=lambda c: (round(math.log(c.time.total) / math.log(1.005)), c.memory.total,
                               c.layout.tp * c.layout.pp * c.layout.cp))
    best = ranked[0].layout if ranked else None
    return PlanResult(shape, cluster, workload, global_rows(workload, best) if best else workload.global_batch_size, ranked,
                      rejected, model or shape.name)


def training_command(result: PlanResult, layout: Layout) -> list[str]:
    """The command line that trains ``result.model`` on ``layout`` with the planned workload (``sft``; add
    ``--dataset`` and ``--output``): ``toolkit launch`` over the cluster's processes, the layout's flags as the
    runner reads them, bf16 precision as planned."""
    cluster, workload = result.cluster, result.workload
    launch = ["toolkit"]
    if cluster.world_size > 1:
        launch += ["launch", "--nproc", str(cluster.gpus_per_node)]
        if cluster.nodes > 1:
            launch += ["--nnodes", str(cluster.nodes), "--node-rank", "RANK", "--master-addr", "NODE0"]
    args = ["sft", "--model", result.model, "--strategy", layout.strategy, *layout.parallel.flags().split()]
    if layout.ep > 1 and layout.strategy != "megatron":
        args.append("--moe-enabled")  # toolkit-moe splits the experts of the blocks it patches, and only when asked
    if layout.strategy == "deepspeed":
        args += ["--zero", str(layout.zero)] + (["--deepspeed-offload-optimizer", "cpu"] if layout.offload else [])
    if layout.strategy == "megatron" and layout.zero:
        args.append("--megatron-distributed-optimizer")
    if layout.recompute:
        args.append("--gradient-checkpointing")
    args += ["--precision", "bf16", "--seq-len", str(workload.seq_len), "--micro-batch-size", str(workload.micro_batch_size)]
    if workload.global_batch_size:  # 0 means the same to the runner: one micro-batch per data-parallel rank
        args += ["--global-batch-size", str(workload.global_batch_size)]
    if layout.strategy == "local" and workload.bf16_mode != "master":
        args += ["--local-bf16-mode", workload.bf16_mode]
    if workload.tuner != "full":
        args += ["--tuner", workload.tuner, f"--{workload.tuner}-rank", str(workload.lora_rank)]
    return launch + args


def global_rows(workload: Workload, layout: Layout) -> int:
    """Rows per optimizer step as the runner counts them: ``--global-batch-size``, or with 0 one
    micro-batch per data-parallel rank (``toolkit.data.pipeline.Batches``)."""
    return workload.global_batch_size or workload.micro_batch_size * layout.dp

