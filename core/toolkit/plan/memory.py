"""Per-GPU memory of one training layout: weights, gradients, optimizer states, activations, buffers.

Bytes per parameter follow each strategy's real precision scheme (docs/plan.md has the table):

- ``local`` / ``fsdp``: fp32 parameters, bf16 autocast, fp32 AdamW states (4 + 4 + 8 bytes); under
  autocast every matmul weight also gets a bf16 copy that autograd keeps until the backward pass.
- ``deepspeed``: bf16 parameters and gradients, fp32 master + AdamW states (2 + 2 + 12), sharded by
  the ZeRO stage over data parallelism; ``offload`` moves the optimizer partition to CPU.
- ``megatron``: bf16 parameters, fp32 main gradients, fp32 master + AdamW (2 + 4 + 12); the
  distributed optimizer shards the 12 over data parallelism.
- LoRA: frozen base weights in bf16 (QLoRA: 4-bit NF4 with double quantisation), fp32 adapters.

Activation bytes per token were counted from what autograd saves for backward in the HF Llama
layer (``tests/test_plan_memory.py`` re-measures them with ``saved_tensors_hooks``) and from
Korthikanti et al. (2022) for Megatron-Core with sequence parallelism, assuming flash attention
(no seq x seq scores are stored).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from toolkit.plan.hardware import GIB, Cluster
from toolkit.plan.model import ModelShape

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
        """Data-parallel size of the expert weights (expert tensor parallelism is 1)."""
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
    gradients: float = 0.0
    optimizer: float = 0.0
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
        return (self.weights + grads + self.optimizer + self.activations + self.logits + self.weight_copies
                + self.buffers)

    @property
    def optimizer_step_peak(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.optimizer_step_temp + self.buffers

    @property
    def total(self) -> float:
        """Peak allocated bytes: the larger of the backward-pass and optimizer-step peaks."""
        return max(self.forward_backward_peak, self.optimizer_step_peak)

    def rows(self) -> list[tuple[str, float]]:
        rows = [("weights", self.weights), ("gradients", self.gradients), ("optimizer states", self.optimizer),
                ("activations", self.activations)]
        if self.logits:
            rows.append(("logits + loss", self.logits))
        if self.weight_copies:
            rows.append(("bf16 weight copies (autocast)", self.weight_copies))
        rows.append(("buffers + workspace", self.buffers))
        return rows


def bytes_per_param(layout: Layout, tuner: str) -> tuple[float, float, float]:
    """(weight, gradient, optimizer) bytes per *trainable* parameter for the strategy."""
    if tuner != "full":
        return 4.0, 4.0, 8.0  # fp32 adapters
    return {"local": (4.0, 4.0, 8.0), "fsdp": (4.0, 4.0, 8.0), "deepspeed": (2.0, 2.0, 12.0),
            "megatron": (2.0, 4.0, 12.0)}[layout.strategy]


def frozen_bytes_per_param(tuner: str) -> float:
    """Bytes per frozen base parameter: bf16 for LoRA, NF4 + double-quantised scales for QLoRA."""
    return 0.5 + 0.5 / 64 + 4 / (64 * 256) if tuner == "qlora" else 2.0


def activation_bytes_per_token_layer(shape: ModelShape, layout: Layout, workload: Workload) -> float:
    """Bytes autograd keeps per token for one decoder layer (no recompute), on one GPU."""
    h, kv = shape.hidden, shape.kv_dim
    if shape.is_moe:
        k = shape.experts_per_token
        mlp = k * (8 * shape.expert_ffn + 4 * h) + 8 * shape.shared_expert_ffn + 4 * shape.experts
        mlp = (mlp * shape.moe_layers + 8 * shape.ffn * shape.dense_layers) / shape.layers
    else:
        mlp = 8 * shape.ffn
    lora = 14 * workload.lora_rank if workload.tuner != "full" else 0
    if layout.strategy == "megatron":
        # bf16 everywhere; with sequence parallelism every saved tensor is split over TP.
        return (12 * h + 4 * kv + mlp + lora) / (layout.tp * layout.cp)
    if layout.strategy == "local" and workload.tuner == "full":
        # fp32 residual stream: both RMSNorms keep fp32 input and output (16h), five autocast
        # copies of linear inputs (10h), q/attention output (4h), k/v (4kv), SwiGLU (8f).
        return (30 * h + 4 * kv + mlp) / layout.cp
    # bf16 residual stream (bf16 base weights, or bf16 compute parameters under FSDP/ZeRO).
    return (24 * h + 4 * kv + mlp + lora) / layout.cp


def checkpoint_bytes_per_token_layer(shape: ModelShape, layout: Layout, workload: Workload) -> float:
    """What full recompute keeps per layer and token: the layer's input hidden state."""
    if layout.strategy == "megatron":
        return 2 * shape.hidden / (layout.tp * layout.cp)
    fp32_residual = layout.strategy == "local" and workload.tuner == "full"
    return (4 if fp32_residual else 2) * shape.hidden / layout.cp


LOGPS_CHUNK_TOKENS = 2048
"""Tokens per chunk of the core's label log-prob computation (toolkit.train.logps)."""


def logits_bytes(shape: ModelShape, layout: Layout, tokens: int) -> float:
    """Loss-time peak on the last stage for one micro-batch.

    HF-module strategies use the core's chunked label log-probs: logits exist for one chunk of
    2048 tokens at a time and are recomputed in backward, where bf16 logits, their fp32 copy, the
    log-softmax and two gradients of that size coexist (14 bytes x vocab per token). Megatron's
    vocab-parallel cross entropy keeps bf16 logits plus fp32 softmax for the whole micro-batch,
    split over TP (10 bytes x vocab / TP per token)."""
    if layout.strategy == "megatron":
        return 10 * shape.vocab / layout.tp * tokens
    return 14 * shape.vocab * min(tokens // layout.cp, LOGPS_CHUNK_TOKENS)


def params_on_stage(shape: ModelShape, layout: Layout, first: bool, last: bool) -> tuple[float, float]:
    """(dense parameters, expert parameters) held by one GPU of a pipeline stage."""
    split = layout.tp if layout.strategy == "megatron" else 1
    dense = shape.layer_params_nonexpert / (layout.pp * split)
    if first:
        dense += shape.embedding_params / split
    if last:
        head = shape.output_params if layout.pp == 1 else shape.embedding_params
        dense += (head + shape.hidden) / split
    expert = shape.expert_params / (layout.pp * (layout.ep if layout.strategy == "megatron" else 1))
    return dense, expert


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
    w_bytes, g_bytes, o_bytes = bytes_per_param(layout, tuner)
    out = MemoryBreakdown(stage=("only stage" if first and last else "first stage" if first else "last stage"))
    dp_dense, dp_expert = layout.dp, (layout.expert_dp if layout.strategy == "megatron" else layout.dp)

    if tuner == "full":
        shard_w = layout.zero >= 3
        shard_g = layout.zero >= 2
        out.weights = w_bytes * (dense / dp_dense + expert / dp_expert if shard_w else params)
        out.gradients = g_bytes * (dense / dp_dense + expert / dp_expert if shard_g else params)
        out.optimizer = o_bytes * (dense / dp_dense + expert / dp_expert if layout.zero >= 1 else params)
        trainable_local = dense / dp_dense + expert / dp_expert if layout.zero >= 1 else params
        if layout.strategy == "deepspeed":
            out.gradients += 4.0 * trainable_local  # fp32 gradient partition of the bf16 optimizer
    else:
        share = params / max(1, shape.total_params)
        adapters = shape.lora_params(workload.lora_rank) * share
        adapters /= layout.tp if layout.strategy == "megatron" else 1
        out.weights = frozen_bytes_per_param(tuner) * params + w_bytes * adapters
        out.gradients = g_bytes * adapters
        out.optimizer = o_bytes * adapters
        trainable_local = adapters
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
        out.logits = logits_bytes(shape, layout, tokens)
    if layout.strategy == "local" and tuner == "full":
        out.weight_copies = 2.0 * params  # autocast's bf16 weights, saved for backward
    out.gradients_persistent = layout.strategy in ("megatron", "deepspeed")
    if layout.strategy in ("local", "fsdp") and not layout.offload:
        out.optimizer_step_temp = 4.0 * trainable_local  # torch's foreach AdamW materialises sqrt(v)
    out.buffers = WORKSPACE
    if layout.zero >= 3:
        layer = (shape.layer_params_nonexpert + shape.expert_params) / shape.layers
        out.buffers += 2 * 2.0 * layer  # current + prefetched layer gathered in bf16
    if layout.strategy == "local" and layout.dp > 1 and tuner == "full":
        out.buffers += 4.0 * params  # DDP gradient buckets (gradient_as_bucket_view=False)
    return out


def layout_memory(shape: ModelShape, layout: Layout, workload: Workload, micro_batches: int) -> MemoryBreakdown:
    """The most loaded GPU: with pipeline stages, the larger of the first and last stage."""
    if layout.pp == 1:
        return stage_memory(shape, layout, workload, micro_batches, True, True)
    first = stage_memory(shape, layout, workload, micro_batches, True, False)
    last = stage_memory(shape, layout, workload, micro_batches, False, True)
    return first if first.total >= last.total else last


def usable_memory(cluster: Cluster) -> float:
    return (cluster.gpu_memory - CONTEXT_RESERVE) * HEADROOM
