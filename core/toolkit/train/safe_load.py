"""Loading checkpoint files that someone else may have written, without running their code.

torch.distributed.checkpoint (FSDP's ``dcp/``, Megatron-Core's ``torch_dist`` format) keeps its
``.metadata`` as a plain pickle and its FileSystemReader unpickles it with ``pickle.load``: a crafted
file runs code. A manifest does not help (whoever ships the checkpoint writes it too). So every
``.metadata`` is read first by :class:`MetadataUnpickler`, which admits only the classes torch's
checkpoint metadata is made of; anything else is refused before torch reads the file.
The checkpoint's non-tensor entries (optimizer hyper-parameters, Megatron-Core's extra states and
sharded objects) are pickles too, which torch's DefaultLoadPlanner reads with
``torch.load(weights_only=False)``: :func:`weights_only_planner` reads them weights-only instead.
Every ``torch.load`` here is ``weights_only=True``; its refusal becomes one line naming the file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import io
import pickle
from collections.abc import Iterator
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
        raise UnsafeCheckpointError(f"{path} {_refused(exc)}") from None


def weights_only_planner(base: type | None = None) -> type:
    """A torch.distributed.checkpoint load planner class (``base``, default ``DefaultLoadPlanner``) that reads
    the checkpoint's non-tensor entries weights-only: torch's own reads them with ``weights_only=False``, so
    a crafted entry (its ``.metadata`` may declare any key as bytes) would run code."""
    if base is None:
        from torch.distributed.checkpoint import DefaultLoadPlanner as base

    class WeightsOnlyLoadPlanner(base):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            import torch

            try:
                loaded = torch.load(value, weights_only=True)
            except pickle.UnpicklingError as exc:
                raise UnsafeCheckpointError(f"entry {read_item.dest_index.fqn!r} {_refused(exc)}") from None
            # hand the base planner a pickle of what was admitted: it unpickles with weights_only=False
            clean = io.BytesIO()
            torch.save(loaded, clean)
            clean.seek(0)
            super().load_bytes(read_item, clean)

    WeightsOnlyLoadPlanner.__qualname__ = WeightsOnlyLoadPlanner.__name__ = f"WeightsOnly{base.__name__}"
    return WeightsOnlyLoadPlanner


@contextlib.contextmanager
def named_refusal(directory: Path) -> Iterator[None]:
    """Turn an entry refused by :func:`weights_only_planner` into one line naming the checkpoint: torch wraps
    every rank's exception in a ``CheckpointException`` (a ``BaseException``) with its traceback."""
    from torch.distributed.checkpoint import CheckpointException

    try:
        yield
    except CheckpointException as exc:
        for error, _trace in exc.failures.values():
            if isinstance(error, UnsafeCheckpointError):
                raise UnsafeCheckpointError(f"{directory}: {error}") from None
        raise
    except UnsafeCheckpointError as exc:
        raise UnsafeCheckpointError(f"{directory}: {exc}") from None


def _refused(exc: pickle.UnpicklingError) -> str:
    first = str(exc).strip().splitlines()
    detail = next((line for line in first if "GLOBAL" in line or "Unsupported" in line), first[0] if first else "")
    return (f"holds objects a weights-only load refuses ({detail.strip()[:200]}); it was not loaded. Files toolkit "
            "writes hold only tensors and plain values: this one was altered or written by another tool")
