"""One rollout phase: prompts -> completions -> rewards -> advantages -> micro-batches in the loss contract.

Each completion becomes a :class:`~toolkit.contracts.Sequence` whose labels are its tokens (the
prompt is not trained) and whose ``advantage`` rides in the sequence meta; the rollout policy's and
the reference's per-token log-probs ride in ``token_meta`` of the collated micro-batch.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

from toolkit.contracts import IGNORE_INDEX, Example, Sequence, StepContext


@dataclasses.dataclass
class RolloutBatch:
    steps: list[list[dict]]
    """Micro-batches of each optimizer step of the batch."""
    contexts: list[StepContext]
    metrics: dict[str, float]
    samples: list[dict[str, Any]]
    """Rollouts for rollouts.jsonl (this rank's first ones)."""


def reward_table(rewards: list, prompts: list, texts: list[str], completion_ids: list[list[int]], records: list) -> Any:
    """``[completions, rewards]`` scores, NaN where a reward returned None."""
    import torch

    columns = []
    for weighted in rewards:
        scores = weighted.reward([p.text for p in prompts], texts, completion_ids, records)
        if len(scores) != len(texts):
            from toolkit.errors import ToolkitError

            raise ToolkitError(f"reward {weighted.label!r} returned {len(scores)} scores for {len(texts)} completions")
        columns.append([math.nan if s is None else float(s) for s in scores])
    return torch.tensor(columns, dtype=torch.float64).T.contiguous()


def combine(table: Any, weights: list[float]) -> Any:
    """Weighted sum per completion; NaN when every reward was None for it (it then gets advantage 0, as in TRL)."""
    import torch

    total = (table * torch.tensor(weights, dtype=table.dtype)).nansum(dim=1)
    return total.masked_fill(torch.isnan(table).all(dim=1), math.nan)


def nan_group_advantages(rewards: Any, group: int, scale: str, batch_std: float | None) -> Any:
    """TRL's advantages: reward minus the group's nan-mean, over the group (or batch) nan-std + 1e-4."""
    import torch

    grouped = rewards.view(-1, group)
    mean = torch.nanmean(grouped, dim=1, keepdim=True)
    count = (~torch.isnan(grouped)).sum(dim=1, keepdim=True)
    var = torch.nansum((grouped - mean) ** 2, dim=1, keepdim=True) / (count - 1).clamp(min=1)
    advantages = grouped - mean
    if scale == "group":
        advantages = advantages / (var.sqrt() + 1e-4)
    elif scale == "batch":
        advantages = advantages / (batch_std + 1e-4)
    return torch.nan_to_num(advantages.flatten(), nan=0.0), var.sqrt().flatten()


def completion_sequence(prompt_ids: list[int], completion: list[int], advantage: float, train: bool) -> Sequence:
    ids = prompt_ids + completion
    labels = [IGNORE_INDEX] * (len(prompt_ids) - 1) + (completion if train else [IGNORE_INDEX] * len(completion)) + [IGNORE_INDEX]
    return Sequence(input_ids=ids, labels=labels, meta={"advantage": float(advantage)})


def split_steps(examples: list[Example], steps: int, micro_batch_size: int, pad_id: int) -> list[list[dict]]:
    """The batch's examples in ``steps`` equal runs, each in micro-batches of ``micro_batch_size`` rows."""
    from toolkit.data.pipeline import collate

    per_step = math.ceil(len(examples) / steps)
    out = []
    for start in range(0, len(examples), per_step):
        indices = list(range(start, min(start + per_step, len(examples))))
        out.append([collate(examples, [[i] for i in indices[k:k + micro_batch_size]], pad_id, packing=False)
                    for k in range(0, len(indices), micro_batch_size)])
    return out


def score_log_probs(steps: list[list[dict]], rollouts: Any, reference: Any) -> None:
    """Fill each micro-batch's ``token_meta``: the rollout policy's (and the reference's) per-token log-probs."""
    for micro_batches in steps:
        for micro in micro_batches:
            micro["token_meta"] = {"old_logps": rollouts.token_logps(micro)}
            if reference is not None:
                micro["token_meta"]["ref_logps"] = rollouts.token_logps(micro, reference.scorer)


def dp_sum(engine: Any, values: list[float]) -> list[float]:
    """Sums over data-parallel replicas: ``engine.all_reduce_sum`` adds every rank, and the tensor/pipeline/context
    ranks of one replica hold the same rollouts, so each value is divided by the ranks per replica."""
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    per_replica = max(world // max(engine.dp_world_size, 1), 1)
    return [v / per_replica for v in engine.all_reduce_sum(values)]


def contexts_of(steps: list[list[dict]], engine: Any) -> list[StepContext]:
    """Global counts of each step (summed over data-parallel ranks)."""
    local = []
    for micro_batches in steps:
        local += [sum(int((mb["labels"] != IGNORE_INDEX).sum()) for mb in micro_batches),
                  sum(mb["num_sequences"] for mb in micro_batches)]
    summed = dp_sum(engine, [float(v) for v in local]) if local else []
    return [StepContext(label_tokens=round(summed[2 * k]), sequences=round(summed[2 * k + 1]),
                        examples=round(summed[2 * k + 1]))
            for k in range(len(steps))]


def global_mean_std(engine: Any, values: Any) -> tuple[float, float]:
    """Mean and (unbiased) std of ``values`` over every rank, NaNs left out."""
    import torch

    kept = values[~torch.isnan(values)]
    total, squares, count = dp_sum(engine, [float(kept.sum()), float((kept ** 2).sum()), float(kept.numel())])
    if count == 0:
        return math.nan, math.nan
    mean = total / count
    return mean, math.sqrt(max(squares - count * mean * mean, 0.0) / max(count - 1, 1))


def reward_metrics(engine: Any, rewards: list, table: Any, total: Any) -> dict[str, float]:
    metrics: dict[str, float] = {}
    metrics["reward/mean"], metrics["reward/std"] = global_mean_std(engine, total)
    for k, weighted in enumerate(rewards):
        mean, std = global_mean_std(engine, table[:, k])
        metrics[f"rewards/{weighted.label}/mean"], metrics[f"rewards/{weighted.label}/std"] = mean, std
    return metrics


def timed_generate(rollouts: Any, prompts: list, seed: int) -> tuple[Any, float]:
    start = time.perf_counter()
    completions = rollouts.generate([p.ids for p in prompts], seed)
    return completions, time.perf_counter() - start
