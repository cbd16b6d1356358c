"""The DeepSpeed JSON a run uses: built from the toolkit's flags, merged with a user's own file.

The toolkit's flags own every setting they express (ZeRO stage, offload, precision, batch sizes,
clipping, AdamW hyper-parameters). A user's JSON may repeat them with the same value or with
``"auto"``; a different value is a conflict, reported with the key, both values and the flag,
before any model memory is allocated. Keys the flags do not cover (bucket sizes, overlap,
``stage3_*`` tuning, communication dtypes...) pass through unchanged.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path
from typing import Any, Literal

from toolkit.config import option
from toolkit.errors import ConfigError


@dataclasses.dataclass(kw_only=True)
class DeepSpeedOptions:
    """Options of ``--strategy deepspeed`` (flags ``--deepspeed-*``, YAML section ``deepspeed:``)."""

    config: str = option("", help="Your own DeepSpeed JSON; merged with the flags, conflicts refused.")
    offload_optimizer: Literal["none", "cpu"] = option("none", help="ZeRO-Offload: keep optimizer states (and the step) on the CPU.")
    offload_param: Literal["none", "cpu"] = option("none", help="ZeRO-3 only: keep parameters on the CPU between uses.")
    zero_init: bool = option(True, help="ZeRO-3: build the model already partitioned (deepspeed.zero.Init), never whole on one rank.")
    logps_chunk_tokens: int = option(2048, help="Tokens per chunk when computing label log-probs (bounds logits memory).")
    packed_attention: Literal["auto", "flex", "sdpa-mask"] = option(
        "auto", help="Rows holding several samples: flex (FlexAttention, block-causal BlockMask), sdpa-mask (dense mask "
        "for HF's sdpa attention) or auto (flex on a CUDA device when it can run, else sdpa-mask); as --local-packed-attention.")

    def check(self) -> list[str]:
        problems = []
        if self.logps_chunk_tokens < 1:
            problems.append(f"logps_chunk_tokens must be at least 1, got {self.logps_chunk_tokens}")
        return problems  # the JSON file is read when training starts, so exporting a run never needs it


@dataclasses.dataclass
class Mapped:
    """One DeepSpeed key the toolkit sets from a flag."""

    path: tuple[str, ...]
    value: Any
    flag: str


def batch_layout(recipe: Any, world_size: int) -> tuple[int, int, int]:
    """(micro batch, accumulation steps, global batch) as the runner's data pipeline will use them."""
    micro = recipe.micro_batch_size
    global_batch = recipe.global_batch_size or micro * world_size
    accumulation = max(1, global_batch // (micro * world_size))
    return micro, accumulation, global_batch


def mapped_settings(recipe: Any, options: DeepSpeedOptions, world_size: int) -> list[Mapped]:
    """Every DeepSpeed key the toolkit's flags decide, with the flag that decides it."""
    micro, accumulation, global_batch = batch_layout(recipe, world_size)
    settings = [
        Mapped(("zero_optimization", "stage"), recipe.zero, "--zero"),
        Mapped(("train_micro_batch_size_per_gpu",), micro, "--micro-batch-size"),
        Mapped(("gradient_accumulation_steps",), accumulation, "--global-batch-size"),
        Mapped(("train_batch_size",), global_batch, "--global-batch-size"),
        Mapped(("gradient_clipping",), float(recipe.max_grad_norm), "--max-grad-norm"),
        Mapped(("bf16", "enabled"), recipe.precision == "bf16", "--precision"),
        Mapped(("fp16", "enabled"), recipe.precision == "fp16", "--precision"),
        Mapped(("optimizer", "type"), "AdamW", "the toolkit's optimizer"),
        Mapped(("optimizer", "params", "lr"), recipe.lr, "--lr"),
        Mapped(("optimizer", "params", "betas"), [recipe.adam_beta1, recipe.adam_beta2], "--adam-beta1/--adam-beta2"),
        Mapped(("optimizer", "params", "eps"), recipe.adam_eps, "--adam-eps"),
        Mapped(("optimizer", "params", "weight_decay"), recipe.weight_decay, "--weight-decay"),
    ]
    if options.offload_optimizer != "none" or recipe.zero >= 1:
        settings.append(Mapped(("zero_optimization", "offload_optimizer", "device"), options.offload_optimizer,
                               "--deepspeed-offload-optimizer"))
    if options.offload_param != "none" or recipe.zero == 3:
        settings.append(Mapped(("zero_optimization", "offload_param", "device"), options.offload_param, "--deepspeed-offload-param"))
    return settings


def read_user_config(path: str) -> dict[str, Any]:
    if not path:
        return {}
    file = Path(path)
    try:
        data = json.loads(file.read_text())
    except FileNotFoundError:
        raise ConfigError(f"--deepspeed-config {path}: no such file") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--deepspeed-config {path} is not valid JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--deepspeed-config {path} must hold a JSON object at the top level")
    return data


def _lookup(data: dict[str, Any], path: tuple[str, ...]) -> tuple[bool, Any]:
    node: Any = data
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return False, None
        node = node[key]
    return True, node


def _assign(data: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    node = data
    for key in path[:-1]:
        node = node.setdefault(key, {})
    node[path[-1]] = value


def _same(theirs: Any, ours: Any) -> bool:
    if isinstance(ours, bool) or isinstance(theirs, bool):
        return bool(theirs) == ours if isinstance(theirs, bool) else False
    if isinstance(ours, (int, float)) and isinstance(theirs, (int, float)):
        return abs(float(theirs) - float(ours)) <= 1e-12 * max(1.0, abs(float(ours)))
    if isinstance(ours, list) and isinstance(theirs, (list, tuple)):
        return len(ours) == len(theirs) and all(_same(a, b) for a, b in zip(theirs, ours))
    if isinstance(ours, str) and isinstance(theirs, str):
        return theirs.lower() == ours.lower()
    return theirs == ours


def merge_config(recipe: Any, options: DeepSpeedOptions, world_size: int,
                 user: dict[str, Any] | None = None) -> tuple[dict[str, Any], list[str]]:
    """The merged DeepSpeed config and the list of conflicts between the user's JSON and the flags."""
    user = copy.deepcopy(user if user is not None else read_user_config(options.config))
    where = f"--deepspeed-config {options.config}" if options.config else "the DeepSpeed config"
    problems: list[str] = []
    merged = copy.deepcopy(user)
    for setting in mapped_settings(recipe, options, world_size):
        present, theirs = _lookup(user, setting.path)
        key = ".".join(setting.path)
        if present and theirs != "auto" and not _same(theirs, setting.value):
            problems.append(f"{where}: {key} = {json.dumps(theirs)} contradicts {setting.flag} "
                            f"(which gives {json.dumps(setting.value)}); remove the key, set it to \"auto\", or change the flag")
        _assign(merged, setting.path, setting.value)
    if "scheduler" in user:
        problems.append(f"{where}: a 'scheduler' section is not supported; the toolkit schedules the learning rate from "
                        "--lr, --warmup-steps, --schedule and --min-lr-ratio (remove the section)")
    zero = merged.setdefault("zero_optimization", {})
    for name in ("offload_optimizer", "offload_param"):
        if zero.get(name, {}).get("device") == "none":
            zero.pop(name)
    # The client optimizer is torch AdamW (or DeepSpeedCPUAdam under offload on an accelerator).
    merged.pop("optimizer", None)
    merged["zero_allow_untested_optimizer"] = True
    merged["zero_force_ds_cpu_optimizer"] = False
    merged.setdefault("steps_per_print", 10**9)
    merged.setdefault("wall_clock_breakdown", False)
    return merged, problems


def layout_problems(recipe: Any, options: DeepSpeedOptions, world_size: int) -> list[str]:
    """What the flags alone ask for that this strategy cannot do."""
    problems = []
    if options.offload_param != "none" and recipe.zero != 3:
        problems.append(f"--deepspeed-offload-param {options.offload_param} needs --zero 3 (got --zero {recipe.zero}); "
                        "ZeRO-1/2 keep parameters on the device")
    if options.offload_optimizer != "none" and recipe.zero == 0:
        problems.append("--deepspeed-offload-optimizer needs --zero 1, 2 or 3")
    if recipe.precision == "fp16":
        problems.append("--precision fp16 is not supported with --strategy deepspeed (dynamic loss scaling skips steps "
                        "the other strategies take); use --precision bf16")
    micro, _, global_batch = batch_layout(recipe, world_size)
    if global_batch % (micro * world_size):
        problems.append(f"--global-batch-size {global_batch} must be a multiple of --micro-batch-size {micro} x "
                        f"{world_size} data-parallel ranks")
    return problems
