"""Export sources (run, checkpoint, HF dir, preset) -> ExportModel -> an exporter's artefact on disk."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from toolkit.contracts import ExportModel, ModelSource, member
from toolkit.errors import ConfigError, ToolkitError
from toolkit.hfdir import ExportError
from toolkit.writes import is_write_failure, staged_directory, write_failure_text


def hf_dir_tensors(source: ModelSource) -> Callable[[], Iterator[tuple[str, Any]]]:
    """Stream the tensors of an HF directory one at a time."""

    def tensors() -> Iterator[tuple[str, Any]]:
        from safetensors import safe_open

        for path in source.weight_files:
            with safe_open(str(path), framework="pt") as handle:
                for name in handle.keys():
                    yield name, handle.get_tensor(name)

    return tensors


def load_run_recipe(run_dir: Path) -> Any:
    from toolkit.recipe import read_yaml, resolve_recipe

    path = run_dir / "recipe.yaml"
    if not path.is_file():
        raise ToolkitError(f"{run_dir} has no recipe.yaml: it is not a toolkit run directory")
    values = read_yaml(path)
    values.pop("resume", None)
    return resolve_recipe(values, source=str(path))


def checkpoint_source(checkpoint: Path, run_dir: Path, adapter_only: bool = False,
                      trust_remote_code: bool = False) -> ExportModel:
    """An ExportModel for a training checkpoint: the run's strategy turns it into HF tensors.

    ``trust_remote_code`` comes from this command's flag, never from the run's recipe.yaml: whoever
    hands over a run directory writes its recipe too."""
    from toolkit.models import resolve_model
    from toolkit.plugins import get_plugin_manager
    from toolkit.recipe import thing_options

    recipe = load_run_recipe(run_dir)
    manager = get_plugin_manager()
    strategy_cls, tuner_cls = manager.get("strategy", recipe.strategy), manager.get("tuner", recipe.tuner)
    strategy, tuner = strategy_cls(thing_options(recipe, strategy_cls)), tuner_cls(thing_options(recipe, tuner_cls))
    source = resolve_model(recipe.model, trust_remote_code)
    adapter = None
    from_checkpoint = member(tuner, "tuner", "adapter_from_checkpoint")
    if from_checkpoint is not None:
        adapter = lambda: from_checkpoint(checkpoint, source, recipe)  # noqa: E731
    elif adapter_only:
        raise ToolkitError(f"--adapter-only: the run used --tuner {recipe.tuner}, which has no adapters to export")
    return ExportModel(source=source, tensors=lambda: strategy.checkpoint_tensors(checkpoint, source, tuner, recipe),
                       adapter=adapter, description=f"checkpoint {checkpoint}")


def resolve_export_source(reference: str, adapter_only: bool = False, trust_remote_code: bool = False) -> ExportModel:
    from toolkit.models import resolve_model
    from toolkit.plugins import get_plugin_manager
    from toolkit.train.checkpoint import MANIFEST_FILE, STATE_FILE, find_resume_checkpoint

    claimed = get_plugin_manager().resolve_export_source(reference)
    if claimed is not None:
        return claimed
    path = Path(reference)
    if (path / "recipe.yaml").is_file():  # the newest whole checkpoint; damaged newer ones are named and skipped
        newest = find_resume_checkpoint(path, "auto")
        if newest is None:
            raise ToolkitError(f"run {path} has no complete checkpoint under {path / 'checkpoints'} yet")
        return checkpoint_source(newest, path, adapter_only, trust_remote_code)
    if (path / STATE_FILE).is_file() or (path / MANIFEST_FILE).is_file():
        find_resume_checkpoint(path.parent.parent, str(path))  # a damaged one is a CheckpointError saying what is wrong
        return checkpoint_source(path, path.parent.parent, adapter_only, trust_remote_code)
    source = resolve_model(reference, trust_remote_code)
    return ExportModel(source=source, tensors=hf_dir_tensors(source), description=f"model {reference}")


def export_model(model: ExportModel, exporter: str, output: str | Path, *, overwrite: bool = False, options: Any = None,
                 adapter_only: bool = False) -> Path:
    from toolkit.plugins import get_plugin_manager

    cls = get_plugin_manager().get("exporter", exporter)
    instance = cls(options if options is not None else cls.Config())
    output = Path(output)
    model = dataclasses.replace(model, destination=output.resolve())
    check_output(output, overwrite)
    if adapter_only:
        if model.adapter is None:
            raise ToolkitError(f"{model.description} has no adapters; --adapter-only applies to LoRA/DoRA/QLoRA runs")
        writer = member(instance, "exporter", "export_adapter")
        if writer is None:
            raise ToolkitError(f"exporter {exporter!r} cannot write adapter-only exports")
        return atomic_dir(output, lambda tmp: writer(model, tmp, instance.config))
    return atomic_dir(output, lambda tmp: instance.export(model, tmp, instance.config))


EXPORT_MARKER = ".toolkit-export"
"""Written into every export: ``--overwrite`` replaces only a folder that holds it (or an empty one)."""


def check_output(output: Path, overwrite: bool) -> None:
    """An existing, non-empty output is replaced only with ``overwrite`` and only when it is a previous export:
    ``--overwrite`` pointed at the wrong folder must not delete unrelated files."""
    if output.exists() and not output.is_dir():
        raise ExportError(f"export output {output} is a file, not a directory; choose another --output")
    if not output.is_dir() or not any(output.iterdir()):
        return
    if not overwrite:
        raise ExportError(f"export output {output} exists and is not empty; pass --overwrite or choose another --output")
    in_run = (output.parent / "recipe.yaml").is_file() and output.name.startswith("export")
    if not (output / EXPORT_MARKER).is_file() and not in_run:
        shown = ", ".join(sorted(p.name for p in output.iterdir())[:5])
        raise ExportError(f"--overwrite refuses to replace {output}: it is not a previous toolkit export (no "
                          f"{EXPORT_MARKER} file) and holds other files ({shown}, ...). Choose an empty or new --output, "
                          "or remove it yourself")


def atomic_dir(output: Path, write: Callable[[Path], Any]) -> Path:
    """Run ``write`` into a temporary sibling folder, then replace ``output`` with it.

    The staging folder is named after this process (``.NAME-PID-*``): one left by an export that was killed
    is removed by the next export to the same place. SIGTERM during the write removes it on the way out.
    Files get the permissions of the user's umask (mkdtemp makes 0700 folders, safetensors 0600 files)."""
    output.parent.mkdir(parents=True, exist_ok=True)
    remove_dead_staging(output)
    try:
        with _sigterm_raises(), staged_directory(output) as staging:
            write(staging)
            (staging / EXPORT_MARKER).write_text("")
            apply_umask(staging)
    except BaseException as exc:
        if is_write_failure(exc):
            raise ExportError(f"the export to {output} could not be written ({write_failure_text(exc, output.parent)}); "
                              "nothing was left behind. Free space there or choose another --output") from exc
        raise
    return output


def remove_dead_staging(output: Path) -> None:
    """Remove ``.NAME-PID-*`` staging folders of exports whose process is gone."""
    for leftover in output.parent.glob(f".{output.name}-*-*"):
        pid = leftover.name[len(output.name) + 2:].split("-", 1)[0]
        if leftover.is_dir() and pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(leftover, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class _sigterm_raises:
    """SIGTERM (a scheduler, ``kill``) raises SystemExit(143) in the main thread, so ``finally`` blocks clean up."""

    def __enter__(self) -> None:
        import signal
        import threading

        self.previous = None
        if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
            self.previous = signal.signal(signal.SIGTERM, self._raise)

    @staticmethod
    def _raise(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    def __exit__(self, *exc: Any) -> None:
        import signal

        if self.previous is not None:
            signal.signal(signal.SIGTERM, self.previous)


def apply_umask(directory: Path) -> None:
    umask = os.umask(0)
    os.umask(umask)
    for path in [directory, *directory.rglob("*")]:
        if not path.is_symlink():
            os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~umask)


def parse_options(cls: type, extra: tuple[str, ...], flag: str = "--option") -> Any:
    from toolkit.config import build_dataclass, parse_pairs

    try:
        values = parse_pairs(extra)
    except ValueError as exc:
        raise ConfigError(f"{flag}: {exc}") from None
    problems: list[str] = []
    config = build_dataclass(cls.Config, values, f"{flag} ({cls.name})", problems)
    if problems:
        raise ConfigError(problems)
    return config


def run_export(reference: str, exporter: str, output: str, *, merge_lora: bool = True, adapter_only: bool = False,
               extra: tuple[str, ...] = (), overwrite: bool = False, trust_remote_code: bool = False) -> Path:
    from toolkit.plugins import get_plugin_manager

    cls = get_plugin_manager().get("exporter", exporter)
    options = parse_options(cls, extra)
    if not merge_lora and not adapter_only:
        adapter_only = True
    model = resolve_export_source(reference, adapter_only, trust_remote_code)
    path = export_model(model, exporter, output, overwrite=overwrite, options=options, adapter_only=adapter_only)
    print(f"exported {model.description} with {exporter!r} to {path}")
    return path


def read_index(directory: Path) -> dict[str, Any]:
    index = directory / "model.safetensors.index.json"
    return json.loads(index.read_text()) if index.is_file() else {}
