"""The ``mcore`` exporter (HF tensors -> Megatron-Core distributed checkpoint) and mcore sources.

``toolkit export SRC --to mcore --tp 2 --pp 1`` starts ``tp * pp`` local gloo
processes; each streams only its own shards from safetensors and they save collectively, so the
result is exactly what a TP2 training job would write. ``toolkit export MCORE_DIR --to hf`` is
served by :func:`resolve_mcore_source`, which the plugin returns from
``toolkit_resolve_export_source`` for directories holding ``toolkit_mcore.json``.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

from toolkit.config import option


@dataclass(kw_only=True)
class McoreExportConfig:
    tp: int = option(1, help="Tensor-parallel size of the processes that write the checkpoint.")
    pp: int = option(1, help="Pipeline-parallel size of the processes that write the checkpoint.")
    vpp: int = option(1, help="Virtual pipeline stages per rank.")
    ep: int = option(1, help="Expert-parallel size (MoE models); the processes are tp * pp * ep.")
    dtype: Literal["float32", "bfloat16", "float16"] = option("float32", help="Weight dtype in the checkpoint.")


class McoreExporter:
    """Write a Megatron-Core ``dist_checkpointing`` directory loadable at any TP/PP layout."""

    name: ClassVar[str] = "mcore"
    Config: ClassVar[type] = McoreExportConfig

    def __init__(self, config: McoreExportConfig | None = None):
        self.config = config or McoreExportConfig()

    def export(self, model: Any, output: Path, options: Any = None) -> Path:
        from toolkit.parallel import ParallelLayout
        from toolkit_megatron.architectures import architecture_for

        config = _as_config(options) if options is not None else self.config
        architecture = architecture_for(model.source.config.model_type)  # an unknown family is refused first
        architecture.check(model.source.config)
        layout = ParallelLayout(tensor=config.tp, pipeline=config.pp, virtual=config.vpp, expert=config.ep,
                                sequence_parallel=config.tp > 1 and architecture.moe)
        world = layout.tensor * layout.pipeline * layout.expert
        layout.check(model.source.config, world)
        output = Path(output)
        with tempfile.TemporaryDirectory(prefix="toolkit-mcore-") as staging:
            from toolkit_megatron.hf_io import save_hf_checkpoint

            hf_dir = save_hf_checkpoint(model.tensors(), model.source.config, Path(staging) / "hf")
            _spawn(world, _export_worker, (str(hf_dir), str(output), layout, config.dtype, str(model.source.directory)))
        return output


def _as_config(options: Any) -> McoreExportConfig:
    if isinstance(options, McoreExportConfig):
        return options
    if isinstance(options, dict):
        from toolkit.config import build_dataclass
        from toolkit.errors import ConfigError

        problems: list[str] = []
        config = build_dataclass(McoreExportConfig, options, "mcore exporter options", problems)
        if problems:
            raise ConfigError(problems)
        return config
    return McoreExportConfig(**{k: getattr(options, k) for k in ("tp", "pp", "vpp", "ep", "dtype") if hasattr(options, k)})


def _spawn(world: int, target: Any, args: tuple) -> None:
    import torch.multiprocessing as mp

    from toolkit.train.distributed import free_port

    port = free_port()
    mp.start_processes(_entry, args=(world, port, target, args), nprocs=world, start_method="spawn", join=True)


def _entry(rank: int, world: int, port: int, target: Any, args: tuple) -> None:
    import torch

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        target(*args)
        torch.distributed.barrier()
    finally:
        torch.distributed.destroy_process_group()


def _export_worker(hf_dir: str, output: str, layout: Any, dtype: str, tokenizer_source: str) -> None:
    import torch
    from transformers import AutoConfig

    from toolkit_megatron.bridge import SafetensorsReader, load_hf_weights
    from toolkit_megatron.checkpoint import save_mcore, stop_checkpoint_workers
    from toolkit_megatron.model import build_model, initialize_parallel

    hf_config = AutoConfig.from_pretrained(hf_dir, trust_remote_code=False)
    initialize_parallel(layout)
    models = build_model(hf_config, layout, dtype=getattr(torch, dtype))
    load_hf_weights(models, hf_config, SafetensorsReader.from_directory(Path(hf_dir)))
    save_mcore(models, output, hf_config, layout, extra={"dtype": dtype}, tokenizer_source=Path(tokenizer_source))
    stop_checkpoint_workers()


def resolve_mcore_source(path: str) -> Any:
    """An :class:`~toolkit.contracts.ExportModel` for a toolkit mcore directory, or ``None``."""
    from toolkit.contracts import ExportModel, ModelSource
    from toolkit_megatron.checkpoint import is_mcore_dir, mcore_to_hf_tensors

    if not is_mcore_dir(path):
        return None
    from transformers import AutoConfig

    from toolkit.models import check_remote_code

    directory = Path(path)
    # transformers would ask on a terminal (one "y" runs the code); the bridge builds only the architectures it knows
    check_remote_code(directory, False, "A Megatron-Core checkpoint is read through toolkit's bridge, which runs no "
                                        "model code: convert a model of a supported architecture")
    config = AutoConfig.from_pretrained(directory, trust_remote_code=False)
    tokenizer = None
    if any(directory.glob("tokenizer*")):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(directory, trust_remote_code=False)
    source = ModelSource(reference=str(path), directory=directory, config=config, tokenizer=tokenizer, weight_files=[])
    return ExportModel(source=source, tensors=lambda: mcore_to_hf_tensors(directory),
                       description=f"Megatron-Core checkpoint {directory}")

