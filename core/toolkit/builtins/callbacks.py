"""Core built-in plugin: callbacks that write metrics.jsonl, TensorBoard events and a progress bar."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
from typing import Any, ClassVar

from toolkit import hookimpl
from toolkit.contracts import CallbackBase


@dataclasses.dataclass(kw_only=True)
class NoOptions:
    """No options."""


class Callback(CallbackBase):
    """contracts.CallbackBase (no-op methods) without options."""

    Config: ClassVar[type] = NoOptions


class JsonlMetrics(Callback):
    """Appends one JSON object per logged step to ``metrics.jsonl`` in the run directory."""

    name: ClassVar[str] = "jsonl"

    def on_train_start(self, run: Any) -> None:
        self.path = run.run_dir / "metrics.jsonl"
        if run.start_step == 0:
            self.path.write_text("")
        elif self.path.is_file():  # resumed: drop lines past the checkpoint so the file stays consistent
            kept = [line for line in self.path.read_text(errors="replace").splitlines() if _step(line) <= run.start_step]
            # written aside and renamed: a kill during this rewrite must not lose the history before the checkpoint
            tmp = self.path.with_name(f".{self.path.name}.tmp")
            tmp.write_text("".join(line + "\n" for line in kept))
            os.replace(tmp, self.path)

    def on_log(self, step: int, metrics: dict[str, float]) -> None:
        with self.path.open("a") as handle:
            handle.write(json.dumps(metrics) + "\n")


def _step(line: str) -> float:
    """The step of a metrics line; a line torn by a kill in the middle of its write (or not a step) sorts last."""
    try:
        step = json.loads(line)["step"]
        return step if isinstance(step, int) else math.inf
    except (ValueError, KeyError, TypeError):
        return math.inf


class TensorBoard(Callback):
    """TensorBoard event files under ``<run>/tensorboard`` when tensorboard is installed."""

    name: ClassVar[str] = "tensorboard"

    def available(self) -> bool:
        import importlib.util

        return importlib.util.find_spec("tensorboard") is not None

    def on_train_start(self, run: Any) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(run.run_dir / "tensorboard"))

    def on_log(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            if key != "step" and isinstance(value, (int, float)):
                self.writer.add_scalar(key, value, step)

    def on_train_end(self, run: Any) -> None:
        self.writer.close()


class Progress(Callback):
    """A progress bar with loss, tokens/s and ETA (plain log lines when output is not a terminal)."""

    name: ClassVar[str] = "progress"

    def on_train_start(self, run: Any) -> None:
        from tqdm.auto import tqdm

        print(f"toolkit: {run.data_summary}; {run.total_steps} steps -> {run.run_dir}", file=sys.stderr)
        self.bar = tqdm(total=run.total_steps, initial=run.start_step, desc="train", unit="step", file=sys.stderr,
                        dynamic_ncols=True, disable=None)
        self.interactive = not self.bar.disable

    def on_step_end(self, step: int, metrics: dict[str, float]) -> None:
        self.bar.update(step - self.bar.n)
        self.bar.set_postfix(loss=f"{metrics['loss']:.4f}", tok_s=f"{metrics['tokens_per_s']:.0f}", refresh=False)

    def on_log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.interactive:
            shown = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in metrics.items())
            print(f"toolkit: {shown}", file=sys.stderr)

    def on_train_end(self, run: Any) -> None:
        self.bar.close()


@hookimpl
def toolkit_register_callbacks(register):
    for cls in (JsonlMetrics, TensorBoard, Progress):
        register(cls)
