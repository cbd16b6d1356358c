"""toolkit-megatron: the ``megatron`` strategy, the HF <-> Megatron-Core bridge and the ``mcore`` exporter.

Registered through the ``toolkit`` entry-point group; nothing heavy is imported here.
"""

from __future__ import annotations

from toolkit import hookimpl
from toolkit_megatron.notices import silence_fallback_warnings

silence_fallback_warnings()


@hookimpl
def toolkit_register_architectures(register):
    from toolkit_megatron.architectures import BUILTIN

    for cls in BUILTIN:
        register(cls)


@hookimpl
def toolkit_register_exporters(register):
    from toolkit_megatron.exporter import McoreExporter

    register(McoreExporter)


@hookimpl
def toolkit_resolve_export_source(path):
    from pathlib import Path

    if not (Path(path) / "toolkit_mcore.json").is_file():
        return None
    from toolkit_megatron.exporter import resolve_mcore_source

    return resolve_mcore_source(path)


@hookimpl
def toolkit_register_strategies(register):
    from toolkit_megatron.strategy import MegatronStrategy

    register(MegatronStrategy)
