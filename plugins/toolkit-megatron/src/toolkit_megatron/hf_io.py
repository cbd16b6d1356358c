"""Write HF checkpoints with the core's writers: safetensors shards (:func:`toolkit.hfdir.write_safetensors_shards`)
in a folder written complete or not at all (:func:`toolkit.writes.staged_directory`), config and tokenizer."""

from __future__ import annotations

import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch


def save_hf_checkpoint(tensors: Iterable[tuple[str, torch.Tensor]], hf_config: Any, output: Path,
                       tokenizer: Any = None, max_shard_bytes: int = 2 * 1024**3, dtype: torch.dtype | None = None) -> Path:
    """Stream ``(name, tensor)`` into ``model.safetensors`` or ``model-0000k-of-0000n.safetensors`` plus the index.

    Tensors are buffered only up to ``max_shard_bytes``; ``output`` is complete or absent.
    """
    from toolkit.hfdir import write_safetensors_shards
    from toolkit.writes import staged_directory

    output = Path(output)
    dtype_name = str(dtype).removeprefix("torch.") if dtype is not None else "auto"
    with staged_directory(output) as staging:
        write_safetensors_shards(tensors, staging, max_shard_bytes, dtype_name)
        config = hf_config
        if dtype is not None:
            config = type(hf_config).from_dict(hf_config.to_dict())
            config.torch_dtype = dtype_name
        config.save_pretrained(staging)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
    return output


def copy_tokenizer_files(source: Path, output: Path) -> None:
    """Copy tokenizer/generation files from an HF directory (no tokenizer object needed)."""
    for pattern in ("tokenizer*", "special_tokens_map.json", "vocab.*", "merges.txt", "generation_config.json", "chat_template*"):
        for path in Path(source).glob(pattern):
            if path.is_file():
                shutil.copy2(path, Path(output) / path.name)
