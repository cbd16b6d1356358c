"""``toolkit infer`` / ``toolkit serve``: resolve MODEL to an HF directory and hand it to a backend."""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from toolkit.contracts import member
from toolkit.errors import ModelError, ToolkitError


def model_directory(reference: str, workdir: Path, trust_remote_code: bool = False) -> Path:
    """An HF directory for a run (its export, else its newest checkpoint exported), an HF dir or a preset;
    checked before a backend reads it: safetensors weights, and no model code unless ``trust_remote_code``."""
    from toolkit.builtins.loaders import PRESETS, check_remote_code, materialize_preset
    from toolkit.export import export_model, resolve_export_source

    path = Path(reference)
    if reference in PRESETS and not path.exists():
        return materialize_preset(reference)
    exports = [path / "export", *sorted(path.glob("export-*"))] if (path / "recipe.yaml").is_file() else []
    directory = next((e for e in [*exports, path] if (e / "config.json").is_file()), None)
    if directory is None:
        if not path.exists():
            raise ToolkitError(f"cannot find model {reference!r}: give a run directory, an HF model directory or a "
                               f"preset ({', '.join(PRESETS)})")
        source = resolve_export_source(reference, trust_remote_code=trust_remote_code)
        return export_model(source, "hf", workdir / "model", overwrite=True)
    check_remote_code(directory, trust_remote_code)
    if not list(directory.glob("*.safetensors")):
        hint = " (.bin weights are pickles and are not read: convert them to safetensors)" if list(directory.glob("*.bin")) else ""
        raise ModelError(f"model directory {directory} has no *.safetensors weights{hint}")
    return directory


def backend_instance(name: str, values: dict[str, Any]) -> Any:
    from toolkit.plugins import get_plugin_manager

    cls = get_plugin_manager().get("inference_backend", name)
    fields = {f.name for f in __import__("dataclasses").fields(cls.Config)}
    return cls(cls.Config(**{k: v for k, v in values.items() if k in fields}))


def run_infer(reference: str, prompts: list[str], backend: str, extra: tuple[str, ...] = (), **options: Any) -> list[str]:
    """Print the completions, and only them, on stdout (engines' own output goes to stderr)."""
    instance = backend_instance(backend, options)
    if extra:  # --option KEY=VALUE: fields of the backend's Config (generation reads no engine flags)
        import dataclasses

        from toolkit.serving import split_extra

        instance.config, rest = split_extra(instance.config, extra)
        if rest:
            names = ", ".join(f.name for f in dataclasses.fields(instance.config))
            raise ToolkitError(f"--option {', '.join(rest)}: not an option of backend {backend!r} for toolkit infer; "
                               f"its options: {names}")
    with tempfile.TemporaryDirectory(prefix="toolkit-infer-") as workdir, stdout_to_stderr():
        directory = model_directory(reference, Path(workdir), options.get("trust_remote_code", False))
        completions = instance.generate(directory, prompts, instance.config)
    for prompt, completion in zip(prompts, completions):
        if len(prompts) > 1:
            print(f"### {prompt}")
        print(completion.strip())
    return completions


@contextlib.contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """Send what engines print (vLLM logs its warnings to stdout, C++ code writes to fd 1) to stderr meanwhile."""
    sys.stdout.flush()
    try:
        saved = os.dup(1)
    except OSError:  # no file descriptor 1 (an embedding host): Python-level redirection only
        saved = None
    if saved is not None:
        os.dup2(2, 1)
    previous, sys.stdout = sys.stdout, sys.stderr
    try:
        yield
    finally:
        sys.stdout = previous
        if saved is not None:
            os.dup2(saved, 1)
            os.close(saved)


def run_serve(reference: str, backend: str, *, host: str, port: int, extra: tuple[str, ...] = ()) -> None:
    instance = backend_instance(backend, {})
    if member(instance, "inference_backend", "serve") is None:
        raise ToolkitError(f"inference backend {backend!r} cannot serve; try --backend vllm or lmdeploy")
    from toolkit.serving import parse_pairs

    options = parse_pairs(extra)
    with tempfile.TemporaryDirectory(prefix="toolkit-serve-") as workdir:
        directory = model_directory(reference, Path(workdir))
        instance.serve(directory, host, port, options)
