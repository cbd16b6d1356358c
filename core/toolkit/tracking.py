"""What experiment trackers log once per run (its name, the resolved recipe, the system it runs on) and which
callbacks a run uses (``--report-to``); used by the core's tracker callbacks and any plugin's.

A callback class with ``tracker = True`` runs only when ``--report-to`` names it (TensorBoard also when
``--report-to`` is left out and tensorboard is installed, as before the flag existed); every other callback
(metrics.jsonl, the progress bar) always runs. A named tracker whose package is missing is refused before the
model loads, with the ``pip install`` command from its ``requires``.
"""

from __future__ import annotations

import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

from toolkit.errors import ConfigError

DEFAULT_TRACKERS = ("tensorboard",)
"""Trackers a run without ``--report-to`` uses when they are installed."""


def run_name(run: Any) -> str:
    """``--run-name``, else the run directory's name."""
    return run.recipe.run_name or Path(run.run_dir).resolve().name


def recipe_dict(run: Any) -> dict[str, Any]:
    """The resolved recipe as recipe.yaml holds it (plain JSON types)."""
    return json.loads(json.dumps(run.recipe.to_yaml_dict(), default=str))


def flat_params(data: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested options as ``section.key: text`` (trackers whose parameters are flat strings, e.g. MLflow)."""
    flat: dict[str, str] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flat_params(value, f"{name}."))
        else:
            flat[name] = json.dumps(value) if not isinstance(value, str) else value
    return flat


def system_info(run: Any) -> dict[str, Any]:
    """Versions, host and devices: what a tracker shows beside the recipe to tell runs apart."""
    import torch
    import transformers

    from toolkit import __version__

    info: dict[str, Any] = {"toolkit": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
                            "python": sys.version.split()[0], "platform": platform.platform(), "host": platform.node(),
                            "cpus": os.cpu_count() or 0, "world_size": int(os.environ.get("WORLD_SIZE", "1"))}
    if torch.cuda.is_available():
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        info["cuda"] = torch.version.cuda
    return info


def numeric(metrics: dict[str, Any]) -> dict[str, float]:
    """The metrics a tracker can plot (numbers, not the step itself)."""
    return {k: float(v) for k, v in metrics.items() if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


def select_callbacks(recipe: Any) -> list[type]:
    """The callback classes this run uses, checked: an unknown ``--report-to`` name lists the installed trackers,
    a missing package names its pip command."""
    from toolkit.contracts import member
    from toolkit.plugins import get_plugin_manager

    registry = get_plugin_manager().registry("callback")
    trackers = [name for name, cls in registry.items() if member(cls, "callback", "tracker")]
    asked = [name for name in recipe.report_to if name != "none"]
    if "none" in recipe.report_to and asked:
        raise ConfigError(f"--report-to none means no tracker, but {', '.join(asked)} is named too: give one or the other")
    unknown = [name for name in asked if name not in trackers]
    if unknown:
        raise ConfigError(f"--report-to {', '.join(unknown)}: not an installed tracker; installed: {', '.join(trackers)}")
    chosen = []
    for name, cls in registry.items():
        if not member(cls, "callback", "tracker"):
            chosen.append(cls)
        elif name in asked:
            if not member(cls(cls.Config()), "callback", "available")():
                package = member(cls, "callback", "requires") or name
                raise ConfigError(f"--report-to {name} needs the {package} package, which is not installed: "
                                  f"pip install {package}")
            chosen.append(cls)
        elif not recipe.report_to and name in DEFAULT_TRACKERS and member(cls(cls.Config()), "callback", "available")():
            chosen.append(cls)
    return chosen
