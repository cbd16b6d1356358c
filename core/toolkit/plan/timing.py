"""Step-time model of one layout: compute at an efficiency, communication, pipeline bubble, optimizer.

Compute is training FLOPs (6 per matmul weight per token, 4 for frozen LoRA bases with their
adapters counted where PEFT puts them, +2 with recompute, plus the query-key pairs the causal and sliding-window masks allow) at a matmul efficiency that grows with the rows of the matmul
(tokens of a micro-batch; for routed experts, the tokens each expert receives) and the per-GPU
hidden size. Collectives use ring volumes over NVLink when the
group stays inside a node and over the network when it spans nodes (Megatron's rank order:
TP innermost, then CP, EP/DP, PP outermost).
"""

from __future__ import annotations

from dataclasses import dataclass

from toolkit.plan.hardware import Cluster
from toolkit.plan.memory import Layout, Workload, fused_kernels, params_on_stage
from toolkit.plan.model import ModelShape

BASE_EFFICIENCY = {"local": 0.435, "fsdp": 0.45, "deepspeed": 0.45, "megatron": 0.38}
"""Fraction of the bf16 peak reached by large matmuls in training, calibrated on one H200.
``local`` (bf16 parameters, fp32 master weights, fused AdamW): bench/local_sft.py, full SFT of the
1.24B shape with an untied head (1.50B parameters), 4 x 4096 tokens, 43.0k tokens/s (2026-11-30,
measured while the engine still recomputed chunk logits in backward: ``recompute_logits``).
HF modules under FSDP/ZeRO keep the earlier HF-transformers calibration (47.7k tokens/s, same shape,
shared/notes/cpu-stack.md); Megatron-Core 0.19 TP2 with SDPA core attention and no Transformer
Engine 36.2k per GPU."""
LORA_EFFICIENCY = 0.76
"""LoRA on a frozen base reaches a lower share of peak (small adapter GEMMs, the frozen-head
log-prob kernel): calibrated on bench/peft_lora.py, r=16 on every linear of the 1.24B shape,
4 x 4096 tokens, 51.2k tokens/s on one H200 (2026-11-30)."""
LEVERS_SPEEDUP = {"full": 1.32, "lora": 1.37}
"""The ``local`` engine's GPU defaults (``--local-kernels auto`` = Triton RMSNorm/SwiGLU/RoPE and the fused
linear + cross-entropy head) over HF's modules with the chunked head: fitted on bench/speed.py, one H200,
1.24B shape, 4 x 4096 tokens (2026-11-30): full SFT 60.1k tokens/s (untied head), LoRA r=16 70.5k, where
this model without them says 45.6k and 51.3k. Fitted points, not checks."""
OPTIMIZER_BYTES_PER_PARAM = 40.0
"""AdamW step, gradient clipping and zeroing: fp32 param/grad/m/v reads and writes + temporaries."""
MASTER_STEP_BYTES_PER_PARAM = 46.0
"""Local engine with fp32 master weights: fused AdamW (read master, grad, m, v; write master, m, v:
28), clipping (read + scale the fp32 grads: 12) and the bf16 write-back (6)."""
PURE_BF16_STEP_BYTES_PER_PARAM = 20.0
"""Local engine with ``--local-bf16-mode pure``: fused AdamW on bf16 (read param, grad, m, v; write
param, m, v: 14) and clipping (read + scale the bf16 grads: 6); gradients accumulate in place."""
ACCUMULATE_BYTES_PER_PARAM = 6.0
"""Per micro-batch: read the bf16 gradient, write (or add into) the fp32 master gradient."""
HOST_SECONDS_PER_LAYER = {"full": 4.25e-3, "lora": 6.8e-3}
"""Host time to issue one decoder layer's forward and backward (HF modules, eager PyTorch): a step
can never be faster than the CPU can launch it, which is what bounds short micro-batches.
Fitted on one H200 with bench/plan_check.py (2026-11-30, the run in docs/plan.md): a full-SFT
step of the 1.24B shape at 1 x 1024 tokens took 68 ms (16 layers) where its GPU work needs about
42 ms, and a LoRA step at 1 x 4096 tokens 109 ms against about 87 ms of GPU work (each adapter
adds launches). Those two rows are therefore fitted, not checked."""
HOST_BOUND_STRATEGIES = ("local", "fsdp", "deepspeed")
CPU_ADAM_PARAMS_PER_S = 1e9
PCIE_BANDWIDTH = 25e9
EXPOSED_DP = {"megatron": 0.5, "deepspeed": 0.7, "fsdp": 0.7, "local": 1.0}
"""Share of the gradient reduction not hidden behind the backward pass."""


@dataclass
class TimeBreakdown:
    """Seconds per optimizer step, cluster-wide tokens per step, and what dominates."""

    compute: float = 0.0
    tensor_parallel: float = 0.0
    context_parallel: float = 0.0
    expert_parallel: float = 0.0
    pipeline_p2p: float = 0.0
    bubble: float = 0.0
    data_parallel: float = 0.0
    zero_gather: float = 0.0
    optimizer: float = 0.0
    host: float = 0.0
    """Seconds the CPU needs to launch the step; the step takes the longer of this and the GPU work."""
    tokens_per_step: int = 0
    micro_batches: int = 1
    efficiency: float = 0.0

    @property
    def device_total(self) -> float:
        return (self.compute + self.tensor_parallel + self.context_parallel + self.expert_parallel + self.pipeline_p2p
                + self.bubble + self.data_parallel + self.zero_gather + self.optimizer)

    @property
    def total(self) -> float:
        return max(self.device_total, self.host)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_per_step / self.total

    def rows(self) -> list[tuple[str, float]]:
        rows = [("compute", self.compute), ("TP comm", self.tensor_parallel), ("CP comm", self.context_parallel),
                ("EP all-to-all", self.expert_parallel), ("PP send/recv", self.pipeline_p2p),
                ("pipeline bubble", self.bubble), ("DP grad sync", self.data_parallel),
                ("ZeRO-3 gathers", self.zero_gather), ("optimizer step", self.optimizer)]
        if self.host > self.device_total:
            rows.append(("host-bound: CPU launch time", self.host))
        return [(name, value) for name, value in rows if value > 0]


def train_flops_per_token(shape: ModelShape, workload: Workload, recompute: bool) -> tuple[float, float]:
    """(dense, routed-expert) FLOPs of forward and backward (and recompute) for one token.

    Dense covers attention/shared matmuls, the LM head (recomputed in backward with
    ``recompute_logits``) and the attention scores; adapters are counted where LoRA puts them
    (:func:`lora_flops_per_token`). The scores count the useful work, the query-key pairs the causal (and
    sliding-window) masks allow (:meth:`~toolkit.plan.model.ModelShape.attention_pairs`), not the whole square an
    eager or masked-SDPA kernel computes: ``4 x attention_width`` a pair in forward, twice that in backward."""
    pairs_per_token = shape.attention_pairs(workload.seq_len) / workload.seq_len
    attention = (16.0 if recompute else 12.0) * pairs_per_token * shape.attention_width
    if workload.tuner != "full":
        dense, routed = lora_flops_per_token(shape, workload, recompute)
        return dense + attention, routed
    routed = shape.moe_layers * shape.experts_per_token * 3 * shape.hidden * shape.expert_ffn
    matmul = shape.active_matmul_params - routed
    coefficient = 8.0 if recompute else 6.0
    extra = 2.0 * shape.vocab * shape.hidden if workload.recompute_logits and not workload.fused_loss else 0.0
    return coefficient * matmul + extra + attention, coefficient * routed  # extra: the head GEMM again in backward


FIRST_LAYER_INPUTS = ("q_proj", "k_proj", "v_proj", "qkv_proj", "q_a_proj", "kv_a_proj_with_mqa")
"""Linears that read a decoder layer's input: in the first layer it is the frozen embedding's output, which needs no
gradient (without recompute), so under LoRA autograd computes no input gradient through them there."""


def lora_flops_per_token(shape: ModelShape, workload: Workload, recompute: bool) -> tuple[float, float]:
    """(dense, routed-expert) matmul FLOPs of one token's forward and backward with LoRA on every linear (toolkit-peft's
    default ``all-linear``, through PEFT), causal attention scores left out. The base weights are frozen: a plain
    adapted linear ``y = x W^T + s B A x`` computes no gradient for ``W``, only the input's (none in the first layer's
    input projections) and the adapter's. PEFT (>= 0.22) adapts transformers 5's fused experts and the router of
    every MoE family differently: it folds the adapter into the weight once per forward (``W + s * A_e B_e``, a
    batched matmul over experts) and multiplies by the folded weight, which therefore gets a weight gradient (passed
    on to ``A`` and ``B``); that fold, counted per micro-batch, is spread over its tokens. Dense MLPs, shared experts
    and Qwen2-MoE's shared-expert gate are plain adapted linears. Checked against torch's FLOP counter on PEFT models
    in tests/test_plan.py."""
    r, h, passes = workload.lora_rank, shape.hidden, 2 if recompute else 1

    def adapted(i: int, o: int, input_grad: bool = True) -> float:
        return passes * 2 * (i * o + r * (i + o)) + 4 * r * o + 2 * r * i + (2 * i * o + 2 * r * i if input_grad else 0)

    def folded(i: int, o: int) -> float:  # per token: forward, input gradient and weight gradient
        return (2 * passes + 4) * i * o

    mlp_names = ("gate_proj", "up_proj", "down_proj", "gate_up_proj")
    linears = shape.linear_params_per_layer(False)
    attention = sum(adapted(i, o) for name, (i, o) in linears.items() if name not in mlp_names)
    # With recompute, transformers' gradient_checkpointing_enable marks the embedding output as needing a gradient
    # (enable_input_require_grads), so the first layer's inputs get one like every other layer's.
    first_layer = 0 if recompute else sum(adapted(i, o) - adapted(i, o, input_grad=False)
                                          for name, (i, o) in linears.items() if name in FIRST_LAYER_INPUTS)
    dense_mlp = sum(adapted(i, o) for name, (i, o) in linears.items() if name in mlp_names)
    dense = shape.layers * attention - first_layer + shape.dense_layers * dense_mlp + 4 * shape.vocab * h
    if not shape.is_moe:
        return dense, 0.0
    e, f, shared = shape.experts, shape.expert_ffn, shape.shared_expert_ffn
    gate = adapted(h, 1) if shared and shape.shared_expert_gate else 0.0
    router = folded(h, e) + (2 * adapted(h, shared) + adapted(shared, h) if shared else 0.0) + gate
    expert = folded(h, 2 * f) + folded(f, h)
    # Router rank r, experts' gate_up 2r and down r. The experts' fold runs twice per forward: torch's
    # register_parametrization, which PEFT calls on every forward, evaluates it once to check its shape.
    fold = (2 * passes + 4) * r * h * e + (4 * passes + 4) * e * (2 * r * h * 2 * f + r * f * h)
    router += fold / workload.micro_batch_tokens
    return dense + shape.moe_layers * router, shape.moe_layers * shape.experts_per_token * expert


def matmul_efficiency(shape: ModelShape, layout: Layout, workload: Workload, rows: float | None = None) -> float:
    """Share of peak for matmuls with ``rows`` tokens (default: the micro-batch on one CP rank)."""
    tokens = workload.micro_batch_tokens / layout.cp if rows is None else rows
    width = shape.hidden / (layout.tp if layout.strategy == "megatron" else 1)
    efficiency = BASE_EFFICIENCY[layout.strategy] * tokens / (tokens + 512) * width / (width + 128)
    if workload.tuner != "full":
        efficiency *= LORA_EFFICIENCY
    if workload.tuner == "qlora":
        efficiency *= 0.75  # NF4 dequantisation before every base matmul
    if workload.fused_loss and fused_kernels(shape, layout, workload):
        efficiency *= LEVERS_SPEEDUP["full" if workload.tuner == "full" else "lora"]
    return efficiency


def expert_rows(shape: ModelShape, layout: Layout, workload: Workload) -> float:
    """Tokens each local expert multiplies per micro-batch: expert parallelism (Megatron's, or toolkit-moe's under
    ``local``) gathers the tokens routed to a GPU's experts from EP ranks, so its grouped GEMMs get EP times more rows."""
    return workload.micro_batch_tokens / layout.cp * shape.experts_per_token / shape.experts * layout.ep


def ring_time(bytes_: float, group: int, bandwidth: float, all_reduce: bool = True) -> float:
    """Ring collective time: all-reduce moves 2(n-1)/n of the data, gather/scatter (n-1)/n."""
    if group <= 1:
        return 0.0
    factor = 2.0 if all_reduce else 1.0
    return factor * (group - 1) / group * bytes_ / bandwidth


def step_time(shape: ModelShape, layout: Layout, workload: Workload, cluster: Cluster, global_rows: int) -> TimeBreakdown:
    """Seconds for one optimizer step of ``global_rows`` rows on ``layout``."""
    out = TimeBreakdown()
    gpn = cluster.gpus_per_node
    micro_batches = global_rows // (layout.dp * workload.micro_batch_size)
    out.micro_batches = micro_batches
    out.tokens_per_step = global_rows * workload.seq_len
    out.efficiency = matmul_efficiency(shape, layout, workload)
    dense_flops, expert_flops = train_flops_per_token(shape, workload, layout.recompute)
    seconds_per_token = dense_flops / out.efficiency
    if expert_flops:
        seconds_per_token += expert_flops / matmul_efficiency(shape, layout, workload, expert_rows(shape, layout, workload))
    out.compute = out.tokens_per_step * seconds_per_token / (layout.world_size * cluster.gpu.peak_flops)

    tokens_mb = workload.micro_batch_tokens / layout.cp  # tokens one GPU handles per micro-batch
    layers_here = shape.layers / layout.pp
    activation = tokens_mb * shape.hidden * 2.0  # one bf16 hidden state of a micro-batch
    per_mb = 0.0
    if layout.tp > 1:
        units = 12 if layout.recompute else 8  # 2 all-reduces forward, 2 backward (+2 recompute)
        per_layer = units / 2 * ring_time(activation, layout.tp, cluster.bandwidth(layout.tp > gpn))
        per_mb += layers_here * per_layer
        out.tensor_parallel = micro_batches * layers_here * per_layer
    if layout.cp > 1:
        kv = tokens_mb * 2 * shape.kv_dim * 2.0 / layout.tp
        per_layer = 0.5 * 3 * (layout.cp - 1) * kv / cluster.bandwidth(layout.tp * layout.cp > gpn)
        per_mb += layers_here * per_layer
        out.context_parallel = micro_batches * layers_here * per_layer
    if shape.is_moe and layout.ep > 1:
        # dispatch and combine all-to-alls of the routed rows, forward and backward (toolkit-moe's local EP sends the
        # same rows: the per-expert counts it exchanges first are small)
        routed = tokens_mb / layout.tp * shape.experts_per_token * shape.hidden * 2.0
        per_layer = 4 * (layout.ep - 1) / layout.ep * routed / cluster.bandwidth(layout.ep > gpn)
        moe_here = shape.moe_layers / layout.pp
        per_mb += moe_here * per_layer
        out.expert_parallel = micro_batches * moe_here * per_layer
    if layout.pp > 1:
        crosses = cluster.nodes > 1
        send = activation / layout.tp / cluster.bandwidth(crosses)
        out.pipeline_p2p = 2 * micro_batches * layout.vpp * send
        stage_compute = out.compute / micro_batches
        out.bubble = (layout.pp - 1) / layout.vpp * (stage_compute + per_mb)

    dense, expert = params_on_stage(shape, layout, first=True, last=layout.pp == 1)
    if workload.tuner == "full":
        trainable = dense + expert
        grad_bytes = 2.0 if layout.strategy == "deepspeed" else 4.0
    else:
        trainable = shape.lora_params(workload.lora_rank) / layout.pp / (layout.tp if layout.strategy == "megatron" else 1)
        grad_bytes = 4.0
    dp_span = layout.world_size // layout.pp > gpn if layout.strategy == "megatron" else cluster.nodes > 1
    bandwidth = cluster.bandwidth(dp_span)
    reduce_each_micro_batch = layout.strategy == "deepspeed" and layout.zero >= 2
    syncs = micro_batches if reduce_each_micro_batch else 1
    # expert slices reduce over the ranks holding the same slice (expert_dp), the rest over data parallelism
    expert_share = expert if workload.tuner == "full" else 0.0
    reduced = (ring_time((trainable - expert_share) * grad_bytes, layout.dp, bandwidth)
               + ring_time(expert_share * grad_bytes, layout.expert_dp, bandwidth))
    out.data_parallel = EXPOSED_DP[layout.strategy] * syncs * reduced
    if layout.zero >= 3 and workload.tuner == "full":
        gathers = 2 * ring_time(trainable * 2.0, layout.dp, bandwidth, all_reduce=False)
        out.zero_gather = 0.5 * micro_batches * gathers

    sharded = trainable / (layout.dp if layout.zero >= 1 else 1)
    if layout.offload:
        out.optimizer = sharded / CPU_ADAM_PARAMS_PER_S + sharded * 4.0 / PCIE_BANDWIDTH
    elif layout.strategy == "local" and workload.bf16_mode == "pure":
        out.optimizer = sharded * PURE_BF16_STEP_BYTES_PER_PARAM / cluster.gpu.hbm_bandwidth
    elif layout.strategy == "local" and workload.bf16_mode == "master":
        moved = MASTER_STEP_BYTES_PER_PARAM + ACCUMULATE_BYTES_PER_PARAM * micro_batches
        out.optimizer = sharded * moved / cluster.gpu.hbm_bandwidth
    else:
        out.optimizer = sharded * OPTIMIZER_BYTES_PER_PARAM / cluster.gpu.hbm_bandwidth
    if layout.strategy in HOST_BOUND_STRATEGIES:
        per_layer = HOST_SECONDS_PER_LAYER["full" if workload.tuner == "full" else "lora"]
        out.host = micro_batches * layers_here * per_layer
    return out
