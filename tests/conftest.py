"""Core test setup (offline, few threads), a small in-process plugin and a stand-in for the training runner."""

from __future__ import annotations

import dataclasses
import os
import sys
import types
from typing import Literal

import pytest

from toolkit import hookimpl
from toolkit.config import option

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_NUM_THREADS", "2")


class ProbeLoss:
    """Train with the probe objective (a test loss)."""

    name = "probe"
    consumes = "logps"
    needs_reference = False
    example_kinds = ("lm",)

    @dataclasses.dataclass(kw_only=True)
    class Config:
        weight: float = option(1.0, help="Scale of the loss.")
        mode: Literal["sum", "mean"] = option("mean", help="Reduction.")
        warm: bool = option(False, help="A boolean option.")

    def __init__(self, config):
        self.config = config


class ProbeStrategy:
    name = "probe-strategy"

    @dataclasses.dataclass(kw_only=True)
    class Config:
        buckets: int = option(2, help="Buckets.")

    def __init__(self, config):
        self.config = config


class ProbeTuner:
    name = "probe-tuner"

    @dataclasses.dataclass(kw_only=True)
    class Config:
        layers: list[int] = option([], help="Layers to train.")

    def __init__(self, config):
        self.config = config


class probe_plugin:  # noqa: N801 - a namespace standing in for a plugin module
    @staticmethod
    @hookimpl
    def toolkit_register_losses(register):
        register(ProbeLoss)

    @staticmethod
    @hookimpl
    def toolkit_register_strategies(register):
        register(ProbeStrategy)

    @staticmethod
    @hookimpl
    def toolkit_register_tuners(register):
        register(ProbeTuner)


pytest_plugins = ["pytester"]  # tests of toolkit.testing run pytest on generated test files

PROBE_FLAGS = ["--loss", "probe", "--strategy", "probe-strategy", "--tuner", "probe-tuner"]
PROBE_YAML = "loss: probe\nstrategy: probe-strategy\ntuner: probe-tuner\n"


@pytest.fixture(scope="module")
def tokenizer():
    """The tiny presets' tokenizer."""
    from toolkit.builtins.loaders import resolve_model

    return resolve_model("tiny-llama").tokenizer


@pytest.fixture
def probe_manager(toolkit_manager):
    """Built-ins plus the probe plugin (no other installed plugins)."""
    return toolkit_manager(("probe", probe_plugin), installed=False)


@pytest.fixture
def captured_runs(monkeypatch):
    """Replace the training runner: training commands append their resolved Recipe here."""
    runs = []
    try:
        import toolkit.train.runner as runner_module
    except ImportError:
        runner_module = types.ModuleType("toolkit.train.runner")
        monkeypatch.setitem(sys.modules, "toolkit.train.runner", runner_module)
    monkeypatch.setattr(runner_module, "run_training", lambda recipe, **_: runs.append(recipe), raising=False)
    return runs


CHECKPOINTED_RECIPE = {"model": "tiny-llama", "dataset": ["demo"], "lr": 1e-3, "seq_len": 64, "micro_batch_size": 2,
                       "max_steps": 6, "save_every": 2, "keep_last": 3}


@pytest.fixture(scope="session")
def train_tiny():
    """Train the tiny Llama on the demo data in this process: 6 steps, a checkpoint every 2, the last 3
    kept; keyword arguments override recipe fields (``resume="auto"``, ``max_steps=8``)."""
    from toolkit.recipe import resolve_recipe
    from toolkit.train.runner import run_training

    def train(output, **values):
        return run_training(resolve_recipe({**CHECKPOINTED_RECIPE, "output": str(output), **values}))

    return train


@pytest.fixture(scope="session")
def checkpointed_run(train_tiny, tmp_path_factory):
    """One uninterrupted run with checkpoints at steps 2, 4 and 6, shared by the checkpoint and fault tests
    (which work on copies: ``run_copy``)."""
    return train_tiny(tmp_path_factory.mktemp("checkpointed") / "run")


@pytest.fixture
def run_copy(checkpointed_run, tmp_path):
    import shutil

    target = tmp_path / "run"
    shutil.copytree(checkpointed_run, target)
    return target
