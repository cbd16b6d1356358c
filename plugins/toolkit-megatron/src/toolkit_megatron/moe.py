"""Mixture-of-experts training under the megatron strategy: router losses, their scale and metrics.

The load-balancing aux loss and the router z-loss are Megatron-Core's, computed per layer. The recipe's
``--router-aux-loss-coef`` / ``--router-z-loss-coef`` (default: the HF config's ``router_aux_loss_coef`` /
``router_z_loss_coef``) weigh the toolkit's one definition of each loss, the mean over the MoE layers of
``E * sum_e f_e P_e`` (``f_e`` top-k assignments to expert ``e`` per token, ``P_e`` its mean router
probability) and of ``mean(logsumexp(logits)^2)`` (docs/moe.md). Megatron sums per layer
``coeff * E/k * sum_e f_e P_e`` and ``coeff * mean(logsumexp^2)``, so :func:`router_options` hands it
``aux * k / L`` and ``z / L`` (``L`` MoE layers, ``k`` experts per token): the same flags train the same
objective here, under toolkit-moe and on the plain HF path.

Megatron attaches the losses to the router activations (``MoEAuxLossAutoScaler``) and scales their
gradient by a global factor; we set that factor so that each forward's router losses enter the step
objective with weight ``1 / (micro-batches * data-parallel size)``, the rule the ``local`` engine uses.
Padding positions are masked out of both losses (Megatron's ``padding_mask``).
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Iterator
from typing import Any


def router_options(hf_config: Any, aux_coef: float | None, z_coef: float | None, dispatcher: str) -> dict[str, Any]:
    """``TransformerConfig`` overrides for training: dispatcher and Megatron's coefficients for the recipe's weights.

    ``aux_coef`` / ``z_coef`` weigh the mean over MoE layers (``None``: the HF config's keys, else 0);
    Megatron sums per-layer losses, its load-balancing one ``E/k`` times ours, hence ``* k / L`` and ``/ L``.
    """
    aux = float(getattr(hf_config, "router_aux_loss_coef", 0.0) or 0.0) if aux_coef is None else float(aux_coef)
    z = float(getattr(hf_config, "router_z_loss_coef", 0.0) or 0.0) if z_coef is None else float(z_coef)
    topk, layers = moe_shape(_transformer_options(hf_config))
    return {"moe_token_dispatcher_type": dispatcher,
            "moe_router_load_balancing_type": "aux_loss" if aux > 0 else "none",
            "moe_aux_loss_coeff": aux * topk / layers,
            "moe_z_loss_coeff": z / layers if z > 0 else None}


def moe_shape(options: Any) -> tuple[int, int]:
    """``(k, L)``: experts per token and MoE layers of ``TransformerConfig`` options (a dict or the config)."""
    read = options.get if isinstance(options, dict) else lambda name, default=None: getattr(options, name, default)
    return read("moe_router_topk"), moe_layer_count(read("moe_layer_freq", 1), read("num_layers"))


def deprecated_coefficients(recipe: Any, config: Any, hf_config: Any, is_main: bool) -> tuple[float | None, float | None]:
    """The recipe's router-loss weights, with a deprecated ``--megatron-moe-aux-loss-coef`` /
    ``--megatron-moe-z-loss-coef`` turned into them.

    The old flags held Megatron's own per-layer coefficients (summed over layers, ``E/k`` in the
    load-balancing term); converted (``* L / k``, ``* L``) they train the objective they trained before,
    which a plain move to the new flags would not. A different value given the new way too is refused.
    """
    from toolkit.errors import ConfigError

    topk, layers = moe_shape(_transformer_options(hf_config))
    values = {"router_aux_loss_coef": recipe.router_aux_loss_coef, "router_z_loss_coef": recipe.router_z_loss_coef}
    for old, new, factor in (("moe_aux_loss_coef", "router_aux_loss_coef", layers / topk),
                             ("moe_z_loss_coef", "router_z_loss_coef", layers)):
        given = getattr(config, old)
        if given is None:
            continue
        old_flag, new_flag = f"--megatron-{old.replace('_', '-')}", f"--{new.replace('_', '-')}"
        converted = float(given) * factor
        if values[new] is not None and not math.isclose(values[new], converted, rel_tol=1e-9, abs_tol=1e-12):
            raise ConfigError(f"{old_flag} {given} (deprecated; Megatron's per-layer weight, {new_flag} {converted:g} for "
                              f"this model) and {new_flag} {values[new]} disagree: give {new_flag} only", source=old_flag)
        values[new] = converted
        if is_main:
            print(f"toolkit: {old_flag} {given} (YAML megatron: {old}) is deprecated; it is Megatron's per-layer weight, "
                  f"which is {new_flag} {converted:g} for this model ({layers} MoE layers, top-{topk}): give that instead",
                  file=sys.stderr)
    return values["router_aux_loss_coef"], values["router_z_loss_coef"]


def _transformer_options(hf_config: Any) -> dict[str, Any]:
    from toolkit_megatron.architectures import architecture_for

    return architecture_for(hf_config.model_type).transformer_options(hf_config)


def unscaled_router_losses(chunks: list[Any]) -> None:
    """Attach the router losses without Megatron's per-token multiplier.

    With ``calculate_per_token_loss`` Megatron multiplies each router loss by the rank's count of
    routed (non-padding) tokens, expecting every gradient to be divided by the step's token count
    later; ours are normalised by the loss already, so the routers attach the plain losses and
    :func:`router_loss_scale` weighs them.
    """
    from megatron.core.transformer.moe.router import Router

    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, Router):
                module.calculate_per_token_loss = False


def mark_expert_parameters(chunks: list[Any]) -> int:
    """Mark the routed experts' weights as expert parameters (``allreduce = False``) at EP1 too.

    megatron-core 0.16's parallel linears mark expert weights only when ``--ep > 1``; otherwise
    Megatron's DDP and optimizer treat them as dense. That is right while ``--etp == --tp`` (the
    expert data-parallel group is then the data-parallel group), but with ``--etp 1 --tp 2`` the
    two TP ranks hold the same full experts and route different tokens (sequence parallel), so
    the expert gradients must be summed over the expert data-parallel group, which spans the TP
    ranks; as dense weights they were reduced over the (smaller) data-parallel group only, and
    each TP rank kept the gradient of its own tokens. Returns the number of weights marked.
    """
    marked = 0
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            if ".mlp.experts." in name and getattr(param, "allreduce", True):
                param.allreduce = False
                marked += 1
    return marked


@contextlib.contextmanager
def router_loss_scale(scale: float) -> Iterator[None]:
    """Weigh every router loss by ``scale`` for one schedule run (the schedule's own reset is ignored)."""
    import torch
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    original = MoEAuxLossAutoScaler.set_loss_scale
    original(torch.tensor(scale, dtype=torch.float32))
    MoEAuxLossAutoScaler.set_loss_scale = staticmethod(lambda _scale: None)
    try:
        yield
    finally:
        MoEAuxLossAutoScaler.set_loss_scale = staticmethod(original)


def with_padding_masks(batches: list[dict], layout: Any) -> list[dict]:
    """Add Megatron's MoE ``padding_mask`` (True = padding) so padding is neither balanced nor z-penalised.

    Skipped with pipeline and sequence parallelism together: Megatron-Core 0.16 cuts the mask for
    SP only on the first stage, so later stages would see the whole mask.
    """
    if layout.pipeline > 1 and layout.sequence_parallel:
        return batches
    return [{**b, "padding_mask": b["sequence_ids"] < 0} for b in batches]


def pop_router_metrics(config: Any, share: float, tp_cp: int) -> dict[str, float]:
    """This rank's router-loss contributions of the last schedule run (then cleared), named and scaled as
    toolkit-moe logs them.

    ``aux_loss``: the weighted router losses as added to the objective (load balancing + z);
    ``moe_aux_loss`` / ``moe_z_loss``: unweighted, averaged over the MoE layers, in the toolkit's definition
    (the load-balancing loss ``k`` times Megatron's, ``k`` when balanced). Every value is this rank's part;
    summed over all ranks they give the step's values (SP/CP ranks hold partial sums, pipeline stages
    hold disjoint layers, data-parallel ranks carry ``share``).
    """
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker

    tracker = get_moe_layer_wise_logging_tracker()
    if not config.moe_aux_loss_coeff and not config.moe_z_loss_coeff:
        return {}
    topk, layers = moe_shape(config)
    metrics = {"aux_loss": 0.0}
    for tracked, name, coeff, per_rank, unit in (
            ("load_balancing_loss", "moe_aux_loss", config.moe_aux_loss_coeff, 1, topk),
            ("z_loss", "moe_z_loss", config.moe_z_loss_coeff, tp_cp, 1)):
        if not coeff:
            continue
        value = float(tracker[tracked]["values"].sum()) * share if tracked in tracker else 0.0
        # the tracker stores z-loss / (coeff / tp_cp) per TP/CP rank: each holds its tokens' mean
        metrics["aux_loss"] += value * float(coeff) / per_rank
        metrics[name] = value * unit / per_rank / layers
    clear_aux_losses_tracker()
    return metrics


def moe_layer_count(pattern: int | list[int], num_layers: int) -> int:
    """How many layers route through experts (dense layers of a ``moe_layer_freq`` pattern record no router loss)."""
    if isinstance(pattern, int):
        return sum(1 for i in range(num_layers) if i % pattern == 0)
    return max(1, sum(pattern))
