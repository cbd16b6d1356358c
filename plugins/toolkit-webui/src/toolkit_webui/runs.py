"""Runs launched from the page: a ``python -m toolkit ...`` (or torchrun) subprocess per run directory,
its status from the process and the run's checkpoints, its curves from ``metrics.jsonl``.

Stopping sends SIGTERM to the training processes themselves (under torchrun: its workers, so
torchrun's own 30-second kill timer never races the checkpoint); the runner then finishes the
step, saves a checkpoint and exits (75, EXIT_STOPPED, on one process; 0 under torchrun).
Resuming runs the same command again with ``--resume auto``.

A symbolic link in a run directory that leads out of the runs directory is never followed: the
page neither shows what it points at nor launches a run that would write through it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from toolkit.errors import EXIT_STOPPED, ToolkitError

LAUNCH_FILE = "webui-launch.json"  # what the page ran in this directory: the arguments, the processes
LOG_FILE = "webui.log"             # the subprocess's stdout and stderr


@dataclasses.dataclass
class RunStatus:
    """One row of the runs table."""

    name: str
    path: Path
    state: str  # running, stopping, finished, stopped, failed, empty
    step: int | None
    total_steps: int | None
    loss: float | None

    def row(self) -> list[Any]:
        steps = f"{self.step or 0}/{self.total_steps}" if self.total_steps else str(self.step or 0)
        return [self.name, self.state, steps, "" if self.loss is None else f"{self.loss:.4f}"]


def process_command(args: list[str], nproc: int) -> list[str]:
    """``python -m toolkit ARGS`` or, on several processes, the torchrun line ``toolkit launch`` would run."""
    if nproc <= 1:
        return [sys.executable, "-m", "toolkit", *args]
    from toolkit.commands.launch import torchrun_command
    from toolkit.train.distributed import free_port

    return torchrun_command(tuple(args), nproc, master_port=free_port())


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """Every complete line of ``metrics.jsonl`` (the last one may be half-written while training)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and "step" in row:
            rows.append(row)
    return rows


def inside(path: Path, root: Path) -> bool:
    """Whether ``path``, symlinks followed, lies inside ``root`` (a resolved directory)."""
    try:
        resolved = Path(path).resolve()
    except (OSError, RuntimeError):
        return False
    return resolved == root or resolved.is_relative_to(root)


def link_out(run_dir: Path, root: Path) -> Path | None:
    """The first symbolic link under ``run_dir`` that leads out of ``root``, or None."""
    for directory, dirs, files in os.walk(run_dir):  # links to directories are listed, not entered
        for name in dirs + files:
            path = Path(directory) / name
            if path.is_symlink() and not inside(path, root):
                return path
    return None


def _children(pid: int) -> list[int]:
    """Direct children of ``pid`` (Linux /proc); empty where that cannot be read."""
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


class Runs:
    """The runs under one directory, and the processes this page started there."""

    def __init__(self, root: Path, popen: Callable[..., Any] = functools.partial(subprocess.Popen, start_new_session=True)):
        """``popen`` starts a run's process (``subprocess.Popen``'s arguments; a session of its own, so a Ctrl-C
        in the page's terminal reaches the page, which stops its runs with a checkpoint, and not the runs)."""
        self.root = Path(root).resolve()
        self.popen = popen
        self.processes: dict[Path, subprocess.Popen] = {}
        self.stopping: set[Path] = set()

    def launch(self, args: list[str], run_dir: Path, nproc: int = 1) -> subprocess.Popen:
        run_dir = Path(run_dir)
        running = self.processes.get(run_dir)
        if running is not None and running.poll() is None:
            raise ToolkitError(f"{run_dir} is already training (process {running.pid}); stop it first")
        self.check_links(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        command = process_command(args, nproc)
        with open(run_dir / LOG_FILE, "ab") as log:
            log.write(f"\n$ {' '.join(command)}\n".encode())
            log.flush()
            env = {**os.environ, "PYTHONUNBUFFERED": "1"}
            process = self.popen(command, stdout=log, stderr=log, stdin=subprocess.DEVNULL, cwd=self.root, env=env)
        (run_dir / LAUNCH_FILE).write_text(json.dumps({"args": args, "nproc": nproc, "pid": process.pid}, indent=1))
        self.processes[run_dir] = process
        self.stopping.discard(run_dir)
        return process

    def stop(self, run_dir: Path) -> str:
        run_dir = Path(run_dir)
        process = self.processes.get(run_dir)
        if process is None or process.poll() is not None:
            raise ToolkitError(f"{run_dir.name} is not training from this page")
        targets = _children(process.pid) if json.loads((run_dir / LAUNCH_FILE).read_text()).get("nproc", 1) > 1 else []
        for pid in targets or [process.pid]:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        self.stopping.add(run_dir)
        return f"asked {run_dir.name} to stop: it saves a checkpoint after the current step"

    def check_links(self, run_dir: Path) -> None:
        """Refuse a run directory holding a link out of the runs directory: the run would write through it."""
        if not inside(run_dir, self.root):
            raise ToolkitError(f"{run_dir} is outside the runs directory {self.root}")
        found = link_out(run_dir, self.root) if run_dir.is_dir() else None
        if found is not None:
            raise ToolkitError(f"{found} is a symbolic link to {found.resolve()}, outside the runs directory {self.root}: "
                               "the page neither reads nor writes through it; remove the link")

    def metrics(self, run_dir: Path) -> list[dict[str, Any]]:
        """:func:`read_metrics`, unless metrics.jsonl is a link out of the runs directory."""
        return read_metrics(run_dir) if inside(Path(run_dir) / "metrics.jsonl", self.root) else []

    def log(self, run_dir: Path) -> str:
        """:func:`log_tail`, unless the log is a link out of the runs directory."""
        path = Path(run_dir) / LOG_FILE
        if path.exists() and not inside(path, self.root):
            return f"{path} is a symbolic link out of the runs directory {self.root}: not shown"
        return log_tail(run_dir)

    def resume(self, run_dir: Path) -> subprocess.Popen:
        """Run the directory's command again with ``--resume auto`` (the page's own launch, else its recipe.yaml)."""
        run_dir = Path(run_dir)
        self.check_links(run_dir)
        launch = run_dir / LAUNCH_FILE
        if launch.is_file():
            saved = json.loads(launch.read_text())
            args, nproc = _without_resume(saved["args"]), int(saved.get("nproc", 1))
        elif (run_dir / "recipe.yaml").is_file():  # a run started from the CLI: its loss's own command
            from toolkit.recipe import read_yaml
            from toolkit_webui.forms import training_command

            loss = str(read_yaml(run_dir / "recipe.yaml").get("loss") or "sft")
            args, nproc = [*training_command(loss), "--config", str(run_dir / "recipe.yaml")], 1
        else:
            raise ToolkitError(f"{run_dir} has neither {LAUNCH_FILE} nor recipe.yaml: nothing to resume")
        return self.launch([*args, "--resume", "auto"], run_dir, nproc)

    def wait(self, run_dir: Path, timeout: float) -> int | None:
        process = self.processes.get(Path(run_dir))
        if process is None:
            return None
        try:
            return process.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def close(self) -> None:
        """Stop every run this page started and wait for their checkpoints (the page is shutting down)."""
        for run_dir, process in list(self.processes.items()):
            if process.poll() is None:
                self.stop(run_dir)
        for process in self.processes.values():
            try:
                process.wait(120)
            except subprocess.TimeoutExpired:
                process.kill()

    def run_dirs(self) -> list[Path]:
        """Directories under the root that hold a run (recipe.yaml) or a launch from this page, newest first."""
        if not self.root.is_dir():
            return []
        found = {p.parent for name in ("recipe.yaml", LAUNCH_FILE) for p in self.root.glob(f"*/{name}")}
        found |= {p for p in self.processes}
        return sorted(found, key=lambda p: p.stat().st_mtime if p.exists() else 0, reverse=True)

    def status(self, run_dir: Path) -> RunStatus:
        from toolkit.train.checkpoint import list_checkpoints, read_state

        run_dir = Path(run_dir)
        metrics = self.metrics(run_dir)
        last = metrics[-1] if metrics else {}
        checkpoints = []
        if (run_dir / "checkpoints").is_dir() and inside(run_dir / "checkpoints", self.root):
            checkpoints = [c for c in list_checkpoints(run_dir) if inside(c, self.root)]
        state = read_state(checkpoints[-1]) if checkpoints else {}
        total = state.get("total_steps")
        process = self.processes.get(run_dir)
        if process is not None and process.poll() is None:
            name = "stopping" if run_dir in self.stopping else "running"
        elif total and state.get("step") == total:
            name = "finished"
        elif process is not None and process.returncode not in (0, EXIT_STOPPED, None) and run_dir not in self.stopping:
            name = f"failed (exit {process.returncode})"
        elif checkpoints:
            name = f"stopped at step {state.get('step')}"
        elif metrics and time.time() - (run_dir / "metrics.jsonl").stat().st_mtime < 60:
            name = "running (not from this page)"
        else:
            name = "empty"
        return RunStatus(run_dir.name, run_dir, name, last.get("step"), total, last.get("loss"))

    def table(self) -> list[list[Any]]:
        return [self.status(p).row() for p in self.run_dirs()]


def _without_resume(args: list[str]) -> list[str]:
    out, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg == "--resume":
            skip = True
        elif not arg.startswith("--resume="):
            out.append(arg)
    return out


def log_tail(run_dir: Path, lines: int = 40) -> str:
    path = Path(run_dir) / LOG_FILE
    if not path.is_file():
        return ""
    with open(path, "rb") as handle:
        handle.seek(max(0, path.stat().st_size - 64 * 1024))
        text = handle.read().decode(errors="replace")
    return "\n".join(text.splitlines()[-lines:])


CURVES = {"loss": ("loss", "eval/loss"), "learning rate": ("lr",), "tokens/s": ("tokens_per_s",)}
MAX_POINTS = 1000  # per series: a long run's whole history every second would slow the page down to a crawl


def curves(metrics: list[dict[str, Any]]) -> dict[str, Any]:
    """Long-format tables (step, value, series) per plot: loss, learning rate, tokens/s, reward.

    The reward plot holds every logged key with "reward" in its name (toolkit-rl's and any plugin's).
    Past ``MAX_POINTS`` logged steps, every k-th row is drawn (the first and the newest always).
    """
    import pandas as pd

    if len(metrics) > MAX_POINTS:
        stride = -(-len(metrics) // MAX_POINTS)
        metrics = [*metrics[:-1:stride], metrics[-1]]

    rewards = sorted({k for row in metrics for k, v in row.items() if "reward" in k and isinstance(v, (int, float))})
    plots = {**CURVES, "reward": tuple(rewards)}
    out = {}
    for title, keys in plots.items():
        points = [(row["step"], float(row[key]), key) for row in metrics for key in keys
                  if isinstance(row.get(key), (int, float)) and not isinstance(row.get(key), bool)]
        frame = pd.DataFrame(points, columns=["step", "value", "series"])
        # typed even when empty: Gradio takes an empty object column for a category axis
        out[title] = frame.astype({"step": "int64", "value": "float64", "series": "object"})
    return out
