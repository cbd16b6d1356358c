"""The training recipe: shared flags as one dataclass, per-thing option sections, YAML + flag merging."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, Literal

from toolkit.config import build_dataclass, option, to_dict
from toolkit.errors import ConfigError

# Kinds whose registered things expose their Config as CLI flags (``--lora-rank``) and as
# YAML sections (``lora: {rank: 16}``); an architecture with Config fields (toolkit-moe's
# ``moe``) gets a section too, and so do a reward (toolkit-rl's ``answer``) and a tracker (``wandb``).
OPTION_KINDS = ("strategy", "tuner", "optimizer", "loss", "dataset_format", "architecture", "reward", "callback")


@dataclasses.dataclass(kw_only=True)
class Recipe:
    """Everything one training run needs; ``recipe.yaml`` in the run directory is this, resolved."""

    model: str = option("tiny-llama", help="HF model directory or embedded preset (tiny-llama, tiny-qwen2, ...).")
    dataset: list[str] = option(["demo"], help="Dataset file (jsonl/json/parquet/csv) or bundled name; repeatable.")
    dataset_ratios: list[float] = option([], help="Mix the --dataset files in these proportions (one per --dataset, "
                                                  "repeatable, e.g. 0.7 then 0.3); the mix keeps their total size, "
                                                  "drawing from small sets more than once. With --streaming each record "
                                                  "is drawn from a set with these odds (seeded), a set restarting when "
                                                  "used up. Default: each as it is.")
    dataset_format: str = option("auto", help="Record format: auto, alpaca, messages, sharegpt, text, or a plugin's.")
    columns: dict[str, str] = option({}, help="Column remapping, 'ours=theirs' (e.g. instruction=question).")
    output: str = option("runs/latest", help="Run directory (recipe.yaml, metrics.jsonl, checkpoints/).")
    loss: str = option("sft", help="Training objective (pt, sft, or a plugin's: dpo, kto, ...).")
    tuner: str = option("full", help="What trains: full, freeze, or a plugin's (lora, dora, qlora).")
    strategy: str = option("local", help="How the model is placed: local (one process or DDP), fsdp, deepspeed, megatron, auto.")

    tensor_parallel: int = option(1, help="Tensor-parallel size.", flag="--tp", aliases=("--tensor-parallel",))
    pipeline_parallel: int = option(1, help="Pipeline-parallel size.", flag="--pp", aliases=("--pipeline-parallel",))
    virtual_pipeline: int = option(1, help="Virtual pipeline stages per rank (interleaved 1F1B).", flag="--vpp")
    context_parallel: int = option(1, help="Context-parallel size (long sequences).", flag="--cp")
    expert_parallel: int = option(1, help="Expert-parallel size (MoE).", flag="--ep")
    expert_tensor_parallel: int = option(1, help="Expert tensor-parallel size (MoE).", flag="--etp")
    sequence_parallel: bool = option(False, help="Sequence parallelism with tensor parallelism.")
    zero: int = option(0, help="DeepSpeed ZeRO stage (0-3) for --strategy deepspeed.")

    max_steps: int = option(0, help="Optimizer steps; 0 runs --epochs over the data.")
    epochs: float = option(1.0, help="Passes over the data when --max-steps is 0.")
    lr: float = option(1e-4, help="Peak learning rate.")
    min_lr_ratio: float = option(0.1, help="Final learning rate as a fraction of --lr.")
    warmup_steps: int = option(0, help="Linear warmup steps.")
    schedule: Literal["cosine", "linear", "constant"] = option("cosine", help="Learning-rate decay after warmup.")
    optimizer: str = option("adamw", help="How the weights are updated: adamw, adafactor, or a plugin's (adamw-8bit, "
                                          "galore: the toolkit-optim plugin, docs/installing.md); its options are --NAME-FIELD flags.")
    weight_decay: float = option(0.0, help="Decoupled weight decay (matrices only; every optimizer).")
    adam_beta1: float = option(0.9, help="AdamW beta1.")
    adam_beta2: float = option(0.999, help="AdamW beta2.")
    adam_eps: float = option(1e-8, help="AdamW epsilon.")
    max_grad_norm: float = option(1.0, help="Gradient clipping norm; 0 disables clipping.")
    router_aux_loss_coef: float | None = option(None, help="MoE load-balancing loss weight (the HF config key it "
                                                           "overrides): weighs the mean over MoE layers of each layer's "
                                                           "Switch loss E * sum_e f_e P_e, the same objective on every "
                                                           "strategy; default: the model config's router_aux_loss_coef, "
                                                           "else 0.")
    router_z_loss_coef: float | None = option(None, help="MoE router z-loss weight (ST-MoE): weighs the mean over MoE "
                                                         "layers of mean(logsumexp(router logits)^2), the same on every "
                                                         "strategy; default: the model config's router_z_loss_coef, else "
                                                         "0. A plain HF model has no z-loss: use it with --moe-enabled "
                                                         "(toolkit-moe) or --strategy megatron.")
    micro_batch_size: int = option(1, help="Rows per micro-batch per data-parallel rank.")
    global_batch_size: int = option(0, help="Rows per optimizer step over all ranks; 0 means micro-batch x DP.")
    seq_len: int = option(512, help="Tokens per row. Longer SFT/preference samples are truncated (and counted); PT "
                                    "documents are joined and cut into rows of this length, never truncated.")
    packing: bool = option(False, help="Pack several samples per row by best-fit decreasing (no attention across "
                                       "samples; padding-free attention on CUDA).")
    group_by_length: bool = option(True, help="Without --packing: put samples of similar length in the same "
                                              "micro-batch (less padding); batches still come in a seeded random order.")
    streaming: bool = option(False, help="Read the datasets as a stream (datasets' streaming mode), a window of 4096 "
                                         "records at a time, for sets that do not fit in memory; needs --max-steps; "
                                         "mixes by --dataset-ratios; resumes exactly.")
    isolate_documents: bool = option(False, help="PT: keep each document's attention and positions to itself inside "
                                                 "the joined rows (block-causal mask); default: attention runs across "
                                                 "document boundaries, as in Megatron's GPT pretraining.")
    precision: Literal["fp32", "bf16", "fp16"] = option("fp32", help="Training precision (bf16 keeps fp32 master weights).")
    gradient_checkpointing: bool = option(False, help="Recompute activations in the backward pass.")
    seed: int = option(42, help="Seed for initialisation, shuffling and dropout.")
    max_samples: int = option(0, help="Use at most this many records per dataset (0: all).")
    eval_samples: int = option(0, help="Hold out this many examples of the training set (a seeded choice, never "
                                       "trained on) for evaluation (see --eval-every).")
    eval_split: float = option(0.0, help="Hold out this fraction of the training set (a seeded choice, never trained "
                                         "on) for evaluation, e.g. 0.05.")
    eval_dataset: list[str] = option([], help="Evaluation file(s) in any format --dataset accepts, encoded the same way; "
                                              "repeatable.")
    eval_every: int = option(0, help="Evaluate every N steps (and after the last one); 0: only after the last step.")
    save_best: str | None = option(None, help="Keep the checkpoint of the best value of this eval metric (e.g. "
                                              "eval/loss, eval/rewards/accuracies), saved when it improves and kept "
                                              "past --keep-last; best.json in the run directory names it.")
    best_mode: Literal["auto", "min", "max"] = option("auto", help="Whether lower (min) or higher (max) is better for "
                                                                   "--save-best and early stopping; auto: max for "
                                                                   "accuracies, rewards, margins and scores, else min.")
    early_stopping_patience: int = option(0, help="Stop when the metric (--save-best, else --early-stopping-metric) has "
                                                  "not improved in N evaluations in a row; 0: never.")
    early_stopping_threshold: float = option(0.0, help="An evaluation improves on the best only by more than this.")
    early_stopping_metric: str = option("eval/loss", help="The eval metric early stopping watches when --save-best is "
                                                          "not given.")

    save_every: int = option(0, help="Save a checkpoint every N steps (0: only at the end).")
    keep_last: int = option(2, help="Checkpoints to keep.")
    stop_after: int = option(0, help="Stop with a checkpoint after N steps of this invocation (time-boxed jobs; exit status 75, resumable); the schedule still spans the whole run.")
    resume: str | None = option(None, help="'auto' (newest whole checkpoint; damaged ones are reported and skipped) or a checkpoint path.")
    resume_changed: bool = option(False, help="With --resume: go on although the training settings differ from the run's "
                                              "recipe.yaml (model, data, seed, lr, ...); without it such a resume is refused, "
                                              "naming what changed.")
    checkpoint_verify: Literal["sha256", "size"] = option("sha256", help="How --resume checks a checkpoint against its "
                                                          "manifest.json: sha256 (every byte) or size (file sizes only; "
                                                          "for checkpoints too big to read back).")
    overwrite: bool = option(False, help="Allow reusing an output directory that holds a different run.")
    log_every: int = option(1, help="Log metrics every N steps.")
    report_to: list[str] = option([], help="Experiment trackers that receive the metrics: tensorboard, wandb, mlflow, "
                                           "swanlab, or a plugin's (repeatable); none for metrics.jsonl only. Default: "
                                           "tensorboard when it is installed.")
    run_name: str = option("", help="The run's name in trackers; default: the --output folder's name.")
    on_nan: Literal["stop", "skip", "rollback"] = option("stop", help="A step with a non-finite loss or gradient norm: stop (name the step, samples and last checkpoint), skip its update, or rollback to the last checkpoint and skip its batch.")
    max_nan_steps: int = option(3, help="With --on-nan skip or rollback: stop after this many non-finite steps in a row (0: never).")
    dist_timeout: float = option(600.0, help="Seconds a collective of a training step may wait for the other ranks before the job ends naming the rank and the collective (start-up and checkpoint writes wait up to $TOOLKIT_DIST_STARTUP_TIMEOUT, 600 s, when longer).")
    export: str | None = option(None, help="Export at the end with this exporter (hf, vllm, ...).")
    trust_remote_code: bool = option(False, help="Allow model code from the model directory.")
    precompute_reference: bool = option(False, help="Losses with a reference model (dpo, kto...): compute reference "
                                                    "log-probs once before training, cache them in the run directory "
                                                    "and free the reference model.")

    options: dict[str, Any] = option({}, help="Per-plugin option sections (filled from YAML sections and --NAME-KEY flags).", flag="--no-such-flag")

    def check(self) -> list[str]:
        problems = []
        for name in ("tensor_parallel", "pipeline_parallel", "virtual_pipeline", "context_parallel", "expert_parallel",
                     "expert_tensor_parallel", "micro_batch_size", "seq_len", "keep_last", "log_every"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("max_steps", "global_batch_size", "save_every", "stop_after", "warmup_steps", "max_samples", "eval_samples",
                     "max_nan_steps"):
            if getattr(self, name) < 0:
                problems.append(f"{name} must be 0 or more, got {getattr(self, name)}")
        problems += self._check_optimizer() + self._check_evaluation()
        if not self.dist_timeout > 0:
            problems.append(f"dist_timeout must be a positive number of seconds, got {self.dist_timeout}")
        if self.zero not in (0, 1, 2, 3):
            problems.append(f"zero must be 0, 1, 2 or 3, got {self.zero}")
        if not self.dataset:
            problems.append("dataset: give at least one --dataset")
        if self.streaming:
            problems += [f"streaming: {why}" for flag, why in (
                (not self.max_steps, "a stream's length is unknown before it is read: give --max-steps"),
                (self.eval_samples or self.eval_split, "--eval-samples/--eval-split hold examples out of a list; "
                 "not with --streaming (give --eval-dataset FILE)"),
                (self.precompute_reference, "--precompute-reference needs every example up front; not with --streaming"),
                (self.max_samples, "--max-samples: give --max-steps instead with --streaming")) if flag]
        return problems

    def _check_evaluation(self) -> list[str]:
        problems = []
        if not 0 <= self.eval_split < 1:
            problems.append(f"eval_split must be a fraction in [0, 1) of the training set, got {self.eval_split}")
        if self.eval_split and self.eval_samples:
            problems.append("eval_split and eval_samples both hold out training examples: give one of them")
        for name in ("eval_every", "early_stopping_patience"):
            if getattr(self, name) < 0:
                problems.append(f"{name} must be 0 or more, got {getattr(self, name)}")
        if not (math.isfinite(self.early_stopping_threshold) and self.early_stopping_threshold >= 0):
            problems.append(f"early_stopping_threshold must be 0 or more, got {self.early_stopping_threshold}")
        evaluates = self.eval_dataset or self.eval_samples or self.eval_split
        for flag, wanted in (("--save-best", self.save_best), ("--early-stopping-patience", self.early_stopping_patience)):
            if wanted and not evaluates:
                problems.append(f"{flag} needs evaluation data: give --eval-dataset FILE or --eval-split FRACTION")
        if self.early_stopping_patience and not self.eval_every:
            problems.append("--early-stopping-patience counts evaluations: give --eval-every N as well")
        metric = self.save_best or (self.early_stopping_metric if self.early_stopping_patience else "")
        if metric and not metric.startswith("eval/"):
            problems.append(f"--save-best/--early-stopping-metric {metric!r}: name an eval metric, e.g. eval/loss")
        return problems

    def _check_optimizer(self) -> list[str]:
        """Numbers torch would take and train on (an infinite lr writes an all-NaN checkpoint) or refuse with a
        traceback after the model has loaded."""
        problems = []
        finite = {name: getattr(self, name) for name in ("lr", "epochs", "min_lr_ratio", "weight_decay", "adam_beta1",
                                                         "adam_beta2", "adam_eps", "max_grad_norm")}
        for name, value in finite.items():
            if not math.isfinite(value):
                problems.append(f"{name} must be a finite number, got {value}")
        if math.isfinite(self.lr) and self.lr <= 0:
            problems.append(f"lr must be positive, got {self.lr}")
        if math.isfinite(self.epochs) and self.epochs <= 0 and not self.max_steps:
            problems.append(f"epochs must be positive when max_steps is 0, got {self.epochs}")
        if math.isfinite(self.min_lr_ratio) and not 0 <= self.min_lr_ratio <= 1:
            problems.append(f"min_lr_ratio must be between 0 and 1 (a fraction of --lr), got {self.min_lr_ratio}")
        if math.isfinite(self.weight_decay) and self.weight_decay < 0:
            problems.append(f"weight_decay must be 0 or more, got {self.weight_decay}")
        for name in ("adam_beta1", "adam_beta2"):
            value = getattr(self, name)
            if math.isfinite(value) and not 0 <= value < 1:
                problems.append(f"{name} must be in [0, 1), got {value}")
        if math.isfinite(self.adam_eps) and self.adam_eps <= 0:
            problems.append(f"adam_eps must be positive, got {self.adam_eps}")
        if math.isfinite(self.max_grad_norm) and self.max_grad_norm < 0:
            problems.append(f"max_grad_norm must be 0 (no clipping) or more, got {self.max_grad_norm}")
        for name in ("router_aux_loss_coef", "router_z_loss_coef"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value >= 0):
                problems.append(f"{name} must be 0 (off) or more, got {value}")
        return problems

    def section(self, name: str) -> dict[str, Any]:
        return dict(self.options.get(name, {}))

    def to_yaml_dict(self) -> dict[str, Any]:
        data = to_dict(self)
        options = data.pop("options")
        data.update({k: v for k, v in options.items() if v})
        return data


def read_yaml(path: str | Path) -> dict[str, Any]:
    import yaml

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"recipe file {path} does not exist", source=str(path))
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"{path} is not valid YAML{where}: {getattr(exc, 'problem', exc)}", source=str(path)) from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a mapping of option: value at the top level", source=str(path))
    return data


def resolve_recipe(values: dict[str, Any], source: str = "recipe", manager: Any = None) -> Recipe:
    """Build a validated :class:`Recipe` from merged YAML + flag values.

    Top-level keys are Recipe fields or names of registered strategies/tuners/losses/formats
    (their option sections). Every problem is collected and raised together.
    """
    from toolkit.plugins import get_plugin_manager

    manager = manager or get_plugin_manager()
    problems: list[str] = []
    recipe_fields = {f.name for f in dataclasses.fields(Recipe)}
    sections: dict[str, dict[str, Any]] = {}
    top: dict[str, Any] = {}
    for key, value in values.items():
        name = key.replace("-", "_")
        if name in recipe_fields and name != "options":
            top[name] = value
        elif _option_owner(manager, key) is not None:
            if isinstance(value, dict):
                sections.setdefault(key, {}).update(value)
            else:
                problems.append(f"{key}: expected a mapping of option: value (e.g. {key}: {{...}}), got {value!r}")
        elif name == "options" and isinstance(value, dict):
            for section, content in value.items():
                if _option_owner(manager, section) is None or not isinstance(content or {}, dict):
                    problems.append(f"options: {section!r} is not a registered strategy, tuner, loss or dataset format "
                                    "with a mapping of options")
                    continue
                sections.setdefault(section, {}).update(content or {})
        else:
            problems.append(_unknown_key(key, sorted(recipe_fields - {"options"}) + _option_names(manager)))
    recipe = build_dataclass(Recipe, top, source, problems)
    for kind, attr in (("strategy", "strategy"), ("tuner", "tuner"), ("optimizer", "optimizer"), ("loss", "loss"),
                       ("exporter", "export")):
        name = getattr(recipe, attr)
        if (kind == "strategy" and name == "auto") or name is None:
            continue
        if name not in manager.registry(kind):
            try:
                manager.registry(kind).get(name)
            except Exception as exc:
                problems.append(f"{attr}: {exc}")
    options: dict[str, Any] = {}
    for section, content in sections.items():
        owner = _option_owner(manager, section)
        options[section] = dataclasses.asdict(build_dataclass(owner.Config, content, f"{source}: {section}", problems))
    recipe.options = options
    problems += _move_replaced_options(recipe, manager, explicit=set(top))
    if problems:
        raise ConfigError(problems, source=source)
    return recipe


def replacement_flag(target: str) -> str:
    """The flag of the :class:`Recipe` field ``target`` that a deprecated section field (``option(replaced_by=...)``)
    moved to."""
    from toolkit.config import flag_name

    return flag_name(None, next(f for f in dataclasses.fields(Recipe) if f.name == target))


def _move_replaced_options(recipe: Recipe, manager: Any, explicit: set[str]) -> list[str]:
    """Move the values of deprecated section fields (``option(replaced_by=...)``) to the Recipe field that
    replaced them, printing one line per field (on the main rank); a conflicting value given both ways, or by two
    deprecated fields that feed one Recipe field, is a problem."""
    import os
    import sys

    from toolkit.config import flag_name

    problems = []
    moved: dict[str, str] = {}  # target -> the deprecated flag whose value it took (two old flags may feed one field)
    for section, values in recipe.options.items():
        for field in dataclasses.fields(_option_owner(manager, section).Config):
            target = field.metadata.get("replaced_by")
            if not target or values.get(field.name) is None:
                continue
            value, values[field.name] = values[field.name], None
            new_flag = replacement_flag(target)
            old_flag = flag_name(section, field)
            if (target in explicit or target in moved) and getattr(recipe, target) != value:
                current = getattr(recipe, target)
                other = f"{new_flag} {current}" if target in explicit else f"{moved[target]} {current} (deprecated)"
                problems.append(f"{old_flag} {value} (deprecated) and {other} disagree: give {new_flag} only")
                continue
            setattr(recipe, target, value)
            moved[target] = old_flag
            if os.environ.get("RANK", "0") == "0":
                print(f"toolkit: {old_flag} (YAML {section}: {field.name}) is deprecated; use {new_flag} {value} "
                      f"(YAML {target}: {value})", file=sys.stderr)
    return problems


def replaced_values(data: dict[str, Any], manager: Any) -> dict[str, Any]:
    """The Recipe fields that deprecated section fields of a recipe mapping hold (``{"moe": {"z_loss_coef": 0.01}}``
    gives ``{"router_z_loss_coef": 0.01}``): how a recipe.yaml written before a rename reads today."""
    values: dict[str, Any] = {}
    for section, content in data.items():
        owner = _option_owner(manager, section) if isinstance(content, dict) else None
        for field in dataclasses.fields(owner.Config) if owner is not None else ():
            target = field.metadata.get("replaced_by")
            if target and content.get(field.name) is not None:
                values.setdefault(target, content[field.name])
    return values


def _option_names(manager: Any) -> list[str]:
    """Names that may head a YAML option section (registered strategies, tuners, losses, formats)."""
    return sorted({name for kind in OPTION_KINDS for name in manager.registry(kind).names()})


def _unknown_key(key: str, candidates: list[str]) -> str:
    """A recipe key nobody registered: the plugin that provides a section of that name (``moe:``,
    ``deepspeed:``) when it is a first-party one that is not installed, else the closest key."""
    import difflib

    from toolkit.plugins import FIRST_PARTY, install_hint

    provider = next((dist for (kind, name), dist in FIRST_PARTY.items() if name == key and kind in OPTION_KINDS), None)
    if provider:
        return f"section {key!r} holds the options of {provider}, which is not installed: {install_hint(provider)}"
    close = difflib.get_close_matches(key.replace("-", "_"), candidates, n=1)
    return f"unknown key {key!r}" + (f"; did you mean {close[0]!r}?" if close else "")


def _option_owner(manager: Any, name: str) -> type | None:
    for kind in OPTION_KINDS:
        registry = manager.registry(kind)
        if name in registry:
            return registry.get(name)
    return None


def thing_options(recipe: Recipe, cls: type) -> Any:
    """The ``Config`` instance for a registered class, from the recipe's section for it."""
    return cls.Config(**recipe.section(cls.name))
