"""What a failed write looks like from each writer, so a full disk gets the same clear message whoever wrote.

Python raises OSError (ENOSPC); ``torch.save`` raises RuntimeError from its zip writer ("[enforce fail at
inline_container.cc] . unexpected pos ..." or "PytorchStreamWriter failed writing file ...: file write
failed"), and safetensors a SafetensorError ("I/O error: No space left on device (os error 28)"). Neither
of the last two is an OSError or carries an errno, so they are recognised by their text, and a torch write
failure counts as a full disk when the folder has (almost) no space left. Used by checkpoints, exports and
the run directory's recipe.yaml.

:func:`staged_directory` is the one way a folder is written complete or not at all (exports, adapters,
the mcore exporter's HF staging, presets); :func:`replace_directory` the one way a finished folder takes an
existing one's place (those, training checkpoints, Megatron checkpoints).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_TORCH_WRITE = ("inline_container.cc", "PytorchStreamWriter", "file write failed", "unexpected pos")
_DISK_FULL_TEXT = ("No space left on device", "os error 28", "StorageFull", "Disk quota exceeded", "os error 122")
_NEARLY_FULL = 16 << 20


def is_write_failure(error: BaseException | None) -> bool:
    """An OSError, or torch's or safetensors' way of saying a write failed."""
    if error is None:
        return False
    if isinstance(error, OSError):
        return True
    text = str(error)
    if type(error).__name__ == "SafetensorError":
        return "I/O error" in text or "IoError" in text
    return isinstance(error, RuntimeError) and any(marker in text for marker in _TORCH_WRITE)


def is_disk_full(error: BaseException | None, directory: Path | None = None) -> bool:
    if isinstance(error, OSError):
        return error.errno in DISK_FULL_ERRNOS
    if not is_write_failure(error):
        return False
    if any(marker in str(error) for marker in _DISK_FULL_TEXT):
        return True
    return directory is not None and free_bytes(directory) < _NEARLY_FULL


def free_bytes(directory: Path) -> int:
    for folder in (Path(directory), *Path(directory).parents):
        if folder.exists():
            return shutil.disk_usage(folder).free
    return 0


def write_failure_text(error: BaseException, directory: Path) -> str:
    """``the disk is full (0.00 GiB free; RuntimeError: ...)`` or ``OSError: ...``: one line."""
    what = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:240]
    if is_disk_full(error, directory):
        return f"the disk is full: {free_bytes(directory) / 2**30:.2f} GiB free; {what}"
    return what


@contextlib.contextmanager
def staged_directory(output: Path) -> Iterator[Path]:
    """A fresh folder beside ``output`` (``.NAME-PID-*``) to write into: when the block ends without an error it
    replaces ``output`` (one rename), when it raises it is removed. So ``output`` is complete or absent (or the
    previous one). ``toolkit.export.remove_dead_staging`` removes such folders left by a killed process."""
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{output.name}-{os.getpid()}-", dir=output.parent))
    try:
        yield staging
        replace_directory(staging, output)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def replace_directory(staging: Path, output: Path, retired: Path | None = None) -> None:
    """Move the finished folder ``staging`` to ``output``. An existing ``output`` is renamed aside first (to
    ``retired``, default ``.del-NAME-PID`` beside it) and removed only after, so ``output`` is at every moment the
    old folder, the new one, or (between the two renames) absent: never half of either, whenever a kill comes."""
    output = Path(output)
    if output.exists():
        retired = Path(retired) if retired is not None else output.with_name(f".del-{output.name}-{os.getpid()}")
        shutil.rmtree(retired, ignore_errors=True)
        os.replace(output, retired)
    else:
        retired = None
    try:
        os.replace(staging, output)
    except BaseException:
        if retired is not None:  # the old folder goes back where it was
            os.replace(retired, output)
        raise
    if retired is not None:
        shutil.rmtree(retired, ignore_errors=True)
