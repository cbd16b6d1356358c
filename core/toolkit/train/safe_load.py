"""Loading checkpoint files that someone else may have written, without running their code.

torch.distributed.checkpoint (FSDP's ``dcp/``, Megatron-Core's ``torch_dist`` format) keeps its
``.metadata`` as a plain pickle and its FileSystemReader unpickles it with ``pickle.load``: a crafted
file runs code. A manifest does not help (whoever ships the checkpoint writes it too). So every
``.metadata`` is read first by :class:`MetadataUnpickler`, which admits only the classes torch's
checkpoint metadata is made of; anything else is refused before torch reads the file.
Every ``torch.load`` here is ``weights_only=True``; its refusal becomes one line naming the file.
"""

from __future__ import annotations

import dataclasses
import enum
import pickle
from pathlib import Path
from typing import Any

from toolkit.errors import ToolkitError

METADATA_FILE = ".metadata"
# Megatron-Core's torch_dist metadata also holds the save plans (planner dataclasses)
_METADATA_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.planner")
_ALLOWED = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
    ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "slice"), ("builtins", "complex"),
}


class UnsafeCheckpointError(ToolkitError):
    """A checkpoint file asks to run code (or holds objects a weights-only load refuses); it was not loaded."""


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles torch.distributed.checkpoint metadata only: its dataclasses and enums, torch dtypes and sizes."""

    def find_class(self, module: str, name: str) -> Any:
        import torch

        if module in _METADATA_MODULES and not name.startswith("__"):
            import importlib

            value = getattr(importlib.import_module(module), name, None)
            if isinstance(value, type) and (dataclasses.is_dataclass(value) or issubclass(value, enum.Enum)):
                return value  # plain records, whose constructors only store their fields
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name}")


def check_dcp_metadata(directory: Path) -> None:
    """Refuse a distributed checkpoint whose ``.metadata`` would run code when torch unpickles it."""
    path = Path(directory) / METADATA_FILE
    if not path.is_file():
        return
    try:
        with path.open("rb") as handle:
            MetadataUnpickler(handle).load()
    except pickle.UnpicklingError as exc:
        raise UnsafeCheckpointError(
            f"{path} is not torch.distributed.checkpoint metadata: loading it would call {exc}, which checkpoint "
            "metadata never holds, so it was not loaded (the file was crafted or damaged). Use a checkpoint "
            "you or toolkit wrote") from None
    except (EOFError, ValueError, TypeError, AttributeError, ImportError, IndexError, KeyError) as exc:
        raise UnsafeCheckpointError(f"{path} is unreadable ({type(exc).__name__}: {exc}); it was not loaded") from None


def load_tensors_file(path: Path, **kwargs: Any) -> Any:
    """``torch.load(path, weights_only=True)``; a refused file is one line naming it, not a pickle traceback."""
    import torch

    try:
        return torch.load(path, weights_only=True, **kwargs)
    except pickle.UnpicklingError as exc:
        first = str(exc).strip().splitlines()
        detail = next((line for line in first if "GLOBAL" in line or "Unsupported" in line), first[0] if first else "")
        raise UnsafeCheckpointError(f"{path} holds objects a weights-only load refuses ({detail.strip()[:200]}); it was "
                                    "not loaded. Files toolkit writes hold only tensors and plain values: this one was "
                                    "altered or written by another tool") from None
