"""Checkpoints: written to a staging folder on every rank, sealed with a manifest of sizes and sha256 checksums,
renamed into place; verified before a resume, which falls back past a damaged one to the one before it."""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from toolkit.errors import ToolkitError
from toolkit.writes import is_disk_full, is_write_failure, replace_directory

STATE_FILE = "trainer_state.json"
MANIFEST_FILE = "manifest.json"
# 2: sealed by manifest.json (written last, before the rename). Checkpoints from before manifests carry no
# "checkpoint_format" key in trainer_state.json; they are accepted unverified (docs/reliability.md).
CHECKPOINT_FORMAT = 2
STEP_DIR = re.compile(r"^step-(\d+)$")
LEFTOVER_DIR = re.compile(r"^\.(tmp|del)-step-\d+$")
SHARE_PREFIX = ".manifest-share-rank"
_CHUNK = 8 << 20


class CheckpointError(ToolkitError):
    """A checkpoint could not be written, or the one asked for is damaged."""


def checkpoints_dir(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def step_of(checkpoint: Path) -> int:
    match = STEP_DIR.match(checkpoint.name)
    return int(match.group(1)) if match else -1


def step_dirs(run_dir: Path) -> list[Path]:
    """Every ``step-N`` folder, whole or not, oldest first."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if STEP_DIR.match(p.name) and p.is_dir()), key=step_of)


def list_checkpoints(run_dir: Path, verify: str = "size") -> list[Path]:
    """Whole checkpoints, oldest first; ``verify="size"`` compares file sizes with the manifest, ``"sha256"`` every byte."""
    return [p for p in step_dirs(run_dir) if checkpoint_problem(p, verify) is None]


# ---------------------------------------------------------------------------------------------- verification
def checkpoint_problem(checkpoint: Path, verify: str = "sha256") -> str | None:
    """What is wrong with a checkpoint folder, in a few words, or None when it is whole."""
    manifest_path = checkpoint / MANIFEST_FILE
    if not manifest_path.is_file():
        return _unsealed_problem(checkpoint)
    try:
        files = json.loads(manifest_path.read_text())["files"]
        expected = {name: (int(entry["size"]), str(entry["sha256"])) for name, entry in files.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return f"{MANIFEST_FILE} is unreadable ({type(exc).__name__}: {exc})"
    if STATE_FILE not in expected:
        return f"{MANIFEST_FILE} does not list {STATE_FILE}"
    for name, (size, _) in expected.items():
        path = checkpoint / name
        if not path.is_file():
            return f"{name} is missing"
        actual = path.stat().st_size
        if actual != size:
            return f"{name} is {actual} bytes, {MANIFEST_FILE} says {size} (truncated or overwritten)"
    if verify == "sha256":
        try:
            digests = hash_files(checkpoint, list(expected))
        except OSError as exc:
            return f"cannot read it ({exc})"
        for name, (_, digest) in expected.items():
            if digests[name][1] != digest:
                return f"{name} does not match its sha256 in {MANIFEST_FILE} (corrupted)"
    return _state_problem(checkpoint)


def _unsealed_problem(checkpoint: Path) -> str | None:
    if not (checkpoint / STATE_FILE).is_file():
        return f"incomplete: neither {MANIFEST_FILE} nor {STATE_FILE} is there"
    problem = _state_problem(checkpoint)
    if problem is None and read_state(checkpoint).get("checkpoint_format", 1) >= 2:
        return f"{MANIFEST_FILE} is missing"
    return problem


def _state_problem(checkpoint: Path) -> str | None:
    try:
        state = read_state(checkpoint)
        int(state["step"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"{STATE_FILE} is unreadable ({type(exc).__name__}: {exc})"
    return None


def is_unverified(checkpoint: Path) -> bool:
    """A checkpoint from before manifests: whole by the rename protocol, but nothing to check it against."""
    return not (checkpoint / MANIFEST_FILE).is_file()


def find_resume_checkpoint(run_dir: Path, resume: str, verify: str = "sha256",
                           report: Callable[[str], None] | None = None) -> Path | None:
    """``auto``: the newest whole checkpoint, each damaged newer one reported in one line and skipped;
    a path: that checkpoint, or a CheckpointError saying what is wrong with it."""
    report = report or (lambda line: print(line, file=sys.stderr, flush=True))
    if resume == "auto":
        damaged = []
        for path in reversed(step_dirs(run_dir)):
            problem = checkpoint_problem(path, verify)
            if problem is None:
                if is_unverified(path):
                    report(f"toolkit: checkpoint {path} has no {MANIFEST_FILE} (written before manifests); resuming without verifying it")
                return path
            damaged.append(f"{path.name}: {problem}")
            report(f"toolkit: skipping damaged checkpoint {path}: {problem}; falling back to the one before it")
        if damaged:  # restarting from step 0 would silently throw away the run's history
            raise CheckpointError(f"every checkpoint in {checkpoints_dir(run_dir)} is damaged ({'; '.join(damaged)}); "
                                  "there is nothing whole to resume from. Restore one from a backup, or start the run "
                                  "over with --overwrite instead of --resume")
        return None
    path = Path(resume)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {resume} does not exist. {_whole_ones(run_dir, verify)}")
    problem = checkpoint_problem(path, verify)
    if problem is not None:
        raise CheckpointError(f"checkpoint {resume} is damaged: {problem}. {_whole_ones(run_dir, verify, path)} "
                              "(--resume auto picks the newest whole one)")
    return path


def _whole_ones(run_dir: Path, verify: str, refused: Path | None = None) -> str:
    """The whole checkpoints, checked as thoroughly as the refused one was (a byte flip passes a size check)."""
    found = [p for p in list_checkpoints(run_dir, verify) if refused is None or p.resolve() != refused.resolve()]
    return f"Whole checkpoints in {checkpoints_dir(run_dir)}: {', '.join(p.name for p in found) if found else 'none'}."


def agree_on_resume(run_dir: Path, resume: str, engine: Any, verify: str = "sha256") -> Path | None:
    """Rank 0 verifies (the checkpoint is read once, not once per rank); every rank takes its answer."""
    chosen: Path | None = None
    error: CheckpointError | None = None
    code = -1.0  # -1: start from scratch, -2: rank 0 refused, otherwise the chosen step
    if engine.is_main:
        try:
            chosen = find_resume_checkpoint(run_dir, resume, verify)
            code = -1.0 if chosen is None else float(max(step_of(chosen), 0))
        except CheckpointError as exc:
            error, code = exc, -2.0
    code = engine.all_reduce_sum([code if engine.is_main else 0.0])[0]
    if error is not None:
        raise error
    if code == -2:
        raise CheckpointError(f"checkpoint {resume}: rank 0 found it damaged (its message says what is wrong)")
    if code == -1:
        return None
    return Path(resume) if resume != "auto" else checkpoints_dir(run_dir) / f"step-{int(code)}"


# ---------------------------------------------------------------------------------------------- manifest
def write_model_state(directory: Path, state: dict[str, Any], tuner: str) -> None:
    """A checkpoint's trained tensors under the tuner's names (``tuner.checkpoint_state`` on the HF model) as
    ``model.safetensors``, the tuner named in its metadata: what a resume of the HF engines and the tuner's
    ``adapter_from_checkpoint`` (``--adapter-only`` exports) read. Every engine writes it here."""
    from safetensors.torch import save_file

    save_file({name: tensor.detach().contiguous().cpu() for name, tensor in state.items()}, str(directory / "model.safetensors"),
              metadata={"format": "pt", "tuner": tuner})


def hash_files(directory: Path, names: list[str], sync: bool = False) -> dict[str, tuple[int, str]]:
    """``{name: (size, sha256)}``, several files at once (hashlib releases the GIL on large updates)."""
    workers = max(1, min(len(names), os.cpu_count() or 1, 8))
    ordered = sorted(names, key=lambda name: -(directory / name).stat().st_size)  # biggest first balances the pool
    with ThreadPoolExecutor(max_workers=workers) as pool:
        results = pool.map(lambda name: _hash_file(directory / name, sync), ordered)
        return dict(zip(ordered, results))


def _hash_file(path: Path, sync: bool) -> tuple[int, str]:
    digest = hashlib.sha256()
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as handle:
        while read := handle.readinto(buffer):
            digest.update(view[:read])
        if sync:  # the rename publishes the checkpoint: its bytes must be on disk first, not only in the page cache
            os.fsync(handle.fileno())
        size = os.fstat(handle.fileno()).st_size
    return size, digest.hexdigest()


def _files(directory: Path) -> list[str]:
    return sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*")
                  if p.is_file() and p.name != MANIFEST_FILE and not p.name.startswith(SHARE_PREFIX))


def hash_share(directory: Path, rank: int, world_size: int) -> None:
    """This rank's share of the hashing (every ``world_size``-th file, fsynced), kept for rank 0 to merge:
    on many ranks the manifest costs a fraction of reading the whole checkpoint once."""
    names = _files(directory)[rank::world_size]
    _write_synced(directory / f"{SHARE_PREFIX}{rank}.json", json.dumps(hash_files(directory, names, sync=True)))


def write_manifest(directory: Path) -> dict[str, Any]:
    """Merge the ranks' shares, hash (and fsync) any file no share covers, write ``manifest.json`` last."""
    digests: dict[str, Any] = {}
    shares = sorted(directory.glob(f"{SHARE_PREFIX}*.json"))
    for share in shares:
        digests.update(json.loads(share.read_text()))
    names = _files(directory)
    digests.update(hash_files(directory, [name for name in names if name not in digests], sync=True))
    for share in shares:
        share.unlink()
    manifest = {"format": 1, "algorithm": "sha256",
                "files": {name: {"size": digests[name][0], "sha256": digests[name][1]} for name in names}}
    _write_synced(directory / MANIFEST_FILE, json.dumps(manifest, indent=1))
    for folder in {directory, *(p for p in directory.rglob("*") if p.is_dir())}:
        _fsync_dir(folder)
    return manifest


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------------- saving
def save_checkpoint(run_dir: Path, step: int, engine: Any, trainer_state: dict[str, Any], keep_last: int,
                    keep: int | None = None) -> Path:
    """Write ``checkpoints/step-N``: every rank writes into ``.tmp-step-N`` and hashes a share of the files;
    rank 0 seals it with the manifest, renames it, then removes checkpoints beyond ``keep_last`` (all but the
    one of step ``keep``, the ``--save-best`` checkpoint, which does not count towards them). A failure
    on any rank removes the staging folder and raises a CheckpointError on every rank; the checkpoints
    already there are left as they were."""
    root = checkpoints_dir(run_dir)
    final, staging = root / f"step-{step}", root / f".tmp-step-{step}"
    main = engine.is_main
    # each phase ends in a collective that also tells every rank whether any rank failed
    _phase(engine, run_dir, step, staging, (lambda: _prepare(root, staging)) if main else None)
    _phase(engine, run_dir, step, staging, lambda: write_rank_files(staging, engine))
    _phase(engine, run_dir, step, staging, lambda: hash_share(staging, *_rank_and_world()))
    _phase(engine, run_dir, step, staging, (lambda: seal_and_publish(staging, final, trainer_state, keep_last, keep)) if main else None)
    return final


def _rank_and_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _prepare(root: Path, staging: Path) -> None:
    root.mkdir(parents=True, exist_ok=True)
    for leftover in root.iterdir():  # staging folders of killed runs, half-removed old checkpoints: only one run writes here
        if LEFTOVER_DIR.match(leftover.name):
            shutil.rmtree(leftover, ignore_errors=True)
    staging.mkdir()


def write_rank_files(staging: Path, engine: Any) -> None:
    """This rank's part: the engine's state and the RNG streams of its data-parallel rank."""
    import torch

    engine.save_checkpoint(staging)
    rng = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    # Several processes share a data-parallel rank under tensor/pipeline parallelism: write atomically.
    _atomic_write(staging / f"rng-rank{engine.dp_rank}.pt", lambda path: torch.save(rng, path))
    _atomic_write(staging / f"python-rng-rank{engine.dp_rank}.json", lambda path: path.write_text(json.dumps(_python_rng())))


def seal_and_publish(staging: Path, final: Path, trainer_state: dict[str, Any], keep_last: int,
                     keep: int | None = None) -> None:
    """Rank 0, after every rank wrote its part: trainer state, manifest (last), rename, then prune older ones."""
    (staging / STATE_FILE).write_text(json.dumps({**trainer_state, "checkpoint_format": CHECKPOINT_FORMAT}, indent=2))
    write_manifest(staging)
    # the same step may be written again after resuming from an older checkpoint; LEFTOVER_DIR names the old one
    replace_directory(staging, final, retired=final.with_name(f".del-{final.name}"))
    _fsync_dir(final.parent)
    older = [p for p in step_dirs(final.parent.parent) if step_of(p) < step_of(final) and step_of(p) != keep]
    for old in older[: max(0, len(older) - (keep_last - 1))]:  # only now that the new one is whole
        _remove(old)


def _remove(checkpoint: Path) -> None:
    """Rename first, so a kill in the middle of deleting cannot leave a half-deleted ``step-N`` behind."""
    retired = checkpoint.with_name(f".del-{checkpoint.name}")
    try:
        os.replace(checkpoint, retired)
    except OSError:
        return
    shutil.rmtree(retired, ignore_errors=True)


def _phase(engine: Any, run_dir: Path, step: int, staging: Path, work: Callable[[], None] | None) -> None:
    error: BaseException | None = None
    if work is not None:
        try:
            work()
        except Exception as exc:  # noqa: BLE001 - every rank must hear about it before anyone raises
            error = exc
    disk_full = is_disk_full(error, checkpoints_dir(run_dir))
    failed, disk_full_anywhere = engine.all_reduce_sum([1.0 if error else 0.0, 1.0 if disk_full else 0.0])
    if not failed:
        return
    if engine.is_main:
        shutil.rmtree(staging, ignore_errors=True)
    if error is not None and not is_write_failure(error):  # torch's and safetensors' write errors are not OSErrors
        raise error
    raise write_failure(run_dir, step, error, disk_full_anywhere > 0) from error


def write_failure(run_dir: Path, step: int, error: BaseException | None, disk_full: bool) -> CheckpointError:
    """The message: what failed, which checkpoint is still whole, and what to do."""
    root = checkpoints_dir(run_dir)
    whole = [p for p in list_checkpoints(run_dir) if step_of(p) != step]
    if whole:
        kept = f"{whole[-1]} is still whole: `--resume auto` continues from it (step {step_of(whole[-1])})"
    else:
        kept = "there is no earlier checkpoint: the run would restart from step 0"
    what = "another rank failed" if error is None else f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:240]
    if disk_full:
        free = shutil.disk_usage(root).free if root.is_dir() else 0
        need = f"; the last checkpoint took {_size(whole[-1]) / 2**30:.2f} GiB" if whole else ""
        return CheckpointError(f"the disk is full: checkpoint step-{step} could not be written to {root} ({what}; "
                               f"{free / 2**30:.2f} GiB free{need}). The unfinished checkpoint was removed and training "
                               f"stopped; {kept}. Free space there (or lower --keep-last), then run the same command "
                               "with --resume auto.")
    return CheckpointError(f"checkpoint step-{step} could not be written to {root} ({what}). The unfinished checkpoint "
                           f"was removed and training stopped; {kept}. Fix the cause, then run the same command with --resume auto.")


def _size(checkpoint: Path) -> int:
    return sum(p.stat().st_size for p in checkpoint.rglob("*") if p.is_file())


def _atomic_write(path: Path, write: Any) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    write(tmp)
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------- resuming
def restore_rng(checkpoint: Path, rank: int) -> None:
    import torch

    path = checkpoint / f"rng-rank{rank}.pt"
    if not path.is_file():
        return
    from toolkit.train.safe_load import load_tensors_file

    rng = load_tensors_file(path)
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

    from toolkit.train.safe_load import check_dcp_metadata, named_refusal, weights_only_planner

    check_dcp_metadata(checkpoint / "dcp")  # torch unpickles .metadata: refuse one that would run code
    state = {name: torch.empty(tensor.shape, dtype=tensor.dtype) for name, tensor in templates.items()}
    with named_refusal(checkpoint / "dcp"):  # a crafted .metadata may declare a weight as a pickled entry
        dcp.load({"model": state}, checkpoint_id=str(checkpoint / "dcp"), no_dist=True, planner=weights_only_planner()())
    return state


def read_state(checkpoint: Path) -> dict[str, Any]:
    return json.loads((checkpoint / STATE_FILE).read_text())
