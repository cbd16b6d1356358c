"""Run directories and checkpoints: complete or absent (temp dir + rename), keep last K, find newest."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

from toolkit.errors import ToolkitError

STATE_FILE = "trainer_state.json"
STEP_DIR = re.compile(r"^step-(\d+)$")


def checkpoints_dir(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first (a complete one has its trainer state written last)."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name)) and (p / STATE_FILE).is_file()]
    return [p for _, p in sorted(found)]


def find_resume_checkpoint(run_dir: Path, resume: str) -> Path | None:
    if resume == "auto":
        found = list_checkpoints(run_dir)
        return found[-1] if found else None
    path = Path(resume)
    if not (path / STATE_FILE).is_file():
        raise ToolkitError(f"--resume {resume}: not a complete checkpoint ({STATE_FILE} missing); "
                           f"complete ones: {', '.join(str(p) for p in list_checkpoints(run_dir)) or 'none'}")
    return path


def save_checkpoint(run_dir: Path, step: int, engine: Any, trainer_state: dict[str, Any], keep_last: int) -> Path:
    """Write ``checkpoints/step-N`` through a temporary folder on every rank, then rename on rank 0."""
    import torch

    root = checkpoints_dir(run_dir)
    final = root / f"step-{step}"
    staging = root / f".tmp-step-{step}"
    if engine.is_main:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    engine.barrier()
    engine.save_checkpoint(staging)
    rng = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    # Several processes share a data-parallel rank under tensor/pipeline parallelism: write atomically.
    _atomic_write(staging / f"rng-rank{engine.dp_rank}.pt", lambda path: torch.save(rng, path))
    _atomic_write(staging / f"python-rng-rank{engine.dp_rank}.json", lambda path: path.write_text(json.dumps(_python_rng())))
    engine.barrier()
    if engine.is_main:
        (staging / STATE_FILE).write_text(json.dumps(trainer_state, indent=2))
        if final.exists():
            shutil.rmtree(final)
        os.replace(staging, final)
        for old in list_checkpoints(run_dir)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    engine.barrier()
    return final


def _atomic_write(path: Path, write: Any) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    write(tmp)
    os.replace(tmp, path)


def restore_rng(checkpoint: Path, rank: int) -> None:
    import torch

    path = checkpoint / f"rng-rank{rank}.pt"
    if not path.is_file():
        return
    rng = torch.load(path, weights_only=True)
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])
    python = checkpoint / f"python-rng-rank{rank}.json"
    if python.is_file():
        version, state, gauss = json.loads(python.read_text())
        random.setstate((version, tuple(state), gauss))


def _python_rng() -> list[Any]:
    version, state, gauss = random.getstate()
    return [version, list(state), gauss]


def read_model_state(checkpoint: Path, templates: dict[str, Any]) -> dict[str, Any]:
    """The saved trainable tensors of a checkpoint, read in one process without a process group.

    ``model.safetensors`` (``local`` checkpoints) is returned whole; the ``dcp/`` shards of an
    ``fsdp`` checkpoint are gathered, whatever the number of ranks that wrote them, into tensors
    shaped like ``templates`` (name -> tensor giving shape and dtype).
    """
    weights = checkpoint / "model.safetensors"
    if weights.is_file():
        from safetensors.torch import load_file

        return load_file(str(weights))
    if not (checkpoint / "dcp").is_dir():
        raise ToolkitError(f"{checkpoint} holds neither model.safetensors nor dcp/ (a torch.distributed.checkpoint); "
                           "its strategy reads it itself: export it with `toolkit export` from the run directory")
    import torch
    import torch.distributed.checkpoint as dcp

    state = {name: torch.empty(tensor.shape, dtype=tensor.dtype) for name, tensor in templates.items()}
    dcp.load({"model": state}, checkpoint_id=str(checkpoint / "dcp"), no_dist=True)
    return state


def read_state(checkpoint: Path) -> dict[str, Any]:
    return json.loads((checkpoint / STATE_FILE).read_text())
