"""Megatron-Core distributed checkpoints (``dist_checkpointing``) of toolkit models.

A toolkit mcore directory holds the ``dist_checkpointing`` files (layout-independent: tensors
are stored by global key and shard offsets, so a checkpoint saved at TP2 loads at PP2),
``toolkit_mcore.json`` (format marker, padded vocabulary, the layout it was saved at, how fused
gate_up LoRA rows are kept) and the HF ``config.json`` plus tokenizer files, so it can be
converted back to HF without the source.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from toolkit.errors import LayoutError, ModelError
from toolkit.parallel import ParallelLayout
from toolkit.train.distributed import one_process_group
from toolkit.writes import replace_directory
from toolkit_megatron.bridge import unwrap
from toolkit_megatron.compat import cpu_compat

MARKER = "toolkit_mcore.json"


def is_mcore_dir(path: str | Path) -> bool:
    return (Path(path) / MARKER).is_file()


def read_marker(path: str | Path) -> dict[str, Any]:
    marker = Path(path) / MARKER
    if not marker.is_file():
        raise ModelError(f"{path} is not a toolkit Megatron checkpoint (no {MARKER})")
    return json.loads(marker.read_text())


def model_sharded_state_dict(models: list[Any], metadata: dict | None = None) -> dict[str, Any]:
    return {f"model{i}": unwrap(m).sharded_state_dict(metadata=dict(metadata or {})) for i, m in enumerate(models)}


def save_mcore(models: list[Any], directory: str | Path, hf_config: Any, layout: ParallelLayout, *, extra: dict | None = None,
               tokenizer_source: Path | None = None, optimizer: Any = None, async_save: bool = False) -> Any:
    """Save model chunks (and optionally a Megatron optimizer) collectively; complete or absent.

    Writes into ``<directory>.tmp`` and renames on rank 0 after every rank finished. With
    ``async_save`` returns Megatron's ``AsyncRequest`` (call :func:`finish_async_save` later).
    """
    from megatron.core import dist_checkpointing

    final = Path(directory)
    tmp = final.with_name(final.name + ".tmp")
    rank = torch.distributed.get_rank()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    torch.distributed.barrier()
    state = model_sharded_state_dict(models)
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(state, **_optimizer_format(optimizer))
    _start_results_queue()
    options: dict[str, Any] = {"async_sharded_save": async_save}
    if async_save and "async_strategy" in inspect.signature(dist_checkpointing.save).parameters:
        # megatron-core 0.19 defaults to "nvrx" (nvidia-resiliency-ext); its own "mcore" worker needs nothing more
        options["async_strategy"] = "mcore"
    with cpu_compat():
        request = dist_checkpointing.save(state, str(tmp), **options)
    finalize = _Finalize(final, tmp, hf_config, layout, unwrap(models[0]).vocab_size, extra or {}, tokenizer_source)
    if async_save:
        request.add_finalize_fn(finalize)
        return request
    finalize()
    return None


class _Finalize:
    def __init__(self, final: Path, tmp: Path, hf_config: Any, layout: ParallelLayout, padded_vocab: int, extra: dict,
                 tokenizer_source: Path | None):
        self.args = (final, tmp, hf_config, layout, padded_vocab, extra, tokenizer_source)

    def __call__(self) -> None:
        final, tmp, hf_config, layout, padded_vocab, extra, tokenizer_source = self.args
        torch.distributed.barrier()
        if torch.distributed.get_rank() == 0:
            marker = {"format": "toolkit-mcore", "version": 1, "model_type": hf_config.model_type,
                      "padded_vocab_size": padded_vocab, "saved_layout": layout.__dict__, GATE_UP_ROWS: "halves", **extra}
            (tmp / MARKER).write_text(json.dumps(marker, indent=2))
            hf_config.save_pretrained(tmp)
            if tokenizer_source is not None:
                from toolkit_megatron.hf_io import copy_tokenizer_files

                copy_tokenizer_files(tokenizer_source, tmp)
            replace_directory(tmp, final)
        torch.distributed.barrier()


GATE_UP_ROWS = "gate_up_adapter_rows"
"""The marker's entry saying how fused gate_up LoRA rows are saved: ``"halves"`` of ``[gate; up]`` (absent: saved
before, as each rank's ``[gate shard; up shard]`` in one block, see :func:`gate_up_rows`)."""
_SAVED_BLOCKS = "toolkit_gate_up_blocks"
"""``sharded_state_dict`` metadata for a checkpoint without :data:`GATE_UP_ROWS`: ``{"dense": n, "expert": n}``,
the (expert) tensor-parallel sizes it was saved at, whose ranks' blocks its fused gate_up LoRA rows are."""


def load_metadata(marker: dict[str, Any]) -> dict[str, Any]:
    """``sharded_state_dict`` metadata to load the checkpoint of ``marker`` with."""
    if marker.get(GATE_UP_ROWS) == "halves":
        return {}
    saved = marker.get("saved_layout", {})
    tensor = saved.get("tensor", 1)
    return {_SAVED_BLOCKS: {"dense": tensor, "expert": saved.get("expert_tensor") or tensor}}


def gate_up_rows(entry: Any, sharded_offsets: tuple, metadata: dict | None, *, expert: bool) -> Any:
    """The checkpoint entry of a fused gate_up LoRA tensor (rows: this rank's ``[gate shard; up shard]``, as
    :class:`toolkit_megatron.lora.LoRALinear` holds them) saved, like the gated ``linear_fc1.weight`` in Megatron's
    MLP, as the halves of the whole ``[gate; up]``, so that it loads at any (expert) tensor-parallel size; at a
    group of one, the tensor saved before. A checkpoint saved before at a larger group holds the rows as its ranks'
    blocks (``metadata``, :func:`load_metadata`): then they are read from there."""
    from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

    metadata = metadata or {}
    blocks = metadata.get(_SAVED_BLOCKS, {}).get("expert" if expert else "dense", 1)
    if blocks == 1:
        return apply_swiglu_sharded_factory(entry, sharded_offsets, metadata.get("singleton_local_shards", False))
    return _saved_blocks(entry, sharded_offsets, blocks)


def _saved_blocks(entry: Any, sharded_offsets: tuple, blocks: int) -> Any:
    """``entry`` read from rows saved as ``blocks`` ranks' ``[gate shard; up shard]`` in rank order: cut into
    chunks that lie whole in one shard of either layout, each read from its place among the blocks."""
    import math

    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    axis = len(sharded_offsets)
    ranks = entry.axis_fragmentations[axis]
    rank = entry.global_offset[axis] // entry.local_shape[0]
    chunks = math.lcm(ranks, blocks)  # of each half
    per_rank, per_block = chunks // ranks, chunks // blocks

    def build(key: str, tensor: torch.Tensor, replica_id: Any, flattened_range: Any) -> list[Any]:
        pieces = []
        for index, piece in enumerate(tensor.chunk(2 * per_rank)):
            half, chunk = divmod(index, per_rank)
            chunk += rank * per_rank  # in the whole half
            place = (chunk // per_block) * 2 * per_block + half * per_block + chunk % per_block
            pieces.append(ShardedTensor.from_rank_offsets(key, piece, *sharded_offsets, (axis, place, 2 * chunks),
                                                          replica_id=replica_id, prepend_axis_num=axis))
        return pieces

    return ShardedTensorFactory(entry.key, entry.data, build, torch.cat, entry.replica_id, flattened_range=entry.flattened_range)


def _optimizer_format(optimizer: Any) -> dict[str, Any]:
    """The distributed optimizer's ``dp_reshardable`` format (its default fails on 0.16); others take none."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    return {"sharding_type": "dp_reshardable"} if any(isinstance(o, DistributedOptimizer) for o in inner) else {}


def _start_results_queue() -> None:
    """On a CPU-only process, start the queue Megatron-Core's file writer reports its write results through by fork.

    Megatron-Core starts it on first use as a ``multiprocessing`` manager by ``spawn``: a fresh interpreter, which
    imports torch to unpickle the first results it holds (3.5 s of CPU in every process that saves, at every run).
    Forked, the manager has torch already; it runs the manager's server loop only. A process that has initialised
    CUDA keeps Megatron-Core's spawn: on an H100 (megatron-core 0.19) the first run that saved after its forked
    manager started hung at that save, 2026-12-07. :func:`stop_checkpoint_workers` ends it either way.
    """
    import multiprocessing

    import torch
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if torch.cuda.is_initialized():
        return
    if getattr(filesystem_async, "_results_queue", False) is None:  # not started yet (absent: a release without it)
        filesystem_async._results_queue = multiprocessing.get_context("fork").Manager().Queue()


def stop_checkpoint_workers() -> None:
    """End the multiprocessing manager Megatron's async file writer starts for its results queue.

    It is a child of this process; runs that leave through ``os._exit`` (the clean gloo exit)
    would otherwise orphan it, and it keeps the parent's stdout/stderr open.
    """
    import multiprocessing

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    filesystem_async._results_queue = None
    for child in multiprocessing.active_children():
        if child.name.startswith("SyncManager"):
            child.terminate()
            child.join(timeout=10)


def check_reload_layout(directory: str | Path, layout: ParallelLayout) -> int:
    """The saved padded vocabulary, after checking it splits evenly over ``layout.tensor``."""
    padded = int(read_marker(directory)["padded_vocab_size"])
    if padded % layout.tensor:
        raise LayoutError(f"{directory} was saved with a vocabulary padded to {padded} rows; "
                          f"{padded} / tp {layout.tensor} = {padded / layout.tensor:.2f} is not a whole number. "
                          "Load it at a tensor-parallel size that divides the padded vocabulary.")
    return padded


def load_mcore(models: list[Any], directory: str | Path, optimizer: Any = None) -> dict[str, Any]:
    """Load model chunks (and optimizer) from a toolkit mcore directory, at any layout."""
    from megatron.core import dist_checkpointing

    marker = read_marker(directory)
    state = model_sharded_state_dict(models, load_metadata(marker))
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=True, **_optimizer_format(optimizer))
    from toolkit.train.safe_load import check_dcp_metadata

    check_dcp_metadata(Path(directory))  # torch_dist's .metadata is a pickle: refuse one that would run code
    with cpu_compat(), torch.no_grad(), weights_only_entries(Path(directory)):
        loaded = dist_checkpointing.load(state, str(directory))
        for i, model in enumerate(models):
            missing, _ = unwrap(model).load_state_dict(loaded[f"model{i}"], strict=False)
            missing = [k for k in missing if not k.endswith("_extra_state")]
            if missing:
                raise ModelError(f"{directory} lacks {len(missing)} weights of this model, e.g. {missing[:3]}")
        if optimizer is not None:
            optimizer.load_state_dict(loaded["optimizer"])
    return marker


@contextlib.contextmanager
def weights_only_entries(directory: Path) -> Iterator[None]:
    """Read the checkpoint's non-tensor entries (extra states, sharded objects) weights-only while it loads.

    Megatron-Core's torch_dist strategy loads through its ``MCoreLoadPlanner``, a torch DefaultLoadPlanner
    that unpickles them with ``weights_only=False``; it names the class at call time, so it is swapped for
    its weights-only form here. ``common.pt`` is read by ``torch.load`` (weights-only by default): its
    refusal becomes one line too.
    """
    import pickle

    from megatron.core.dist_checkpointing.strategies import torch as torch_strategy

    from toolkit.train.safe_load import UnsafeCheckpointError, named_refusal, weights_only_planner

    planner = torch_strategy.MCoreLoadPlanner
    torch_strategy.MCoreLoadPlanner = weights_only_planner(planner)
    try:
        with named_refusal(directory):
            yield
    except pickle.UnpicklingError as exc:
        detail = next((line for line in str(exc).splitlines() if "GLOBAL" in line), str(exc).splitlines()[0])
        raise UnsafeCheckpointError(f"{directory}: a file holds objects a weights-only load refuses ({detail.strip()[:200]}); "
                                    "it was not loaded. Use a checkpoint you or toolkit wrote") from None
    finally:
        torch_strategy.MCoreLoadPlanner = planner


def mcore_to_hf_tensors(directory: str | Path, lora: tuple | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """HF tensors from a toolkit mcore directory, loaded in this process (TP1/PP1).

    ``lora``: ``(adapters, dropout)`` when the checkpoint holds LoRA adapters (a LoRA
    run's checkpoint); they are merged into the exported weights. Starts a one-process gloo
    group when torch.distributed is not initialised yet.
    """
    from transformers import AutoConfig

    from toolkit_megatron.bridge import export_hf_tensors
    from toolkit_megatron.model import build_model, initialize_parallel

    hf_config = AutoConfig.from_pretrained(directory, trust_remote_code=False)
    own_group = one_process_group()  # reads to CPU: gloo
    try:
        layout = ParallelLayout()
        padded = check_reload_layout(directory, layout)
        initialize_parallel(layout)
        dtype = getattr(torch, read_marker(directory).get("dtype", "float32"))
        models = build_model(hf_config, layout, dtype=dtype, vocab_size=padded)
        if lora is not None:
            from toolkit_megatron.lora import apply_lora, export_merged

            apply_lora(models, lora[0], lora[1], hf_config, padded)
            load_mcore(models, directory)
            yield from export_merged(models, hf_config)
        else:
            load_mcore(models, directory)
            yield from export_hf_tensors(models, hf_config)
    finally:
        if own_group:
            from megatron.core import parallel_state

            parallel_state.destroy_model_parallel()
            torch.distributed.destroy_process_group()


