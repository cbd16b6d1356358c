"""Core built-in plugin: callbacks that write metrics.jsonl and a progress bar, and the trackers ``--report-to``
names: TensorBoard, Weights & Biases, MLflow and SwanLab, each through its own package when installed."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
from typing import Any, ClassVar

from toolkit import hookimpl
from toolkit.config import option
from toolkit.contracts import CallbackBase


@dataclasses.dataclass(kw_only=True)
class NoOptions:
    """No options."""


class Callback(CallbackBase):
    """contracts.CallbackBase (no-op methods) without options."""

    Config: ClassVar[type] = NoOptions
    tracker: ClassVar[bool] = False
    """True for an experiment tracker: it runs only when ``--report-to`` names it (:mod:`toolkit.tracking`)."""
    requires: ClassVar[str] = ""
    """The pip package a tracker needs (named by the error when it is missing)."""


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


class _Tracker(Callback):
    tracker: ClassVar[bool] = True

    def available(self) -> bool:
        import importlib.util

        return importlib.util.find_spec(self.requires) is not None


class TensorBoard(_Tracker):
    """TensorBoard event files under ``<run>/tensorboard`` (the default when tensorboard is installed)."""

    name: ClassVar[str] = "tensorboard"
    requires: ClassVar[str] = "tensorboard"

    def on_train_start(self, run: Any) -> None:
        from torch.utils.tensorboard import SummaryWriter

        from toolkit.tracking import recipe_dict, system_info

        self.writer = SummaryWriter(str(run.run_dir / "tensorboard"))
        if run.start_step == 0:
            self.writer.add_text("recipe", "```\n" + json.dumps(recipe_dict(run), indent=2) + "\n```", 0)
            self.writer.add_text("system", "```\n" + json.dumps(system_info(run), indent=2) + "\n```", 0)

    def on_log(self, step: int, metrics: dict[str, float]) -> None:
        from toolkit.tracking import numeric

        for key, value in numeric(metrics).items():
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


def _stored_id(run: Any, name: str) -> str | None:
    """The tracker's run id kept in the run directory, so a resumed run continues the same tracker run."""
    path = run.run_dir / f".{name}-run-id"
    return path.read_text().strip() or None if run.start_step and path.is_file() else None


def _store_id(run: Any, name: str, run_id: str) -> None:
    (run.run_dir / f".{name}-run-id").write_text(run_id + "\n")


@dataclasses.dataclass(kw_only=True)
class WandbConfig:
    project: str = option("toolkit", help="W&B project.")
    entity: str = option("", help="W&B entity (team or user); default: yours.")
    mode: str = option("", help="online, offline or disabled; default: $WANDB_MODE, else wandb's own (online). "
                                "Offline runs are written under <run>/wandb and uploaded later with `wandb sync`.")


class Wandb(_Tracker):
    """Weights & Biases: metrics, the recipe and system info in a W&B run (files under ``<run>/wandb``)."""

    name: ClassVar[str] = "wandb"
    Config: ClassVar[type] = WandbConfig
    requires: ClassVar[str] = "wandb"

    def on_train_start(self, run: Any) -> None:
        import wandb

        from toolkit.tracking import recipe_dict, run_name, system_info

        c = self.config
        self.run = wandb.init(project=c.project, entity=c.entity or None, mode=c.mode or None, dir=str(run.run_dir),
                              name=run_name(run), id=_stored_id(run, self.name), resume="allow",
                              config={"recipe": recipe_dict(run), "system": system_info(run)})
        _store_id(run, self.name, self.run.id)

    def on_log(self, step: int, metrics: dict[str, float]) -> None:
        from toolkit.tracking import numeric

        self.run.log(numeric(metrics), step=step)

    def on_train_end(self, run: Any) -> None:
        self.run.finish()


@dataclasses.dataclass(kw_only=True)
class MlflowConfig:
    tracking_uri: str = option("", help="MLflow tracking URI; default: $MLFLOW_TRACKING_URI, else a local SQLite "
                                        "store, sqlite:///<run>/mlflow.db.")
    experiment: str = option("toolkit", help="MLflow experiment name.")


class Mlflow(_Tracker):
    """MLflow: metrics, the recipe (as flat parameters) and system info (as tags) in an MLflow run."""

    name: ClassVar[str] = "mlflow"
    Config: ClassVar[type] = MlflowConfig
    requires: ClassVar[str] = "mlflow"

    def on_train_start(self, run: Any) -> None:
        from mlflow.tracking import MlflowClient

        from toolkit.tracking import flat_params, recipe_dict, run_name, system_info

        uri = self.config.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{run.run_dir.resolve() / 'mlflow.db'}"
        self.client = MlflowClient(tracking_uri=uri)
        experiment = self.client.get_experiment_by_name(self.config.experiment)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(self.config.experiment)
        self.run_id = _stored_id(run, self.name)
        if self.run_id is None:
            tags = {f"system.{k}": str(v) for k, v in system_info(run).items()}
            self.run_id = self.client.create_run(experiment_id, run_name=run_name(run), tags=tags).info.run_id
            _store_id(run, self.name, self.run_id)
            params = flat_params(recipe_dict(run))
            from mlflow.entities import Param

            items = [Param(k[:250], v[:6000]) for k, v in params.items()]
            for start in range(0, len(items), 100):  # MLflow takes at most 100 parameters per batch
                self.client.log_batch(self.run_id, params=items[start:start + 100])

    def on_log(self, step: int, metrics: dict[str, float]) -> None:
        import time

        from mlflow.entities import Metric

        from toolkit.tracking import numeric

        now = int(time.time() * 1000)
        values = [Metric(key, value, now, step) for key, value in numeric(metrics).items()]
        self.client.log_batch(self.run_id, metrics=values)

    def on_train_end(self, run: Any) -> None:
        self.client.set_terminated(self.run_id)


@dataclasses.dataclass(kw_only=True)
class SwanlabConfig:
    project: str = option("toolkit", help="SwanLab project.")
    mode: str = option("", help="cloud, local, offline or disabled; default: $SWANLAB_MODE, else offline (files "
                                "under <run>/swanlog, uploaded later with `swanlab sync`).")


class Swanlab(_Tracker):
    """SwanLab: metrics, the recipe and system info in a SwanLab experiment (files under ``<run>/swanlog``)."""

    name: ClassVar[str] = "swanlab"
    Config: ClassVar[type] = SwanlabConfig
    requires: ClassVar[str] = "swanlab"

    def on_train_start(self, run: Any) -> None:
        import swanlab

        from toolkit.tracking import recipe_dict, run_name, system_info

        mode = self.config.mode or os.environ.get("SWANLAB_MODE") or "offline"
        self.run = swanlab.init(project=self.config.project, experiment_name=run_name(run), mode=mode,
                                logdir=str(run.run_dir / "swanlog"),
                                config={"recipe": recipe_dict(run), "system": system_info(run)})

    def on_log(self, step: int, metrics: dict[str, float]) -> None:
        from toolkit.tracking import numeric

        self.run.log(numeric(metrics), step=step)

    def on_train_end(self, run: Any) -> None:
        self.run.finish()


@hookimpl
def toolkit_register_callbacks(register):
    for cls in (JsonlMetrics, TensorBoard, Progress, Wandb, Mlflow, Swanlab):
        register(cls)
