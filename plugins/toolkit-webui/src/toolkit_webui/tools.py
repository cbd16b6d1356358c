"""The page's other tabs on the core's own commands: data preview (``toolkit data inspect``), ``toolkit plan``,
``toolkit export`` and generation with an inference backend, with every path checked against the roots."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from toolkit.errors import ToolkitError
from toolkit_webui.paths import Roots


def model_reference(roots: Roots, value: str, what: str = "model") -> str:
    """A preset name as it is, any other model as a path inside the roots."""
    from toolkit.models import PRESETS

    value = (value or "").strip()
    return value if value in PRESETS else str(roots.readable_path(value, what))


def dataset_reference(roots: Roots, value: str, what: str = "dataset") -> str:
    """A bundled dataset name as it is, a file as a path inside the roots."""
    from toolkit.data.reading import bundled_names

    value = (value or "").strip()
    return value if value in bundled_names() else str(roots.readable_path(value, what))


def preview(roots: Roots, dataset: str, model: str, loss: str, dataset_format: str, num: int, seq_len: int) -> tuple[str, list]:
    """The data summary and ``(text, "trained" | None)`` segments of the first ``num`` samples."""
    from toolkit.data.inspect import inspect_samples, sample_segments, sample_title

    summary, tokenizer, examples = inspect_samples(dataset_reference(roots, dataset), model=model_reference(roots, model),
                                                   dataset_format=dataset_format or "auto", loss=loss, num=int(num),
                                                   seq_len=int(seq_len))
    segments: list[tuple[str, str | None]] = []
    for index, example in enumerate(examples):
        for seq in example.sequences:
            segments.append((("\n\n" if segments else "") + sample_title(index, seq) + "\n", None))
            segments += [(text, "trained" if trained else None)
                         for text, trained in sample_segments(tokenizer, seq.input_ids, seq.labels)]
    return summary, segments


def run_toolkit(args: list[str], cwd: Path, timeout: float = 600) -> str:
    """``python -m toolkit ARGS``; its output, or a ToolkitError carrying its error lines."""
    result = subprocess.run([sys.executable, "-m", "toolkit", *args], capture_output=True, text=True, cwd=cwd,
                            timeout=timeout, stdin=subprocess.DEVNULL)
    if result.returncode != 0:
        raise ToolkitError((result.stderr or result.stdout).strip() or f"toolkit {args[0]} exited with {result.returncode}")
    return result.stdout


def plan(roots: Roots, model: str, gpus: int, gpu_kind: str, gpu_memory: str, seq_len: int, tuner: str) -> str:
    """``toolkit plan`` for a preset (its config) or a model directory / config.json inside the roots."""
    from toolkit.models import PRESETS, materialize_preset

    reference = str(materialize_preset(model)) if model in PRESETS else str(roots.readable_path(model, "model"))
    args = ["plan", "--model", reference, "--gpus", str(int(gpus)), "--gpu", gpu_kind, "--seq-len", str(int(seq_len)),
            "--tuner", tuner]
    if (gpu_memory or "").strip():
        args += ["--gpu-memory", gpu_memory.strip()]
    return run_toolkit(args, roots.runs)


def export(roots: Roots, source: str, exporter: str, output: str, options: str) -> tuple[Path, str]:
    """``toolkit export SOURCE --to EXPORTER --output OUTPUT`` with the output inside the runs directory."""
    source_path = roots.readable_path(source, "export source")
    target = roots.writable_path(output, "export output")
    args = ["export", str(source_path), "--to", exporter, "--output", str(target), "--overwrite"]
    for line in (options or "").splitlines():
        if line.strip():
            roots.check_mentions(line.strip(), f"exporter option {line.strip()}")
            args += ["--option", line.strip()]
    return target, run_toolkit(args, roots.runs)


def backend_fields(manager: Any) -> dict[str, list[dataclasses.Field]]:
    """Each registered inference backend's ``Config`` fields (the chat tab's options)."""
    return {name: list(dataclasses.fields(cls.Config)) for name, cls in manager.registry("inference_backend").items()}


def check_options(roots: Roots, config_cls: type, options: dict[str, Any], owner: str) -> None:
    """Refuse option values typed into the page that name files outside the roots (a LoRA directory, say).
    A value left at its default is the operator's, not the page's (vllm's ``python`` defaults to
    $TOOLKIT_VLLM_PYTHON, an interpreter wherever it is installed)."""
    defaults = {f.name: f.default if f.default is not dataclasses.MISSING else None for f in dataclasses.fields(config_cls)}
    for name, value in options.items():
        if value != defaults.get(name):
            roots.check_mentions(value, f"{owner} option {name}")


def generate(roots: Roots, model: str, backend: str, options: dict[str, Any], prompt: str) -> str:
    """One completion of ``prompt`` from a run (its export, else its newest checkpoint), an HF directory or a preset.

    Each message is answered on its own (the backends take prompts, not conversations).
    """
    from toolkit.config import build_dataclass
    from toolkit.errors import ConfigError
    from toolkit.inference import NO_REMOTE_CODE, model_directory
    from toolkit.plugins import get_plugin_manager

    cls = get_plugin_manager().get("inference_backend", backend)
    check_options(roots, cls.Config, options, backend)
    problems: list[str] = []
    config = build_dataclass(cls.Config, options, f"backend {backend}", problems)
    if problems:
        raise ConfigError(problems, source=f"backend {backend}")
    reference = model_reference(roots, model, "chat model")
    with tempfile.TemporaryDirectory(prefix="toolkit-webui-") as workdir:
        directory = model_directory(reference, Path(workdir), refusal=NO_REMOTE_CODE)
        return cls(config).generate(directory, [prompt], config)[0].strip()
