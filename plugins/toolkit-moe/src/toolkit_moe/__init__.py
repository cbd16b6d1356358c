"""toolkit-moe: routed MoE blocks for HF models under the local, fsdp and deepspeed strategies.

Registers the ``moe`` architecture (facts for qwen2_moe, qwen3_moe, mixtral and the options of
the ``moe:`` recipe section / ``--moe-*`` flags) and patches a built model when
``--moe-enabled`` is set. The library API is :func:`toolkit_moe.patch.patch_moe_blocks`.
"""

from __future__ import annotations

from typing import Any

from toolkit import hookimpl

__all__ = ["toolkit_patch_model", "toolkit_register_architectures", "toolkit_strategy_axes"]


@hookimpl
def toolkit_register_architectures(register):
    from toolkit_moe.architecture import MoeArchitecture

    register(MoeArchitecture)


@hookimpl
def toolkit_strategy_axes(strategy: str) -> list[str]:
    # Expert parallelism of the local engine (DDP for the rest of the model) is this plugin's.
    return ["ep"] if strategy == "local" else []


@hookimpl
def toolkit_patch_model(model: Any, source: Any, recipe: Any) -> None:
    from toolkit.errors import ConfigError
    from toolkit.parallel import ParallelLayout
    from toolkit.recipe import thing_options
    from toolkit_moe.architecture import MoeArchitecture

    options = thing_options(recipe, MoeArchitecture)
    ep = ParallelLayout.from_recipe(recipe).expert  # the layout's one expert-parallel axis (--ep)
    if ep > 1 and recipe.strategy == "local" and not options.enabled:
        raise ConfigError(f"--ep {ep} with --strategy local splits toolkit-moe's experts: add --moe-enabled "
                          "(YAML moe: {enabled: true})", source="--ep")
    if options.enabled:  # a model toolkit-moe cannot patch is refused there, naming the families it knows
        MoeArchitecture(options).patch(model, source, strategy=recipe.strategy, expert_parallel=ep,
                                       aux_loss_coef=recipe.router_aux_loss_coef, z_loss_coef=recipe.router_z_loss_coef)
