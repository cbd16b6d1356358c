"""Per-token label log-probabilities from an HF causal LM, chunked so full fp32 logits never exist.

Shared by every strategy that runs HF modules (local/DDP, FSDP, DeepSpeed).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from toolkit.contracts import IGNORE_INDEX, TokenLogps
from toolkit.train.kernels.compiled import fused as compiled

LOGPS_CHUNK_TOKENS = 2048
RECOMPUTE_LOGITS = False
"""True: recompute each chunk's logits in backward (least memory); False: keep them in the compute dtype (faster)."""


def plain_causal(sequence_ids: torch.Tensor) -> bool:
    """Whether every row is one sequence from its first column on, followed by nothing but padding.

    Then plain causal attention is exact for every real token (it sees only its own sequence before
    it; the padding after it is never attended to), so no mask is needed and SDPA keeps its flash and
    cuDNN kernels; what the padding positions compute is discarded (no label, no score, no router loss).
    Reads the tensor on the host: call it on the micro-batch's CPU copy to keep the GPU queue full.
    """
    own = sequence_ids == sequence_ids[:, :1]
    padding = sequence_ids < 0
    return (bool((sequence_ids[:, 0] >= 0).all()) and bool((own | padding).all())
            and bool((own[:, 1:] <= own[:, :-1]).all()))


def attention_mask_for(sequence_ids: torch.Tensor, plain: bool | None = None, packed: str = "sdpa-mask",
                       config: Any = None) -> Any:
    """Block-causal boolean mask ``[B, 1, T, T]`` from sequence ids; ``None`` when plain causal suffices.

    Padding positions (-1) attend only to themselves so no row of the softmax is empty. ``plain``:
    the answer of :func:`plain_causal` when the caller already knows it. ``packed="flex"``: the same
    pattern as a FlexAttention ``BlockMask`` (:mod:`toolkit.train.attention`; the model must run its
    attention implementation), for rows that are not plain. ``config``: the HF config of the model the
    mask is for (:func:`mask_for_model`).
    """
    if plain if plain is not None else plain_causal(sequence_ids):
        return None
    if packed == "flex":
        return flex_mask_for_model(sequence_ids, config)
    length = sequence_ids.shape[1]
    same = sequence_ids[:, :, None] == sequence_ids[:, None, :]
    causal = torch.ones(length, length, dtype=torch.bool, device=sequence_ids.device).tril()
    mask = same & causal & (sequence_ids[:, :, None] >= 0)
    mask |= torch.eye(length, dtype=torch.bool, device=sequence_ids.device)
    return mask_for_model(mask[:, None, :, :], config)


def masks_by_layer(config: Any, build: Callable[[int | None], Any]) -> Any:
    """The attention mask the model of ``config`` must be handed, from ``build(window)`` (``None``: no window).

    HF hands a mask it is given to every layer as it is, so this chooses: one mask for a model without sliding
    window layers; its windowed mask for one whose every layer is windowed (``sliding_window``); a dict by layer
    type for one that mixes windowed and full layers (``layer_types``: Gemma 2/3)."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None) or ()
    if not window or (layer_types and "sliding_attention" not in layer_types):
        return build(None)
    if layer_types:
        return {"full_attention": build(None), "sliding_attention": build(window)}
    return build(window)


def flex_mask_for_model(sequence_ids: torch.Tensor, config: Any) -> Any:
    """The document ``BlockMask`` as the model of ``config`` must be handed it (:func:`masks_by_layer`)."""
    from toolkit.train.attention import document_block_mask

    return masks_by_layer(config, lambda window: document_block_mask(sequence_ids, window))


def mask_for_model(mask: torch.Tensor, config: Any) -> Any:
    """The dense boolean ``mask`` as the model of ``config`` must be handed it (:func:`masks_by_layer`): windowed
    for its sliding-window layers, and 0 / -inf for eager attention, which adds the mask to the scores."""
    eager = getattr(config, "_attn_implementation", None) == "eager"

    def build(window: int | None) -> torch.Tensor:
        m = mask
        if window is not None:
            index = torch.arange(mask.shape[-1], device=mask.device)
            m = mask & ((index[:, None] - index[None, :]) < window)
        return torch.zeros(m.shape, device=m.device).masked_fill(~m, torch.finfo(torch.float32).min) if eager else m

    return masks_by_layer(config, build)


def _chunk_logps(head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = head(hidden).float()
    return torch.log_softmax(logits, dim=-1).gather(-1, labels[:, None]).squeeze(-1)


class _FrozenHeadLogps(torch.autograd.Function):
    """Label log-probs of one chunk through a frozen output head, with the gradient made in forward.

    ``d log p(y) / d h = W[y] - softmax(h W^T) W``: computing it while the chunk's logits exist
    costs one GEMM and keeps only ``[chunk, H]``, where recomputing the logits in backward costs
    two (forward again, then the input gradient). Only valid when nothing in the head trains.
    """

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, labels: torch.Tensor, head: nn.Module) -> torch.Tensor:
        from toolkit.train.kernels.reference import logps_and_grad

        with torch.no_grad():
            # onehot(y) - softmax, formed in fp32 like autograd's own gradient, then one GEMM.
            picked, direction = logps_and_grad(head(hidden), labels)
            grad = direction @ head.weight.to(direction.dtype)
        ctx.save_for_backward(grad)
        ctx.hidden_dtype = hidden.dtype
        return picked

    @staticmethod
    def backward(ctx: Any, grad_picked: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (grad,) = ctx.saved_tensors
        return (grad_picked[:, None].to(grad.dtype) * grad).to(ctx.hidden_dtype), None, None


def _logsumexp(logits: torch.Tensor) -> torch.Tensor:
    return torch.logsumexp(logits.float(), dim=-1)


def _grad_logits(logits: torch.Tensor, lse: torch.Tensor, labels: torch.Tensor, grad_picked: torch.Tensor) -> torch.Tensor:
    """``(onehot(y) - softmax) * grad`` in fp32, rounded once to the logits' dtype.

    Pointwise only (the one-hot is a comparison, not a scatter), so on CUDA it compiles to one
    kernel that reads the kept logits and writes the gradient without fp32 copies of the chunk.
    Written in place so that eager (CPU) holds one fp32 copy of the chunk, as the planner counts.
    """
    columns = torch.arange(logits.shape[-1], device=logits.device)
    grad = logits.float().sub_(lse[:, None]).exp_().neg_()
    grad.add_(columns[None, :] == labels[:, None])
    return grad.mul_(grad_picked[:, None].float()).to(logits.dtype)


class _LinearHeadLogps(torch.autograd.Function):
    """Label log-probs of one chunk through a trainable bias-free linear head, logits kept for backward.

    Keeps the chunk's logits in the compute dtype (bf16 under mixed precision: never fp32 for the
    whole vocabulary) and their log-sum-exp, so backward forms ``onehot(y) - softmax`` directly
    instead of recomputing the head GEMM as checkpointing does.
    """

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        dtype = torch.get_autocast_dtype(hidden.device.type) if torch.is_autocast_enabled(hidden.device.type) else hidden.dtype
        with torch.no_grad():
            h, w = hidden.to(dtype), weight.to(dtype)
            logits = h @ w.t()
            lse = compiled("head_logsumexp", _logsumexp, logits.device)(logits)
            picked = logits.gather(-1, labels[:, None]).squeeze(-1).float() - lse
        ctx.save_for_backward(h, labels, w, logits, lse)
        ctx.dtypes = (hidden.dtype, weight.dtype)
        return picked

    @staticmethod
    def backward(ctx: Any, grad_picked: torch.Tensor) -> tuple[torch.Tensor, None, torch.Tensor]:
        h, labels, w, logits, lse = ctx.saved_tensors
        hidden_dtype, weight_dtype = ctx.dtypes
        grad_logits = compiled("head_grad_logits", _grad_logits, logits.device)(logits, lse, labels, grad_picked)
        grad_hidden = (grad_logits @ w).to(hidden_dtype) if ctx.needs_input_grad[0] else None
        grad_weight = (grad_logits.t() @ h).to(weight_dtype) if ctx.needs_input_grad[2] else None
        return grad_hidden, None, grad_weight


def trainable_linear_head(head: nn.Module) -> bool:
    """A plain bias-free linear head whose weight trains and is materialised here (not ZeRO-3-partitioned)."""
    weight = getattr(head, "weight", None)
    return (type(head) is nn.Linear and head.bias is None and weight is not None and weight.requires_grad
            and not hasattr(weight, "ds_id"))


def frozen_head(head: nn.Module) -> bool:
    """A plain linear head without bias of which nothing trains (LoRA, QLoRA, freeze and reference models)."""
    return type(head) is nn.Linear and head.bias is None and not head.weight.requires_grad


def label_logps(head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor, chunk: int | None = None,
                recompute: bool | None = None, fused_ops: Any = None) -> torch.Tensor:
    """``log p(labels)`` for ``hidden [N, H]``, a chunk of tokens at a time (never full fp32 logits).

    Under gradient: with ``fused_ops`` (a kernel backend; only for losses whose gradient is the same
    for every label log-prob) a plain head makes its input and weight gradients in forward
    (:mod:`toolkit.train.fused_head`); otherwise a frozen head makes its input gradient in forward;
    a trainable plain head keeps each chunk's logits in the compute dtype for backward; anything
    else (or ``recompute``) recomputes each chunk's logits in backward, holding none.
    """
    chunk = chunk or LOGPS_CHUNK_TOKENS
    recompute = RECOMPUTE_LOGITS if recompute is None else recompute
    plain_head = trainable_linear_head(head) or frozen_head(head)
    if fused_ops is not None and plain_head and torch.is_grad_enabled() and hidden.shape[0] > 0 and (
            hidden.requires_grad or head.weight.requires_grad):
        from toolkit.train.fused_head import fused_label_logps

        return fused_label_logps(head, hidden, labels, chunk, fused_ops)
    pieces = []
    fused = frozen_head(head)
    keep_logits = not recompute and trainable_linear_head(head)
    for start in range(0, hidden.shape[0], chunk):
        h, y = hidden[start:start + chunk], labels[start:start + chunk]
        if fused and torch.is_grad_enabled() and h.requires_grad:
            pieces.append(_FrozenHeadLogps.apply(h, y, head))
        elif keep_logits and torch.is_grad_enabled():
            pieces.append(_LinearHeadLogps.apply(h, y, head.weight))
        elif torch.is_grad_enabled() and (h.requires_grad or any(p.requires_grad for p in head.parameters())):
            pieces.append(checkpoint(_chunk_logps, head, h, y, use_reentrant=False))
        else:
            pieces.append(_chunk_logps(head, h, y))
    return torch.cat(pieces) if pieces else hidden.new_zeros(0, dtype=torch.float32)


class SoftcappedHead(nn.Module):
    """The output head with Gemma 2's final logit soft-capping, ``cap * tanh(logits / cap)``, as HF's forward
    applies it after ``lm_head`` (:func:`label_logps` then takes its generic, recomputing path)."""

    def __init__(self, head: nn.Module, cap: float):
        super().__init__()
        self.head, self.cap = head, float(cap)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.head(hidden) / self.cap) * self.cap


def unwrap(model: nn.Module) -> nn.Module:
    """The HF ``*ForCausalLM`` under DDP/PEFT wrappers."""
    while True:
        if hasattr(model, "module") and isinstance(model.module, nn.Module):
            model = model.module
        elif hasattr(model, "get_base_model"):
            model = model.get_base_model()
        else:
            return model


def decoder_layers(model: nn.Module, who: str = "") -> nn.ModuleList:
    """The decoder layers (``model.layers``) of the HF causal LM under DDP/PEFT wrappers; ``who`` starts the error
    (``"--strategy fsdp: "``). Used by FSDP's per-layer sharding and the kernel patches (compile, checkpointing)."""
    inner = unwrap(model)
    layers = getattr(inner.get_decoder(), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        from toolkit.errors import ModelError

        raise ModelError(f"{who}cannot find the decoder layers of {type(inner).__name__} (expected model.layers)")
    return layers


class CausalLMLogps(nn.Module):
    """Wraps an HF causal LM so its forward returns label log-probs (what DDP/FSDP/DeepSpeed wrap)."""

    fused_ops: Any = None
    """A kernel backend while the engine runs a loss with a uniform token gradient: the head's gradients are
    made in forward (:mod:`toolkit.train.fused_head`); ``None``: the plain chunked path."""
    packed_attention: str = "sdpa-mask"
    """How rows holding several sequences attend: ``sdpa-mask`` (a dense mask for HF's attention) or ``flex``
    (a FlexAttention ``BlockMask``; the model was switched by :func:`toolkit.train.attention.use_flex`)."""

    def __init__(self, model: nn.Module, autocast_dtype: torch.dtype | None = None, packed_attention: str = "sdpa-mask"):
        super().__init__()
        self.model = model
        self.autocast_dtype = autocast_dtype
        self.packed_attention = packed_attention

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, position_ids: torch.Tensor,
                sequence_ids: torch.Tensor, label_index: torch.Tensor | None = None,
                plain: bool | None = None) -> tuple[Any, ...]:
        """``(logps, aux, aux_metrics)``; a sequence-classification model (reward modeling) adds ``scores [sequences]``.

        ``label_index`` (flat positions of the trained labels) and ``plain`` (see :func:`plain_causal`),
        when the caller worked them out on the host, spare two device-to-host synchronisations.
        """
        inner = unwrap(self.model)
        decoder, head = inner.get_decoder(), inner.get_output_embeddings()
        cap = getattr(inner.config, "final_logit_softcapping", None)
        if head is not None and cap:
            head = SoftcappedHead(head, cap)
        if head is None and isinstance(getattr(inner, "score", None), nn.Module):
            return self._scores(inner, decoder, input_ids, labels, position_ids, sequence_ids)
        device_type = input_ids.device.type
        enabled = self.autocast_dtype is not None
        with torch.autocast(device_type=device_type, dtype=self.autocast_dtype or torch.bfloat16, enabled=enabled):
            kwargs: dict[str, Any] = {}
            patched_aux = getattr(inner, "toolkit_pop_aux_loss", None)
            if patched_aux is None and getattr(inner.config, "output_router_logits", None) is not None and hasattr(inner.config, "router_aux_loss_coef"):
                kwargs["output_router_logits"] = True
            out = decoder(input_ids=input_ids, position_ids=position_ids,
                          attention_mask=attention_mask_for(sequence_ids, plain, self.packed_attention, inner.config),
                          use_cache=False, **kwargs)
            hidden = out.last_hidden_state
            if label_index is None:
                label_index = (labels != IGNORE_INDEX).flatten().nonzero().squeeze(1)
            picked = label_logps(head, hidden.flatten(0, 1).index_select(0, label_index),
                                 labels.flatten().index_select(0, label_index), fused_ops=self.fused_ops)
        logps = torch.zeros(labels.numel(), dtype=torch.float32, device=labels.device)
        logps = logps.index_copy(0, label_index, picked).view(labels.shape)
        aux, aux_metrics = router_aux_loss(inner, out, sequence_ids)
        return logps, aux, aux_metrics

    def _scores(self, inner: nn.Module, decoder: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor,
                position_ids: torch.Tensor, sequence_ids: torch.Tensor) -> tuple[torch.Tensor, None, dict, torch.Tensor]:
        """The value head on each sequence's last token (what HF's ``*ForSequenceClassification`` scores)."""
        enabled = self.autocast_dtype is not None
        with torch.autocast(device_type=input_ids.device.type, dtype=self.autocast_dtype or torch.bfloat16, enabled=enabled):
            hidden = decoder(input_ids=input_ids, position_ids=position_ids,
                             attention_mask=attention_mask_for(sequence_ids, None, self.packed_attention, inner.config),
                             use_cache=False).last_hidden_state
        flat = sequence_ids.flatten()
        valid = flat >= 0
        positions = torch.arange(flat.numel(), device=flat.device)
        count = int(flat.max()) + 1 if bool(valid.any()) else 0
        last = torch.full((count,), -1, dtype=torch.long, device=flat.device)
        last = last.scatter_reduce(0, flat[valid], positions[valid], reduce="amax")
        scores = inner.score(hidden.flatten(0, 1)[last]).float().squeeze(-1)
        return torch.zeros(labels.shape, dtype=torch.float32, device=labels.device), None, {}, scores


def router_aux_loss(inner: nn.Module, out: Any, sequence_ids: torch.Tensor) -> tuple[torch.Tensor | None, dict[str, float]]:
    """The weighted MoE auxiliary loss of this forward and routing metrics (both empty for dense models).

    The plain HF model's loss is transformers' ``load_balancing_loss_func`` of each MoE layer's router logits,
    averaged over the layers: the one definition toolkit-moe and megatron compute too (docs/moe.md). Transformers
    itself passes all layers at once, which pools ``f_e`` and ``P_e`` over layers and couples them (cross-layer
    terms ``f_l P_m``) in a way a per-layer engine cannot compute; for one MoE layer the two are equal.
    """
    patched_aux = getattr(inner, "toolkit_pop_aux_loss", None)
    if patched_aux is not None:  # a plugin replaced the MoE blocks (toolkit_patch_model) and owns the aux loss
        loss, metrics = pop_aux_loss(patched_aux, (sequence_ids >= 0).flatten())
        return loss, {k: float(v) for k, v in (metrics or {}).items()}
    router_logits = getattr(out, "router_logits", None)
    coef = getattr(inner.config, "router_aux_loss_coef", 0.0)
    if not router_logits or not coef:
        return None, {}
    try:
        from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func
    except ImportError:  # pragma: no cover - transformers without mixtral
        return None, {}
    experts = getattr(inner.config, "num_local_experts", None) or inner.config.num_experts
    top_k = inner.config.num_experts_per_tok
    attention = (sequence_ids >= 0).long()
    layers = [load_balancing_loss_func((logits,), experts, top_k, attention) for logits in router_logits]
    return coef * torch.stack(layers).mean(), {}


def pop_aux_loss(pop: Callable[..., Any], tokens: torch.Tensor) -> Any:
    """``model.toolkit_pop_aux_loss``'s result, given the real-token mask when it takes one (``tokens``).

    A patched model whose pop takes no argument still works; its router losses then count padding.
    """
    return pop(tokens=tokens) if _takes_tokens(getattr(pop, "__func__", pop)) else pop()


@functools.cache
def _takes_tokens(function: Callable[..., Any]) -> bool:
    """Read once per function, not on every micro-batch."""
    return "tokens" in inspect.signature(function).parameters


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy a host tensor to ``device`` without waiting for the GPU (pinned, non-blocking); as is otherwise."""
    if device.type == "cuda" and tensor.device.type == "cpu":
        try:
            return tensor.pin_memory().to(device, non_blocking=True)
        except RuntimeError:  # no pinned memory to be had: a plain (synchronising) copy is still correct
            return tensor.to(device)
    return tensor.to(device)


def token_logps(module: nn.Module, batch: dict[str, Any], device: torch.device) -> TokenLogps:
    """Run a :class:`CausalLMLogps` (possibly DDP-wrapped) on a micro-batch and build :class:`TokenLogps`.

    What needs the host (label positions, whether the mask is plain causal) is read from the
    micro-batch where it lives, so a host-side batch costs the GPU no synchronisation.
    """
    labels_host, sequence_ids_host = batch["labels"], batch["sequence_ids"]
    label_index = (labels_host != IGNORE_INDEX).flatten().nonzero().squeeze(1)
    plain = plain_causal(sequence_ids_host)
    ids = to_device(batch["input_ids"], device)
    labels = to_device(labels_host, device)
    sequence_ids = to_device(sequence_ids_host, device)
    outputs = module(ids, labels, to_device(batch["position_ids"], device), sequence_ids, to_device(label_index, device), plain)
    logps, aux, aux_metrics = outputs[:3]
    scores = outputs[3] if len(outputs) > 3 else None
    meta = {k: to_device(v, device) for k, v in batch["sequence_meta"].items()}
    token_meta = {k: to_device(v, device) for k, v in batch.get("token_meta", {}).items()}
    return TokenLogps(logps=logps, mask=labels != IGNORE_INDEX, sequence_ids=sequence_ids,
                      num_sequences=batch["num_sequences"], sequence_meta=meta,
                      reference_logps=meta.get("reference_logps"), aux_loss=aux, aux_metrics=aux_metrics, scores=scores,
                      token_meta=token_meta)
