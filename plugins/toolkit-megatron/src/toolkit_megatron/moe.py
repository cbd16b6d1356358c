"""Mixture-of-experts training under the megatron strategy: router losses, their scale and metrics.

The load-balancing aux loss and the router z-loss are Megatron-Core's (``aux_loss`` load balancing
per layer, z-loss per layer), with coefficients taken from the HF config (``router_aux_loss_coef``,
``router_z_loss_coef``) unless the core's ``--router-aux-loss-coef`` / ``--router-z-loss-coef`` (the
flags of every strategy) override them. Megatron attaches them to the router activations (``MoEAuxLossAutoScaler``) and
scales their gradient by a global factor; we set that factor so that each forward's router losses
enter the step objective with weight ``1 / (micro-batches * data-parallel size)``, the rule the
``local`` engine uses for the HF aux loss.

Megatron's load-balancing loss differs from HF's ``load_balancing_loss_func``: Megatron sums one
loss per layer, ``E / k * sum_e f_e P_e`` (``f_e`` fraction of routed assignments, ``P_e`` mean
router probability), while HF concatenates every layer's router logits and computes
``E * sum_e f_e P_e`` once over all layers' tokens. The coefficient means the same thing, the
value does not: equality with ``local`` (HF's loss) holds only with the coefficient at 0. Padding
positions are masked out of both losses (Megatron's ``padding_mask``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


def router_options(hf_config: Any, aux_coeff: float | None, z_coeff: float | None, dispatcher: str) -> dict[str, Any]:
    """``TransformerConfig`` overrides for training: dispatcher, aux loss and z-loss coefficients."""
    aux = float(getattr(hf_config, "router_aux_loss_coef", 0.0) or 0.0) if aux_coeff is None else float(aux_coeff)
    z = float(getattr(hf_config, "router_z_loss_coef", 0.0) or 0.0) if z_coeff is None else float(z_coeff)
    return {"moe_token_dispatcher_type": dispatcher,
            "moe_router_load_balancing_type": "aux_loss" if aux > 0 else "none",
            "moe_aux_loss_coeff": aux,
            "moe_z_loss_coeff": z if z > 0 else None}


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
    """This rank's router-loss contributions of the last schedule run (then cleared).

    ``aux_loss``: the weighted router losses as added to the objective (load balancing + z);
    ``load_balancing_loss`` / ``z_loss``: unweighted, averaged over the MoE layers. Every value is this
    rank's part; summed over all ranks they give the step's values (SP/CP ranks hold partial
    sums, pipeline stages hold disjoint layers, data-parallel ranks carry ``share``).
    """
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker

    tracker = get_moe_layer_wise_logging_tracker()
    if not config.moe_aux_loss_coeff and not config.moe_z_loss_coeff:
        return {}
    metrics = {"aux_loss": 0.0}
    for name, coeff, per_rank in (("load_balancing_loss", config.moe_aux_loss_coeff, 1),
                                  ("z_loss", config.moe_z_loss_coeff, tp_cp)):
        if not coeff:
            continue
        value = float(tracker[name]["values"].sum()) * share if name in tracker else 0.0
        # the tracker stores z-loss / (coeff / tp_cp) per TP/CP rank: each holds its tokens' mean
        metrics["aux_loss"] += value * float(coeff) / per_rank
        metrics[name] = value / per_rank / moe_layer_count(config)
    clear_aux_losses_tracker()
    return metrics


def moe_layer_count(config: Any) -> int:
    """How many layers route through experts (dense layers of ``moe_layer_freq``'s pattern record no router loss)."""
    pattern = config.moe_layer_freq
    if isinstance(pattern, int):
        return sum(1 for i in range(config.num_layers) if i % pattern == 0)
    return max(1, sum(pattern))
