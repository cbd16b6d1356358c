"""toolkit-moe: routed MoE blocks for HF models under the local, fsdp and deepspeed strategies.

Registers the ``moe`` architecture (facts for qwen2_moe, qwen3_moe, mixtral and the options of
the ``moe:`` recipe section / ``--moe-*`` flags) and patches a built model when
``--moe-enabled`` is set. The library API is :func:`toolkit_moe.patch.patch_moe_blocks`.
"""

from __future__ import annotations

from typing import Any

from toolkit import hookimpl

__all__ = ["toolkit_patch_model", "toolkit_register_architectures"]


@hookimpl
def toolkit_register_architectures(register):
    from toolkit_moe.architecture import MoeArchitecture

    register(MoeArchitecture)


@hookimpl
def toolkit_patch_model(model: Any, source: Any, recipe: Any) -> None:
    from toolkit.recipe import thing_options
    from toolkit_moe.architecture import MoeArchitecture

    options = thing_options(recipe, MoeArchitecture)
    if options.enabled:
        MoeArchitecture(options).patch(model, source, strategy=recipe.strategy)
