"""toolkit-megatron: the ``megatron`` strategy, the HF <-> Megatron-Core bridge and the ``mcore`` exporter.

Registered through the ``toolkit`` entry-point group; nothing heavy is imported here.
"""

from __future__ import annotations

from toolkit import hookimpl


@hookimpl
def toolkit_register_architectures(register):
    from toolkit_megatron.architectures import BUILTIN

    for cls in BUILTIN:
        register(cls)
