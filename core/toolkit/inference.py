"""``toolkit infer`` / ``toolkit serve``: resolve MODEL to an HF directory and hand it to a backend."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from toolkit.errors import ToolkitError


def model_directory(reference: str, workdir: Path) -> Path:
    """An HF directory for a run (its export, else its newest checkpoint exported), an HF dir or a preset."""
    from toolkit.builtins.loaders import PRESETS, materialize_preset
    from toolkit.export import export_model, resolve_export_source

    path = Path(reference)
    if (path / "recipe.yaml").is_file():
        exports = [path / "export", *sorted(path.glob("export-*"))]
        found = next((e for e in exports if (e / "config.json").is_file()), None)
        if found is not None:
            return found
    if (path / "config.json").is_file():
        return path
    if reference in PRESETS:
        return materialize_preset(reference)
    if path.exists():
        return export_model(resolve_export_source(reference), "hf", workdir / "model", overwrite=True)
    raise ToolkitError(f"cannot find model {reference!r}: give a run directory, an HF model directory or a preset ({', '.join(PRESETS)})")


def backend_instance(name: str, values: dict[str, Any]) -> Any:
    from toolkit.plugins import get_plugin_manager

    cls = get_plugin_manager().get("inference_backend", name)
    fields = {f.name for f in __import__("dataclasses").fields(cls.Config)}
    return cls(cls.Config(**{k: v for k, v in values.items() if k in fields}))


def run_infer(reference: str, prompts: list[str], backend: str, extra: tuple[str, ...] = (), **options: Any) -> list[str]:
    instance = backend_instance(backend, options)
    if extra:  # --option KEY=VALUE: fields of the backend's Config (generation reads no engine flags)
        import dataclasses

        from toolkit.serving import split_extra

        instance.config, rest = split_extra(instance.config, extra)
        if rest:
            names = ", ".join(f.name for f in dataclasses.fields(instance.config))
            raise ToolkitError(f"--option {', '.join(rest)}: not an option of backend {backend!r} for toolkit infer; "
                               f"its options: {names}")
    with tempfile.TemporaryDirectory(prefix="toolkit-infer-") as workdir:
        directory = model_directory(reference, Path(workdir))
        completions = instance.generate(directory, prompts, instance.config)
    for prompt, completion in zip(prompts, completions):
        if len(prompts) > 1:
            print(f"### {prompt}")
        print(completion.strip())
    return completions


def run_serve(reference: str, backend: str, *, host: str, port: int, extra: tuple[str, ...] = ()) -> None:
    instance = backend_instance(backend, {})
    if not hasattr(instance, "serve"):
        raise ToolkitError(f"inference backend {backend!r} cannot serve; try --backend vllm or lmdeploy")
    from toolkit.serving import parse_pairs

    options = parse_pairs(extra)
    with tempfile.TemporaryDirectory(prefix="toolkit-serve-") as workdir:
        directory = model_directory(reference, Path(workdir))
        instance.serve(directory, host, port, options)
