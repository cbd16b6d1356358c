"""``--strategy auto``: plan for the machine the run is on and turn the best layout into recipe overrides."""

from __future__ import annotations

import os
from typing import Any

from toolkit.errors import LayoutError
from toolkit.plan.hardware import detect_gpu_kind, make_cluster
from toolkit.plan.memory import STRATEGIES, Workload
from toolkit.plan.model import ModelShape, load_shape, shape_from_config

LOCAL = {"strategy": "local", "tensor_parallel": 1, "pipeline_parallel": 1, "virtual_pipeline": 1, "context_parallel": 1,
         "expert_parallel": 1, "sequence_parallel": False}
TUNER_FAMILY = {"full": "full", "freeze": "full", "lora": "lora", "dora": "lora", "qlora": "qlora"}


def shape_of(source: Any) -> ModelShape:
    """A ModelShape from a ModelSource, an HF config object, a config dict, or a path."""
    config = getattr(source, "config", source)
    if hasattr(config, "to_dict"):
        name = str(getattr(source, "reference", getattr(config, "name_or_path", "model")) or "model")
        return shape_from_config(config.to_dict(), name=name)
    if isinstance(config, dict):
        return shape_from_config(config)
    return load_shape(config)


def _model_config(recipe: Any) -> Any:
    """The model's config without loading weights: config.json of a directory, else the loader's."""
    from pathlib import Path

    if Path(recipe.model).is_dir() or Path(recipe.model).is_file():
        return Path(recipe.model)
    from toolkit.models import resolve_model

    return resolve_model(recipe.model, trust_remote_code=getattr(recipe, "trust_remote_code", False))


def installed_strategies() -> tuple[str, ...]:
    try:
        from toolkit.plugins import get_plugin_manager

        registered = set(get_plugin_manager().registry("strategy"))
    except Exception:  # a broken plugin must not stop --strategy auto from choosing 'local'
        registered = {"local"}
    return tuple(s for s in STRATEGIES if s in registered) or ("local",)


def _gpu_memory_and_kind(gpu_memory: Any) -> tuple[Any, str | None]:
    """(memory, kind) of this machine's GPU, or (None, None) without CUDA."""
    try:
        import torch
    except ImportError:
        return gpu_memory, None
    if not torch.cuda.is_available():
        return gpu_memory, None
    kind = detect_gpu_kind(torch.cuda.get_device_name(0))
    if gpu_memory is None:
        gpu_memory = torch.cuda.get_device_properties(0).total_memory
    return gpu_memory, kind


def local_precision(recipe: Any) -> dict:
    """The ``local`` engine's precision options as Workload fields (``--local-*`` flags)."""
    from toolkit.train.hf_engine import LocalConfig

    local = recipe.section("local") if hasattr(recipe, "section") else {}
    bf16 = getattr(recipe, "precision", "bf16") == "bf16"
    scheme = LocalConfig(bf16_mode=local.get("bf16_mode"), master_weights=local.get("master_weights")).bf16_scheme()
    return {"bf16_mode": scheme if bf16 else "autocast",
            "logps_chunk_tokens": int(local.get("logps_chunk_tokens", 2048) or 2048),
            "recompute_logits": bool(local.get("recompute_logits", False))}


def local_speed(recipe: Any) -> dict:
    """The ``local`` engine's speed levers (and the megatron engine's fused head) as they resolve on a GPU, as
    Workload fields: ``auto`` kernels are Triton, ``auto`` packed attention FlexAttention, the ``auto`` fused losses
    are on; either way a fused head
    serves only a loss that declares a uniform token gradient (pt, sft)."""
    local = recipe.section("local") if hasattr(recipe, "section") else {}
    megatron = recipe.section("megatron") if hasattr(recipe, "section") else {}
    kernels = str(local.get("kernels", "auto") or "auto")
    fused, megatron_fused = local.get("fused_loss", "auto"), megatron.get("fused_loss", "auto")
    uniform = _uniform_loss(getattr(recipe, "loss", "sft"))
    return {"kernels": planned_kernels(kernels),
            "packed_attention": planned_packed_attention(str(local.get("packed_attention", "auto") or "auto")),
            "fused_loss": (fused == "auto" or bool(fused)) and uniform,
            "megatron_fused_loss": (megatron_fused == "auto" or bool(megatron_fused)) and uniform}


def planned_kernels(choice: str) -> str:
    """``--local-kernels`` as it resolves on the GPU being planned for: ``auto`` is ``triton``."""
    return "triton" if choice == "auto" else choice


def planned_packed_attention(choice: str) -> str:
    """``--local-packed-attention`` as it resolves on the GPU being planned for: ``auto`` is ``flex``."""
    return "flex" if choice == "auto" else choice


def _uniform_loss(name: str) -> bool:
    from toolkit.train.speed import declares_uniform_gradient

    try:
        from toolkit.plugins import get_plugin_manager

        return declares_uniform_gradient(get_plugin_manager().get("loss", name))
    except Exception:  # an unknown or broken loss plugin: plan the chunked head, which every loss takes
        return False


def choose_strategy(recipe: Any, source: Any = None, world_size: int | None = None, gpu_memory: Any = None) -> dict[str, Any]:
    """Recipe overrides for the fastest layout that fits ``world_size`` GPUs of this machine.

    ``source``: a ModelSource, HF config, config dict or path; None (or an int, read as
    ``world_size``, for ``choose_strategy(recipe, world_size)``) plans ``recipe.model``.
    ``gpu_memory``: bytes or a string such as "80GiB"; None asks CUDA. Without CUDA the answer
    is the ``local`` strategy (one process or DDP over gloo), whatever the model.
    """
    from toolkit.plan.search import plan

    if isinstance(source, int) and not isinstance(source, bool):
        source, world_size = None, source
    world_size = world_size or int(os.environ.get("WORLD_SIZE", "1"))
    gpu_memory, kind = _gpu_memory_and_kind(gpu_memory)
    if kind is None:
        return dict(LOCAL)
    if source is None:
        source = _model_config(recipe)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world_size) or world_size)
    nodes = max(1, world_size // max(1, local_world))
    section = recipe.section("lora") if hasattr(recipe, "section") else {}
    workload = Workload(seq_len=recipe.seq_len, micro_batch_size=recipe.micro_batch_size,
                        global_batch_size=recipe.global_batch_size, tuner=TUNER_FAMILY.get(recipe.tuner, "lora"),
                        lora_rank=int(section.get("rank", 16) or 16), **local_precision(recipe), **local_speed(recipe))
    cluster = make_cluster(world_size, nodes, gpu_memory, kind)
    result = plan(shape_of(source), cluster, workload, installed_strategies())
    # toolkit-moe splits experts under local only in the blocks it patches: its --ep layouts need --moe-enabled,
    # which auto does not switch on by itself (it would replace the model's MoE blocks)
    moe = recipe.section("moe") if hasattr(recipe, "section") else {}
    runnable = [c for c in result.ranked if c.layout.ep == 1 or c.layout.strategy == "megatron" or moe.get("enabled")]
    if not runnable:
        from toolkit.plan.report import render

        raise LayoutError(f"--strategy auto: no installed strategy fits {world_size} GPU(s) for this run.\n"
                          + render(result, top=0))
    return runnable[0].layout.recipe_overrides()
