"""Evaluation during training: the held-out set (``--eval-dataset`` files or a seeded split of the training
set), its per-rank micro-batches, the eval forward through ``Engine.evaluate`` and the best-metric /
early-stopping bookkeeping that checkpoints carry (``--save-best``, ``--early-stopping-patience``).

The eval loss goes through the training loss itself, normalised by the counts of the whole held-out set
(one :class:`~toolkit.contracts.StepContext` for all of it), so its contributions summed over micro-batches
and data-parallel ranks are the set's mean: the same number on every strategy and at any number of ranks.
Every rank runs the same number of forwards (collective strategies such as FSDP, ZeRO-3 or tensor parallelism
need that); a rank with fewer examples runs copies marked ``eval_pad``, whose contributions are zeroed. Under
pipeline parallelism every micro-batch holds one example, so all have one shape (pipeline schedules send
activations of a fixed shape between stages), and with virtual stages each call runs a multiple of ``pp``.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any, Literal

from toolkit.contracts import Example, LossOutput, Sequence, StepContext, TokenLogps, member
from toolkit.errors import ConfigError

PAD_KEY = "eval_pad"
"""Sequence meta set on the copies that even out the ranks' forwards (their results count zero)."""
MICRO_BATCHES_PER_CALL = 8
"""Micro-batches handed to ``Engine.evaluate`` at once: bounds the collated tensors held at a time."""
HIGHER_IS_BETTER = ("accurac", "reward", "margin", "exact", "contains", "rouge", "score")


def held_out_count(recipe: Any, count: int) -> int:
    """Examples ``--eval-samples`` or ``--eval-split`` hold out of ``count``; refuses to hold out all of them."""
    if recipe.eval_samples:
        held, flag = recipe.eval_samples, f"--eval-samples {recipe.eval_samples}"
    elif recipe.eval_split:
        held, flag = max(1, round(count * recipe.eval_split)), f"--eval-split {recipe.eval_split}"
    else:
        return 0
    if held >= count:
        raise ConfigError(f"{flag} holds out every example: the data has {count} after encoding, so none would be left "
                          f"to train on; hold out fewer than {count}")
    return held


def split_held_out(examples: list[Example], recipe: Any) -> tuple[list[Example], list[Example]]:
    """``(train, held_out)``: a seeded random choice of the held-out examples, never trained on; the training
    examples keep their order (so the training order of the other examples is a function of the seed)."""
    held = held_out_count(recipe, len(examples))
    if not held:
        return examples, []
    chosen = set(random.Random(recipe.seed * 9_176_213 + 5).sample(range(len(examples)), held))
    return ([e for i, e in enumerate(examples) if i not in chosen], [examples[i] for i in sorted(chosen)])


def load_eval_examples(recipe: Any, tokenizer: Any, loss: Any) -> list[Example]:
    """The ``--eval-dataset`` files, read and encoded by the training set's rules (format, columns, template,
    ``--seq-len``; PT documents cut into rows), so errors name the file and line before any model loads."""
    if not recipe.eval_dataset:
        return []
    from toolkit.data.pipeline import load_examples

    examples, _ = load_examples(recipe.eval_dataset, tokenizer, dataset_format=recipe.dataset_format, columns=recipe.columns,
                                train_on=member(loss, "loss", "train_on"), seq_len=recipe.seq_len,
                                example_kinds=loss.example_kinds, options=recipe.options,
                                isolate_documents=recipe.isolate_documents, seed=recipe.seed)
    return examples


def _padding_copy(example: Example) -> Example:
    sequences = [Sequence(s.input_ids, s.labels, s.role, {**s.meta, PAD_KEY: 1.0}) for s in example.sequences]
    return Example(sequences, kind=example.kind, source=example.source)


class EvalSet:
    """The held-out examples of one data-parallel rank as micro-batches, every rank with as many as the others."""

    def __init__(self, examples: list[Example], *, micro_batch_size: int, dp_rank: int, dp_world_size: int, pad_id: int,
                 seq_len: int, pad_multiple: int = 1, pipeline_stages: int = 1, virtual_stages: int = 1):
        from toolkit.data.pipeline import step_context

        if not examples:
            raise ValueError("EvalSet needs at least one example")
        if pipeline_stages > 1:  # a short last group or a padding copy would change the activations' shape
            micro_batch_size = 1
        # the interleaved schedule runs a multiple of pp micro-batches per call
        self.per_call = MICRO_BATCHES_PER_CALL if virtual_stages == 1 else -(-MICRO_BATCHES_PER_CALL // pipeline_stages) * pipeline_stages
        self.size = len(examples)
        self.pad_id, self.seq_len, self.pad_multiple = pad_id, seq_len, pad_multiple
        # similar lengths share a micro-batch (less padding); the order never changes a sum's terms
        order = sorted(range(len(examples)), key=lambda i: (sum(len(s.input_ids) for s in examples[i].sequences), i))
        groups = [order[k:k + micro_batch_size] for k in range(0, len(order), micro_batch_size)]
        self.examples = [*examples, _padding_copy(examples[order[0]])]
        mine = groups[dp_rank::dp_world_size]
        per_rank = -(-len(groups) // dp_world_size)
        if virtual_stages > 1:
            per_rank = -(-per_rank // pipeline_stages) * pipeline_stages
        self.units = mine + [[len(examples)]] * (per_rank - len(mine))
        self.context: StepContext = step_context([[e] for e in examples], step=0)

    def chunks(self) -> Any:
        """Lists of collated micro-batches (``MICRO_BATCHES_PER_CALL`` at most, a multiple of pp with virtual stages);
        every rank gets as many lists."""
        from toolkit.data.pipeline import collate

        for start in range(0, len(self.units), self.per_call):
            yield [collate(self.examples, [unit], self.pad_id, False, self.pad_multiple, self.seq_len)
                   for unit in self.units[start:start + self.per_call]]


class HeldOutLoss:
    """The training loss, with the contributions of ``eval_pad`` micro-batches zeroed; everything else
    (``consumes``, ``needs_reference``, options) is the wrapped loss's. It does not promise a uniform token
    gradient, so engines take their plain head in eval."""

    def __init__(self, loss: Any):
        self.inner = loss

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __call__(self, out: TokenLogps, ctx: StepContext) -> LossOutput:
        import torch

        result = self.inner(out, ctx)
        pad = out.sequence_meta.get(PAD_KEY)
        if pad is None or not bool((pad > 0).any()):
            return result
        return LossOutput(loss=result.loss * 0.0,
                          metrics={k: torch.zeros_like(v) if torch.is_tensor(v) else 0.0 for k, v in result.metrics.items()})


def evaluate(engine: Any, loss: Any, eval_set: EvalSet) -> dict[str, float]:
    """``eval/<metric>`` of the whole held-out set (the loss's metrics; ``eval/perplexity`` = exp of the mean
    token NLL where the loss reports ``nll``), the same on every rank."""
    wrapped = HeldOutLoss(loss)
    totals: dict[str, float] = {}
    for chunk in eval_set.chunks():
        for key, value in engine.evaluate(chunk, wrapped, eval_set.context).items():
            totals[key] = totals.get(key, 0.0) + float(value)
    metrics = {f"eval/{key}": value for key, value in totals.items()}
    if "nll" in totals:
        metrics["eval/perplexity"] = math.exp(min(totals["nll"], 700.0))
    metrics["eval/examples"] = eval_set.size
    return metrics


def metric_mode(metric: str, mode: str) -> Literal["min", "max"]:
    """``--best-mode auto``: higher is better for accuracies, rewards, margins and match scores, else lower."""
    if mode in ("min", "max"):
        return mode  # type: ignore[return-value]
    return "max" if any(word in metric for word in HIGHER_IS_BETTER) else "min"


@dataclass
class BestTracker:
    """The best value of one eval metric so far, its step, and evaluations since it last improved."""

    metric: str
    mode: Literal["min", "max"]
    patience: int = 0
    threshold: float = 0.0
    value: float | None = None
    step: int = 0
    bad_evals: int = 0

    @classmethod
    def for_run(cls, recipe: Any) -> BestTracker | None:
        if not (recipe.save_best or recipe.early_stopping_patience):
            return None
        metric = recipe.save_best or recipe.early_stopping_metric
        return cls(metric, metric_mode(metric, recipe.best_mode), recipe.early_stopping_patience,
                   recipe.early_stopping_threshold)

    def update(self, step: int, metrics: dict[str, float]) -> bool:
        """Take one evaluation's metrics; True when the metric improved (by more than the threshold)."""
        if self.metric not in metrics:
            known = ", ".join(sorted(k for k in metrics if k.startswith("eval/")))
            raise ConfigError(f"--save-best/--early-stopping-metric {self.metric!r} is not among this run's eval metrics: "
                              f"{known}; pick one of them")
        value = metrics[self.metric]
        better = self.value is None or (value < self.value - self.threshold if self.mode == "min"
                                        else value > self.value + self.threshold)
        if better:
            self.value, self.step, self.bad_evals = value, step, 0
        else:
            self.bad_evals += 1
        return better

    @property
    def exhausted(self) -> bool:
        return bool(self.patience) and self.bad_evals >= self.patience

    def stop_message(self, step: int) -> str:
        return (f"early stopping at step {step}: {self.metric} has not improved by more than {self.threshold:g} "
                f"({'lower' if self.mode == 'min' else 'higher'} is better) in {self.bad_evals} evaluations "
                f"(--early-stopping-patience {self.patience}); best {self.value:.6g} at step {self.step}")

    def state(self) -> dict[str, Any]:
        return {"best": {"metric": self.metric, "mode": self.mode, "value": self.value, "step": self.step,
                         "bad_evals": self.bad_evals}}

    def restore(self, state: dict[str, Any]) -> None:
        """Continue a resumed run's best value and patience count (a checkpoint of the same metric and mode)."""
        saved = state.get("best") or {}
        if saved.get("metric") == self.metric and saved.get("mode") == self.mode:
            self.value, self.step, self.bad_evals = saved["value"], saved["step"], saved["bad_evals"]


class Evaluation:
    """When a run evaluates, what it keeps of the results, and whether they stop it (the runner's view)."""

    def __init__(self, recipe: Any, engine: Any, loss: Any, eval_set: EvalSet | None, run_dir: Any, total_steps: int):
        self.recipe, self.engine, self.loss, self.eval_set = recipe, engine, loss, eval_set
        self.run_dir, self.total_steps = run_dir, total_steps
        self.best = BestTracker.for_run(recipe) if eval_set is not None else None
        self.improved_at = -1

    @classmethod
    def for_run(cls, recipe: Any, engine: Any, loss: Any, examples: list[Example], pad_id: int, run_dir: Any,
                total_steps: int) -> Evaluation:
        from toolkit.train.distributed import init_world
        from toolkit.train.runner import pad_multiple

        eval_set = EvalSet(examples, micro_batch_size=recipe.micro_batch_size, dp_rank=engine.dp_rank,
                           dp_world_size=engine.dp_world_size, pad_id=pad_id, seq_len=recipe.seq_len,
                           pad_multiple=pad_multiple(init_world().device), pipeline_stages=recipe.pipeline_parallel,
                           virtual_stages=recipe.virtual_pipeline) if examples else None
        return cls(recipe, engine, loss, eval_set, run_dir, total_steps)

    def due(self, step: int) -> bool:
        every = self.recipe.eval_every
        return self.eval_set is not None and (step == self.total_steps or bool(every and step % every == 0))

    def run(self, step: int) -> dict[str, float]:
        """The eval metrics after ``step`` when an evaluation is due then (empty otherwise)."""
        if not self.due(step):
            return {}
        from toolkit.train.distributed import note_collective

        note_collective(f"the evaluation after step {step}")
        metrics = evaluate(self.engine, self.loss, self.eval_set)
        if self.best is not None and self.best.update(step, metrics):
            self.improved_at = step
        return metrics

    def wants_checkpoint(self, step: int) -> bool:
        """``--save-best``: a new best is saved at its step."""
        return bool(self.recipe.save_best) and self.improved_at == step

    def best_step(self) -> int | None:
        """The step whose checkpoint ``--keep-last`` must not remove."""
        return self.best.step if self.best is not None and self.recipe.save_best and self.best.value is not None else None

    def saved(self, step: int, path: Any) -> None:
        """After a checkpoint is written: ``best.json`` names it when it holds the best value."""
        if not (self.recipe.save_best and self.improved_at == step and self.engine.is_main):
            return
        import json
        import os

        record = {"metric": self.best.metric, "mode": self.best.mode, "value": self.best.value, "step": step,
                  "checkpoint": f"checkpoints/{path.name}"}  # relative to the run directory: it may move
        tmp = self.run_dir / ".best.json.tmp"  # renamed into place: never a half-written best.json
        tmp.write_text(json.dumps(record, indent=2) + "\n")
        os.replace(tmp, self.run_dir / "best.json")

    def stop_message(self, step: int) -> str | None:
        """Why the run stops early after ``step`` (an evaluation there used up the patience), else None."""
        if self.best is None or not self.due(step) or step == self.total_steps or not self.best.exhausted:
            return None
        return self.best.stop_message(step)

    def state(self) -> dict[str, Any]:
        return self.best.state() if self.best is not None else {}

    def restore(self, state: dict[str, Any]) -> None:
        if self.best is not None:
            self.best.restore(state)

    def report(self) -> None:
        """Name the best checkpoint at the end of the run."""
        if self.best is None or self.best.value is None or not self.engine.is_main or not self.recipe.save_best:
            return
        import sys

        where = self.run_dir / "checkpoints" / f"step-{self.best.step}"
        print(f"toolkit: best {self.best.metric} {self.best.value:.6g} at step {self.best.step}: {where} (best.json)",
              file=sys.stderr)
