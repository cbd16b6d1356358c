"""Write HF checkpoints: sharded safetensors with an index, config and tokenizer, atomically."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch


def save_hf_checkpoint(tensors: Iterable[tuple[str, torch.Tensor]], hf_config: Any, output: Path,
                       tokenizer: Any = None, max_shard_bytes: int = 2 * 1024**3, dtype: torch.dtype | None = None) -> Path:
    """Stream ``(name, tensor)`` into ``model-0000k-of-0000n.safetensors`` files plus the index.

    Tensors are buffered only up to ``max_shard_bytes``. Written to a temporary directory
    beside ``output`` and renamed at the end, so ``output`` is complete or absent.
    """
    from safetensors.torch import save_file

    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{output.name}.", dir=output.parent))
    try:
        shards: list[list[str]] = []
        buffer: dict[str, torch.Tensor] = {}
        size = total = 0

        def flush() -> None:
            nonlocal buffer, size
            if buffer:
                save_file(buffer, str(tmp / f"shard-{len(shards):05d}.safetensors"), metadata={"format": "pt"})
                shards.append(list(buffer))
                buffer, size = {}, 0

        for name, tensor in tensors:
            tensor = tensor.detach().to("cpu", dtype or tensor.dtype).contiguous()
            nbytes = tensor.numel() * tensor.element_size()
            if buffer and size + nbytes > max_shard_bytes:
                flush()
            buffer[name] = tensor.clone() if tensor.untyped_storage().nbytes() != nbytes else tensor
            size += nbytes
            total += nbytes
        flush()
        weight_map = {}
        for index, names in enumerate(shards):
            final = f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors"
            os.replace(tmp / f"shard-{index:05d}.safetensors", tmp / final)
            weight_map.update({n: final for n in names})
        if len(shards) == 1:
            os.replace(tmp / weight_map[next(iter(weight_map))], tmp / "model.safetensors")
            weight_map = {n: "model.safetensors" for n in weight_map}
        (tmp / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2))
        config = hf_config
        if dtype is not None:
            config = type(hf_config).from_dict(hf_config.to_dict())
            config.torch_dtype = str(dtype).removeprefix("torch.")
        config.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if output.exists():
            shutil.rmtree(output)
        os.replace(tmp, output)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return output


def copy_tokenizer_files(source: Path, output: Path) -> None:
    """Copy tokenizer/generation files from an HF directory (no tokenizer object needed)."""
    for pattern in ("tokenizer*", "special_tokens_map.json", "vocab.*", "merges.txt", "generation_config.json", "chat_template*"):
        for path in Path(source).glob(pattern):
            if path.is_file():
                shutil.copy2(path, Path(output) / path.name)
