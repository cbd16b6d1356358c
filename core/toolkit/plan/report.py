"""Text and JSON renderings of a :class:`~toolkit.plan.search.PlanResult` for ``toolkit plan``."""

from __future__ import annotations

import shlex
from collections import Counter
from typing import Any

from toolkit.plan.hardware import GIB
from toolkit.plan.memory import usable_memory
from toolkit.plan.search import Candidate, PlanResult, training_command


def _gib(value: float) -> str:
    return f"{value / GIB:6.1f}"


def why_lines(result: PlanResult) -> list[str]:
    """Why the best layout beats its neighbours: what smaller splits lack, what larger ones cost."""
    best = result.best
    if best is None:
        return []
    lines = []
    split = best.layout.tp * best.layout.pp * best.layout.cp
    smaller = [c for c in result.rejected if c.memory is not None and not c.layout.recompute
               and c.layout.strategy == best.layout.strategy and c.layout.tp * c.layout.pp * c.layout.cp < split]
    if smaller:
        closest = min(smaller, key=lambda c: c.memory.total)
        lines.append(f"less model parallelism does not fit: {closest.layout.describe()} {closest.rejected}")
    sharded = [c for c in result.ranked + result.rejected
               if c.layout.strategy in ("fsdp", "deepspeed") and c.layout.zero == 3 and c.time is not None]
    if sharded and best.layout.strategy == "megatron":
        fastest = min(sharded, key=lambda c: c.time.total)
        state = "fits" if fastest.fits else "does not fit"
        lines.append(f"pure data parallelism with sharding ({fastest.layout.describe()}) {state} and would take "
                     f"{fastest.time.total:.1f} s/step vs {best.time.total:.1f} s: every micro-batch gathers all weights "
                     f"over {'the network' if result.cluster.nodes > 1 else 'NVLink'}")
    if best.layout.tp > 1 and best.layout.tp <= result.cluster.gpus_per_node:
        lines.append(f"TP{best.layout.tp} stays inside a node of {result.cluster.gpus_per_node} GPUs, so its per-layer "
                     "all-reduces use NVLink; pipeline stages and data parallelism cross nodes, where traffic is "
                     "once per micro-batch or per step")
    return lines


def render(result: PlanResult, top: int = 3, show_rejected: int = 5) -> str:
    """The human report: model, machine, the top ``top`` layouts with breakdowns and reasons."""
    out = [result.shape.describe(), f"machine: {result.cluster.describe()}, "
           f"usable {usable_memory(result.cluster) / GIB:.1f} GiB per GPU after CUDA context and 5% headroom",
           f"training: tuner {result.workload.tuner}, seq {result.workload.seq_len}, micro-batch "
           f"{result.workload.micro_batch_size}, global batch {result.global_rows} rows "
           f"({result.global_rows * result.workload.seq_len} tokens"
           + (", --global-batch-size 0: one micro-batch per data-parallel rank, as training does" if not result.workload.global_batch_size else "")
           + ")", ""]
    if not result.ranked:
        out.append("no layout fits. Closest candidates:")
        near = sorted((c for c in result.rejected if c.memory), key=lambda c: c.memory.total)[:show_rejected]
        out += [f"  {c.layout.describe()}: {c.rejected}" for c in near]
        out.append("Try more GPUs (--gpus/--nodes), --tuner lora or qlora, a shorter --seq-len, or --micro-batch-size 1.")
        return "\n".join(out)
    for rank, candidate in enumerate(result.ranked[:top], 1):
        out += _candidate_block(rank, candidate, training_command(result, candidate.layout))
    why = why_lines(result)
    if why:
        out.append("why this layout:")
        out += [f"  - {line}" for line in why]
        out.append("")
    counts = Counter(_category(c) for c in result.rejected)
    reasons = ", ".join(f"{n} {what}" for what, n in counts.most_common())
    out.append(f"{len(result.ranked)} layouts fit, {len(result.rejected)} rejected" + (f" ({reasons})" if reasons else ""))
    near = sorted((c for c in result.rejected if c.memory), key=lambda c: c.memory.total)[:show_rejected]
    out += [f"  rejected {c.layout.describe()}: {c.rejected}" for c in near]
    return "\n".join(out)


def _category(candidate: Candidate) -> str:
    return "out of memory" if candidate.memory is not None else "impossible splits"


def _candidate_block(rank: int, candidate: Candidate, command: list[str]) -> list[str]:
    memory, time = candidate.memory, candidate.time
    lines = [f"#{rank} {candidate.layout.describe()}: {time.tokens_per_second:,.0f} tokens/s "
             f"({candidate.tokens_per_second_per_gpu:,.0f} per GPU), {time.total:.2f} s/step, "
             f"peak {memory.total / GIB:.1f} GiB per GPU"]
    lines.append("   memory (GiB): " + ", ".join(f"{name} {_gib(value).strip()}" for name, value in memory.rows()))
    if memory.activations != memory.activations_without_recompute:
        lines.append(f"   activations without recompute would be {memory.activations_without_recompute / GIB:.1f} GiB")
    lines.append("   time (s/step): " + ", ".join(f"{name} {value:.3f}" for name, value in time.rows()))
    lines += [f"   - {reason}" for reason in candidate.reasons]
    lines.append(f"   run (add --dataset and --output): {shlex.join(command)}")
    lines.append("")
    return lines


def to_json(result: PlanResult, top: int = 10) -> dict[str, Any]:
    def candidate(c: Candidate) -> dict[str, Any]:
        data: dict[str, Any] = {"layout": c.layout.describe(), "overrides": c.layout.recipe_overrides()}
        if c.memory:
            data["memory_gib"] = {name: round(v / GIB, 3) for name, v in c.memory.rows()}
            data["memory_gib"]["total"] = round(c.memory.total / GIB, 3)
        if c.time:
            data["step_seconds"] = round(c.time.total, 4)
            data["tokens_per_second"] = round(c.time.tokens_per_second, 1)
        if c.rejected:
            data["rejected"] = c.rejected
        else:
            data["reasons"] = c.reasons
            data["command"] = training_command(result, c.layout)
        return data

    return {"model": result.shape.describe(), "machine": result.cluster.describe(), "global_batch_rows": result.global_rows,
            "ranked": [candidate(c) for c in result.ranked[:top]], "why": why_lines(result),
            "rejected": len(result.rejected)}
