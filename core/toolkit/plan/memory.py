"""Per-GPU memory of one training layout: weights, gradients, optimizer states, activations, buffers.

Bytes per parameter follow each strategy's real precision scheme (docs/plan.md has the table):

- ``local`` (``--precision bf16``, ``Workload.bf16_mode`` ``master``, the default): bf16 parameters
  (2), fp32 master weights (4), fp32 master gradients (4, accumulated after every micro-batch, so
  they exist during forward/backward only from the second micro-batch of a step on) and fp32 AdamW
  m, v (8); bf16 parameter gradients exist only between a backward pass and the accumulation
  (the head's gradient already at the loss-time peak). Fused AdamW makes no full-size temporary.
- ``local`` in ``autocast`` mode, and ``fsdp``: fp32 parameters under bf16 autocast, fp32
  AdamW (4 + 4 + 8); autocast keeps a bf16 copy of every matmul weight until the backward pass.
- ``local`` in ``pure`` mode (``--local-bf16-mode pure``): bf16 parameters, bf16 gradients
  (accumulated in place, so they exist during forward/backward only from the second micro-batch on)
  and bf16 AdamW m, v (2 + 2 + 4); no master copy. Fused AdamW updates them in place.
- ``deepspeed``: bf16 parameters and gradients, fp32 master + AdamW states (2 + 2 + 12), sharded by
  the ZeRO stage over data parallelism; ``offload`` moves the optimizer partition to CPU.
- ``megatron``: bf16 parameters, fp32 main gradients, fp32 master + AdamW (2 + 4 + 12); the
  distributed optimizer shards the 12 over data parallelism.
- LoRA: frozen base weights in bf16 (QLoRA: 4-bit NF4 with double quantisation); adapters fp32
  (4 + 4 + 8), or on ``local`` with master weights bf16 adapters + fp32 master, grads, m, v (2 + 4 + 4 + 8).

Activation bytes per token were counted from what autograd saves for backward in the HF Llama
layer (``tests/test_plan_measure.py`` re-measures them with ``saved_tensors_hooks``) and from
Korthikanti et al. (2022) for Megatron-Core with sequence parallelism, assuming flash attention
(no seq x seq scores are stored).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from toolkit.parallel import ParallelLayout
from toolkit.plan.hardware import GIB, Cluster
from toolkit.plan.model import (
    EAGER_ATTENTION_FAMILIES,
    EXTRA_NORMS,
    QK_NORM_FAMILIES,
    ZERO_CENTERED_NORM_FAMILIES,
    ModelShape,
)

STRATEGIES = ("local", "fsdp", "deepspeed", "megatron")
TUNERS = ("full", "lora", "qlora")
WORKSPACE = 256 * 2**20
"""cuBLAS/cuDNN workspaces and small tensors the caching allocator holds besides the model."""
CONTEXT_RESERVE = 1 * GIB
"""CUDA context and NCCL buffers: outside the allocator, not in max_memory_allocated."""
HEADROOM = 0.95
"""A plan must leave 5% of the usable memory for allocator fragmentation."""


@dataclass(frozen=True)
class Workload:
    """What is trained: sequence length, micro-batch rows, global batch rows, tuner."""

    seq_len: int = 4096
    micro_batch_size: int = 1
    global_batch_size: int = 0
    tuner: str = "full"
    lora_rank: int = 16
    bf16_mode: Literal["master", "autocast", "pure"] = "master"
    """``local`` (``--local-bf16-mode``): ``master`` bf16 parameters + fp32 master weights (the
    ``--precision bf16`` default); ``autocast`` fp32 parameters under bf16 autocast (also what
    ``--precision fp32`` is planned as); ``pure`` bf16 parameters, gradients and AdamW states, no fp32 copy."""
    logps_chunk_tokens: int = 2048
    """Tokens per chunk of the label log-probs (``--local-logps-chunk-tokens``)."""
    recompute_logits: bool = False
    """``--local-recompute-logits``: recompute each chunk's logits in backward instead of keeping
    them (in bf16) for backward, as the engine does by default for a trainable plain head."""
    fused_loss: bool = False
    """``--local-fused-loss`` (the engine's default on a GPU for pt/sft): the output head's input and
    weight gradients are made in forward, chunk by chunk; nothing of vocabulary size is kept for backward
    (it takes the place of ``recompute_logits``). ``local`` strategy only."""
    megatron_fused_loss: bool = False
    """``--megatron-fused-loss`` (the megatron engine's default on a GPU for pt/sft): the last stage hands over
    hidden states and the head's gradients are made in forward a chunk of tokens at a time, vocabulary-parallel
    (no ``[tokens, V/tp]`` logits). ``megatron`` strategy only."""
    kernels: str = "none"
    """``--local-kernels`` as it resolves on the target (``auto`` is ``triton`` on a GPU): ``triton`` or
    ``liger`` fuse RMSNorm and SwiGLU (less kept for backward in :data:`KERNEL_FAMILIES`) and write the
    fused loss's softmax gradient over the chunk's logits; ``torch``/``none`` compute what HF computes."""
    packed_attention: str = "sdpa-mask"
    """``--local-packed-attention`` (and FSDP's, DeepSpeed's) as it resolves on the target (``auto`` is ``flex`` on a
    GPU): ``flex`` runs Gemma 2's soft-capped attention through FlexAttention, which keeps no scores for backward;
    ``sdpa-mask`` leaves it eager (:data:`~toolkit.plan.model.EAGER_ATTENTION_FAMILIES`), as a CPU run does."""

    @property
    def micro_batch_tokens(self) -> int:
        return self.seq_len * self.micro_batch_size


@dataclass(frozen=True)
class Layout:
    """One candidate parallel layout. ``zero``: 0 none; 1 optimizer states sharded (ZeRO-1 /
    Megatron distributed optimizer); 2 + gradients; 3 + parameters (ZeRO-3 / FSDP)."""

    strategy: str = "local"
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    cp: int = 1
    ep: int = 1
    dp: int = 1
    zero: int = 0
    offload: bool = False
    recompute: bool = False

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    @property
    def expert_dp(self) -> int:
        """Ranks holding the same expert slice (expert tensor parallelism is 1): Megatron's expert data parallelism,
        or under ``local`` the expert groups of toolkit-moe's ``--ep`` (``world / ep``)."""
        return max(1, self.world_size // (self.pp * self.ep))

    def describe(self) -> str:
        parts = [self.strategy]
        for label, value in (("TP", self.tp), ("PP", self.pp), ("VPP", self.vpp), ("CP", self.cp), ("EP", self.ep)):
            if value > 1:
                parts.append(f"{label}{value}")
        parts.append(f"DP{self.dp}")
        if self.strategy == "megatron" and self.zero:
            parts.append("dist-opt")
        elif self.strategy == "deepspeed":
            parts.append(f"ZeRO-{self.zero}")
        if self.offload:
            parts.append("offload")
        if self.recompute:
            parts.append("recompute")
        return " ".join(parts)

    @property
    def parallel(self) -> ParallelLayout:
        """The model-splitting part, as the engines check it (the planner models expert tensor parallelism 1)."""
        return ParallelLayout(tensor=self.tp, pipeline=self.pp, virtual=self.vpp, context=self.cp, expert=self.ep,
                              expert_tensor=1, sequence_parallel=self.strategy == "megatron" and self.tp > 1)

    def recipe_overrides(self) -> dict:
        """The recipe fields that select this layout (what ``--strategy auto`` applies)."""
        overrides = {"strategy": self.strategy, "tensor_parallel": self.tp, "pipeline_parallel": self.pp,
                     "virtual_pipeline": self.vpp, "context_parallel": self.cp, "expert_parallel": self.ep,
                     "sequence_parallel": self.strategy == "megatron" and self.tp > 1,
                     "gradient_checkpointing": self.recompute}
        if self.strategy == "deepspeed":
            overrides["zero"] = self.zero
        return overrides


@dataclass
class MemoryBreakdown:
    """Bytes on the most loaded GPU (the pipeline stage named in ``stage``)."""

    weights: float = 0.0
    master: float = 0.0
    gradients: float = 0.0
    optimizer: float = 0.0
    transient_gradients: float = 0.0
    activations: float = 0.0
    activations_without_recompute: float = 0.0
    logits: float = 0.0
    weight_copies: float = 0.0
    buffers: float = 0.0
    optimizer_step_temp: float = 0.0
    gradients_persistent: bool = True
    stage: str = "only stage"
    notes: list[str] = field(default_factory=list)

    @property
    def forward_backward_peak(self) -> float:
        grads = self.gradients if self.gradients_persistent else 0.0
        return (self.weights + self.master + grads + self.optimizer + self.activations + self.logits
                + self.weight_copies + self.transient_gradients + self.buffers)

    @property
    def optimizer_step_peak(self) -> float:
        """Gradient accumulation, clipping and the optimizer step (activations are gone)."""
        return self.weights + self.master + self.gradients + self.optimizer + self.optimizer_step_temp + self.buffers

    @property
    def total(self) -> float:
        """Peak allocated bytes: the larger of the backward-pass and optimizer-step peaks."""
        return max(self.forward_backward_peak, self.optimizer_step_peak)

    def rows(self) -> list[tuple[str, float]]:
        rows = [("weights", self.weights)]
        if self.master:
            rows.append(("fp32 master weights", self.master))
        rows += [("fp32 master gradients" if self.master else "gradients", self.gradients),
                 ("optimizer states", self.optimizer), ("activations", self.activations)]
        if self.logits:
            rows.append(("logits + loss", self.logits))
        if self.weight_copies:
            rows.append(("bf16 weight copies (autocast)", self.weight_copies))
        if self.transient_gradients:
            rows.append(("bf16 gradients at the peak", self.transient_gradients))
        if self.optimizer_step_temp:
            rows.append(("optimizer-step temporaries", self.optimizer_step_temp))
        rows.append(("buffers + workspace", self.buffers))
        return rows


def uses_master_weights(layout: Layout, workload: Workload) -> bool:
    """The local engine's ``--precision bf16`` scheme: bf16 parameters, fp32 master weights."""
    return layout.strategy == "local" and workload.bf16_mode == "master"


def uses_pure_bf16(layout: Layout, workload: Workload) -> bool:
    """The local engine's ``--local-bf16-mode pure``: bf16 parameters, gradients and AdamW states only."""
    return layout.strategy == "local" and workload.bf16_mode == "pure"


def fp32_autocast(layout: Layout, workload: Workload) -> bool:
    """fp32 parameters under bf16 autocast: fp32 residual stream and bf16 weight copies (full tuning)."""
    return layout.strategy == "local" and workload.bf16_mode == "autocast" and workload.tuner == "full"


def bytes_per_param(layout: Layout, tuner: str, bf16_mode: str = "master") -> tuple[float, float, float, float]:
    """(weight, fp32 master, gradient, optimizer) bytes per *trainable* parameter for the strategy.

    ``gradient`` is what persists until the optimizer step (fp32 master gradients on ``local``)."""
    if layout.strategy == "local" and bf16_mode == "pure":
        return 2.0, 0.0, 2.0, 4.0  # bf16 param, bf16 grad, bf16 m + v
    if layout.strategy == "local" and bf16_mode == "master":
        return 2.0, 4.0, 4.0, 8.0  # bf16 param, fp32 master, fp32 master grad, fp32 m + v
    if tuner != "full":
        return 4.0, 0.0, 4.0, 8.0  # fp32 adapters
    return {"local": (4.0, 0.0, 4.0, 8.0), "fsdp": (4.0, 0.0, 4.0, 8.0), "deepspeed": (2.0, 0.0, 2.0, 12.0),
            "megatron": (2.0, 0.0, 4.0, 12.0)}[layout.strategy]


def frozen_bytes_per_param(tuner: str) -> float:
    """Bytes per frozen base parameter: bf16 for LoRA, NF4 + double-quantised scales for QLoRA."""
    return 0.5 + 0.5 / 64 + 4 / (64 * 256) if tuner == "qlora" else 2.0


KERNEL_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
"""Families ``--local-kernels`` patches (``toolkit.train.kernels.patch.FAMILIES``; kept apart: no torch here)."""


def fused_kernels(shape: ModelShape, layout: Layout, workload: Workload) -> bool:
    """Whether the local engine runs the Triton/Liger RMSNorm and SwiGLU kernels for this model."""
    return layout.strategy == "local" and workload.kernels in ("triton", "liger") and shape.model_type in KERNEL_FAMILIES


def activation_bytes_per_token_layer(shape: ModelShape, layout: Layout, workload: Workload) -> float:
    """Bytes autograd keeps per token for one decoder layer (no recompute), on one GPU.

    With the fused kernels (bf16 residual stream) each RMSNorm keeps its bf16 input and a per-row
    scale instead of an fp32 copy and the rounded normalised value (4h less per norm, 2h less when its
    weight is frozen), and SwiGLU keeps gate and up but not ``silu(gate)`` (2f less)."""
    saved = _hf_activation_bytes_per_token_layer(shape, layout, workload)
    if fused_kernels(shape, layout, workload) and not fp32_autocast(layout, workload):
        saved -= ((8 if workload.tuner == "full" else 4) * shape.hidden + 2 * shape.ffn) / layout.cp
    return saved


def _hf_activation_bytes_per_token_layer(shape: ModelShape, layout: Layout, workload: Workload) -> float:
    """Bytes autograd keeps per token for one decoder layer of HF's own modules (no recompute)."""
    h, kv = shape.hidden, shape.kv_dim
    if shape.is_moe:
        k = shape.experts_per_token
        mlp = k * (8 * shape.expert_ffn + 4 * h) + 8 * shape.shared_expert_ffn + 4 * shape.experts
        mlp = (mlp * shape.moe_layers + 8 * shape.ffn * shape.dense_layers) / shape.layers
    else:
        mlp = 8 * shape.ffn
    lora = 14 * workload.lora_rank if workload.tuner != "full" else 0
    extra = _extra_norm_bytes_per_token_layer(shape, workload)  # family-specific: norms, eager attention
    if layout.strategy == "megatron":
        # bf16 everywhere; with sequence parallelism every saved tensor is split over TP.
        return (12 * h + 4 * kv + mlp + lora + extra) / (layout.tp * layout.cp)
    if shape.model_type in EAGER_ATTENTION_FAMILIES and workload.packed_attention != "flex":
        # eager attention: per query token and head a row of capped scores (bf16), their fp32 softmax and its bf16
        # cast (8 bytes a key), and the keys and values repeated to every query head (4 (q - kv) more than SDPA);
        # whole rows in sliding-window layers too: eager computes the full square and masks it
        extra += 8 * shape.heads * workload.seq_len + 4 * (shape.q_dim - kv)
    if fp32_autocast(layout, workload):
        # fp32 residual stream: both RMSNorms keep fp32 input and output (16h), five autocast
        # copies of linear inputs (10h), q/attention output (4h), k/v (4kv), SwiGLU (8f).
        return (30 * h + 4 * kv + mlp + extra) / layout.cp
    if workload.tuner != "full":
        # Frozen bf16 base (toolkit-peft's fused LoRA forward): frozen RMSNorm weights keep no
        # normalised input and frozen linears only the inputs their adapters share; 17h was counted
        # with saved_tensors_hooks on the real engine path (tests/test_plan_measure.py).
        return (17 * h + 4 * kv + mlp + lora + extra) / layout.cp
    # bf16 residual stream (bf16 parameters on local, or bf16 compute parameters under FSDP/ZeRO).
    return (24 * h + 4 * kv + mlp + extra) / layout.cp


def _extra_norm_bytes_per_token_layer(shape: ModelShape, workload: Workload) -> float:
    """What a layer's norms keep beyond the two Llama-style RMSNorms the base counts assume: norms on the sublayer
    outputs (GLM-4, Gemma 2/3) and on each head's query and key (Qwen3, Gemma 3). A Llama-style RMSNorm keeps its
    fp32 input and bf16 normalised value (6 bytes an element); Gemma's (1 + weight) norm an fp32 normalised value
    (8; its two base norms 2 more each); a frozen weight needs no normalised value (4). Measured with
    saved_tensors_hooks (tests/test_plan_measure.py)."""
    h = shape.hidden
    zero_centered = shape.model_type in ZERO_CENTERED_NORM_FAMILIES
    per_element = 4 if workload.tuner != "full" else 8 if zero_centered else 6
    qk = shape.q_dim + shape.kv_dim if shape.model_type in QK_NORM_FAMILIES else 0
    base = 2 * 2 * h if zero_centered and workload.tuner == "full" else 0
    return per_element * (EXTRA_NORMS.get(shape.model_type, 0) * h + qk) + base


def checkpoint_bytes_per_token_layer(shape: ModelShape, layout: Layout, workload: Workload) -> float:
    """What full recompute keeps per layer and token: the layer's input hidden state."""
    if layout.strategy == "megatron":
        return 2 * shape.hidden / (layout.tp * layout.cp)
    fp32_residual = fp32_autocast(layout, workload)
    return (4 if fp32_residual else 2) * shape.hidden / layout.cp


LOGPS_CHUNK_TOKENS = 2048
"""Tokens per chunk of the core's label log-prob computation (toolkit.train.logps)."""


def logits_bytes(shape: ModelShape, layout: Layout, tokens: int, workload: Workload | None = None) -> float:
    """Loss-time peak on the last stage for one micro-batch.

    HF-module strategies use the core's chunked label log-probs (``toolkit.train.logps``):

    - trainable head (full tuning), default: every chunk's bf16 logits stay for backward (2 bytes x
      vocab x all tokens of the micro-batch); backward of one chunk adds its fp32 logits and the
      fp32 softmax gradient made from them (8 bytes x vocab per token of a chunk).
    - trainable head with ``recompute_logits``: each chunk's logits are recomputed in backward,
      where the fp32 logits, the log-softmax and its gradients coexist (12 bytes x vocab per token
      of one chunk).
    Both were checked against the CPU allocator trace (tests/test_plan_measure.py: 12.3 and 7.4
    bytes x vocab measured beside the kept logits).
    - frozen head (LoRA, QLoRA): the gradient is made in forward; bf16 logits, an fp32 copy and the
      fp32 log-softmax of one chunk coexist (10 bytes x vocab), and each chunk keeps its ``[chunk, h]``
      bf16 input gradient (2 bytes x hidden x all tokens).

    Megatron's vocab-parallel cross entropy keeps bf16 logits plus fp32 softmax for the whole
    micro-batch, split over TP (10 bytes x vocab / TP per token); with its fused head, see
    :func:`megatron_fused_loss_bytes`."""
    workload = workload or Workload()
    if layout.strategy == "megatron":
        if workload.megatron_fused_loss:
            return megatron_fused_loss_bytes(shape, layout, workload, tokens)
        return 10 * shape.vocab / layout.tp * tokens
    tokens = tokens // layout.cp
    chunk = min(tokens, workload.logps_chunk_tokens)
    if workload.fused_loss and layout.strategy == "local":
        return fused_loss_bytes(shape, workload, tokens, chunk)
    if workload.tuner != "full":
        return 10 * shape.vocab * chunk + 2 * shape.hidden * tokens
    if workload.recompute_logits or (layout.strategy == "deepspeed" and layout.zero >= 3):
        return 12 * shape.vocab * chunk  # ZeRO-3-partitioned heads always take the recompute path
    return 2 * shape.vocab * tokens + 8 * shape.vocab * chunk


def fused_loss_bytes(shape: ModelShape, workload: Workload, tokens: int, chunk: int) -> float:
    """Loss-time peak of the fused linear + cross-entropy head (``toolkit.train.fused_head``), beside the
    head's gradient that :attr:`MemoryBreakdown.transient_gradients` counts (master weights).

    In forward the input gradient ``[tokens, h]`` (compute dtype) and the head's weight gradient are
    filled chunk by chunk; one chunk's softmax gradient needs its bf16 logits plus, with the torch
    reference ops, an fp32 copy and the fp32 log-softmax (10 bytes x vocab per token of a chunk; the
    Triton kernel writes the gradient over the logits: 2). In the head's backward the scaled input and
    weight gradients are made while the saved ones still exist: a second head gradient and ``4 h``
    per token. Under fp32 parameters (no master weights) the weight gradient is fp32 and not counted
    elsewhere, and each chunk's bf16 product is cast to fp32 before it is added (6 bytes x head);
    the head's bf16 autocast copy is among the weight copies."""
    per_chunk = (2 if workload.kernels in ("triton", "liger") else 10) * shape.vocab * chunk
    inputs = 2 * shape.hidden * tokens
    if workload.tuner != "full":  # frozen head: no weight gradient
        return inputs + max(per_chunk, inputs)
    head = shape.vocab * shape.hidden
    if workload.bf16_mode != "autocast":
        return max(inputs + per_chunk, 2 * head + 2 * inputs)
    return max(4 * head + inputs + per_chunk, 4 * head + inputs + 6 * head, 8 * head + 2 * inputs)


MEGATRON_FUSED_CHUNK_TOKENS = 2048
"""Tokens per chunk of toolkit-megatron's fused output head (``toolkit_megatron.fused_head``)."""


def megatron_fused_loss_bytes(shape: ModelShape, layout: Layout, workload: Workload, tokens: int) -> float:
    """Loss-time peak of toolkit-megatron's fused output head on one last-stage GPU (:func:`fused_loss_bytes`'
    counterpart on a vocabulary shard).

    The CP-local tokens (all of them under sequence parallelism: the head gathers them) are kept twice in
    bf16 (the trained rows and their input gradient); one chunk's bf16 logits over ``V/tp`` with their fp32
    softmax gradient and its bf16 copy (8 bytes x vocab / TP per token of a chunk; TP=1 goes through the
    core's head: 10 with the torch ops, 2 with Triton's). The head shard's bf16 weight gradient is filled in
    forward and, in backward, scaled into a second one beside the scaled input gradient (Megatron's fp32
    main gradients are counted with the gradients)."""
    tokens = tokens // layout.cp
    chunk = min(tokens, MEGATRON_FUSED_CHUNK_TOKENS)
    shard = shape.vocab / layout.tp
    per_token = 8 if layout.tp > 1 else (2 if workload.kernels in ("triton", "liger") else 10)
    per_chunk = per_token * shard * chunk
    inputs = 2 * shape.hidden * tokens
    if workload.tuner != "full":  # frozen head: no weight gradient
        return 2 * inputs + max(per_chunk, inputs)
    head = shard * shape.hidden
    return max(2 * inputs + per_chunk + 2 * head, 3 * inputs + 4 * head)


def params_on_stage(shape: ModelShape, layout: Layout, first: bool, last: bool) -> tuple[float, float]:
    """(dense parameters, expert parameters) held by one GPU of a pipeline stage (the first, or the last)."""
    split = layout.tp if layout.strategy == "megatron" else 1
    layers = stage_layers(shape, layout, 0 if first else layout.pp - 1)
    if layers is None:  # planned as an average stage
        count, moe = shape.layers / layout.pp, shape.moe_layers / layout.pp
    else:
        count, moe = len(layers), shape.moe_layers_among(layers)
    dense = (count * shape.attention_params + (count - moe) * shape.dense_mlp_params
             + moe * shape.moe_shared_params_per_layer) / split
    if first:
        dense += shape.embedding_params / split
    if last:
        head = shape.output_params if layout.pp == 1 else shape.embedding_params
        dense += (head + shape.hidden) / split
    expert = moe * shape.expert_params_per_layer / layout.ep  # Megatron's EP, or toolkit-moe's under local
    return dense, expert


def stage_layers(shape: ModelShape, layout: Layout, rank: int) -> list[int] | None:
    """The layer indices pipeline rank ``rank`` holds: Megatron's even split into ``pp x vpp`` chunks, rank r taking
    chunks r, r + pp, ... (``None`` where the layers do not split evenly)."""
    chunks = layout.pp * layout.vpp
    if shape.layers % chunks:
        return None
    size = shape.layers // chunks
    return [chunk * size + i for chunk in range(rank, chunks, layout.pp) for i in range(size)]


def in_flight_layers(shape: ModelShape, layout: Layout, micro_batches: int, first: bool) -> float:
    """Layer-activations held at the peak on a stage, in units of one layer x one micro-batch."""
    per_stage = shape.layers / layout.pp
    if layout.pp == 1:
        return per_stage
    if not first:
        return per_stage  # the last stage runs each micro-batch's backward right after its forward
    if micro_batches < layout.pp:
        return per_stage * micro_batches
    if layout.vpp > 1:  # interleaved 1F1B: Korthikanti et al. 2022, section 4.2.3
        return shape.layers * (1 + (layout.pp - 1) / (layout.pp * layout.vpp))
    return shape.layers


def stage_memory(shape: ModelShape, layout: Layout, workload: Workload, micro_batches: int,
                 first: bool, last: bool) -> MemoryBreakdown:
    """Memory of one GPU in the first and/or last pipeline stage."""
    tuner = workload.tuner
    dense, expert = params_on_stage(shape, layout, first, last)
    params = dense + expert
    master = uses_master_weights(layout, workload)
    w_bytes, m_bytes, g_bytes, o_bytes = bytes_per_param(layout, tuner, workload.bf16_mode)
    out = MemoryBreakdown(stage=("only stage" if first and last else "first stage" if first else "last stage"))
    dp_dense, dp_expert = layout.dp, layout.expert_dp

    if tuner == "full":
        shard_w = layout.zero >= 3
        shard_g = layout.zero >= 2
        out.weights = w_bytes * (dense / dp_dense + expert / dp_expert if shard_w else params)
        out.gradients = g_bytes * (dense / dp_dense + expert / dp_expert if shard_g else params)
        out.optimizer = o_bytes * (dense / dp_dense + expert / dp_expert if layout.zero >= 1 else params)
        trainable_local = dense / dp_dense + expert / dp_expert if layout.zero >= 1 else params
        if layout.strategy == "deepspeed":
            out.gradients += 4.0 * trainable_local  # fp32 gradient partition of the bf16 optimizer
        head_trainable = shape.embedding_params if last else 0.0  # output head (tied or not)
    else:
        share = params / max(1, shape.total_params)
        adapters = shape.lora_params(workload.lora_rank) * share
        adapters /= layout.tp if layout.strategy == "megatron" else 1
        out.weights = frozen_bytes_per_param(tuner) * params + w_bytes * adapters
        out.gradients = g_bytes * adapters
        out.optimizer = o_bytes * adapters
        trainable_local = adapters
        head_trainable = 0.0
    out.master = m_bytes * trainable_local
    if layout.offload:
        out.optimizer = 0.0
        if layout.strategy == "deepspeed":
            out.gradients = 2.0 * (params / dp_dense if layout.zero >= 2 else params)
        out.notes.append("optimizer states in CPU memory")

    tokens = workload.micro_batch_tokens
    full_layer = activation_bytes_per_token_layer(shape, layout, workload) * tokens
    layers_held = in_flight_layers(shape, layout, micro_batches, first)
    out.activations_without_recompute = full_layer * layers_held
    if layout.recompute:
        kept = checkpoint_bytes_per_token_layer(shape, layout, workload) * tokens
        out.activations = kept * layers_held + full_layer  # one layer is rebuilt at a time
    else:
        out.activations = out.activations_without_recompute
    if last:
        out.logits = logits_bytes(shape, layout, tokens, workload)
    if fp32_autocast(layout, workload):
        out.weight_copies = 2.0 * params  # autocast's bf16 weights, saved for backward
    if master:
        # fp32 master gradients are made after the first micro-batch's backward and freed by
        # zero_grad after the step: during forward/backward they exist only with accumulation.
        out.gradients_persistent = micro_batches > 1
        # At the loss-time peak the head's bf16 gradient is already there (its backward runs first).
        out.transient_gradients = 2.0 * head_trainable
        # Accumulation: every bf16 gradient waits while each is cast to fp32 (one cast tensor at a
        # time); with more than one micro-batch the fp32 master gradients already exist beside them.
        experts = shape.expert_params / max(1, shape.layers) / layout.ep  # one layer's gate_up slice: 2/3 of it
        largest = max(shape.embedding_params, experts * 2 / 3) if tuner == "full" else 0.0
        out.optimizer_step_temp = (w_bytes * trainable_local + 4.0 * largest) if micro_batches > 1 else 2.0 * largest
    elif uses_pure_bf16(layout, workload):
        # bf16 gradients are accumulated in place: during forward/backward they exist from the second
        # micro-batch on; in the first, the head's gradient is already there at the loss-time peak.
        out.gradients_persistent = micro_batches > 1
        out.transient_gradients = 0.0 if micro_batches > 1 else 2.0 * head_trainable
        # fused AdamW (GPU) updates parameters and states in place: no full-size temporary
    else:
        out.gradients_persistent = layout.strategy in ("megatron", "deepspeed")
        if layout.strategy in ("local", "fsdp") and not layout.offload:
            out.optimizer_step_temp = 4.0 * trainable_local  # torch's foreach AdamW materialises sqrt(v)
    out.buffers = WORKSPACE
    if layout.zero >= 3:
        layer = (shape.layer_params_nonexpert + shape.expert_params) / shape.layers
        out.buffers += 2 * 2.0 * layer  # current + prefetched layer gathered in bf16
    if layout.strategy == "local" and layout.dp > 1 and tuner == "full":
        # DDP gradient buckets in the parameter dtype (not bucket views); expert slices split over --ep stay out of DDP
        out.buffers += w_bytes * (dense if layout.ep > 1 else params)
    return out


def cpu_optimizer_temp(shape: ModelShape, tuner: str, state_bytes: float = 4.0) -> float:
    """CPU AdamW runs tensor by tensor (no fused kernel): two temporaries of the largest tensor in the
    optimizer's dtype (fp32 masters or parameters; 2 bytes under ``--local-bf16-mode pure``)."""
    return 2 * state_bytes * shape.embedding_params if tuner == "full" else 0.0


def layout_memory(shape: ModelShape, layout: Layout, workload: Workload, micro_batches: int) -> MemoryBreakdown:
    """The most loaded GPU: with pipeline stages, the larger of the first and last stage."""
    if layout.pp == 1:
        return stage_memory(shape, layout, workload, micro_batches, True, True)
    first = stage_memory(shape, layout, workload, micro_batches, True, False)
    last = stage_memory(shape, layout, workload, micro_batches, False, True)
    return first if first.total >= last.total else last


def usable_memory(cluster: Cluster) -> float:
    return (cluster.gpu_memory - CONTEXT_RESERVE) * HEADROOM
