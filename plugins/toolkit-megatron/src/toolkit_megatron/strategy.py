"""The ``megatron`` strategy: Megatron-Core GPTModel shards trained with toolkit's losses.

TP / PP (1F1B, interleaved VPP) / SP / CP / DP with Megatron's DDP and (optionally) the
distributed optimizer; bf16 params with fp32 master weights in Megatron's optimizer. Label
log-probs are computed vocabulary-parallel at the last stage (the full-vocabulary logits are
never gathered), gathered over context parallelism, and handed to the core's Loss as
:class:`~toolkit.contracts.TokenLogps`, so every objective works unchanged. For pt/sft on a GPU the
fused output head (``--megatron-fused-loss``) makes them from the final hidden states without logits.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal, NamedTuple

from toolkit.config import option
from toolkit.contracts import EngineBase, StepContext, StepResult
from toolkit.parallel import AXES, ParallelLayout


@dataclass(kw_only=True)
class MegatronConfig:
    attention: Literal["sdpa", "local"] = option("sdpa", help="Core attention: sdpa (torch SDPA, ours) or local (Megatron's unfused).")
    distributed_optimizer: bool = option(False, help="Shard optimizer state over data-parallel ranks (ZeRO-1).")
    async_save: bool = option(False, help="Write checkpoints in the background (dist_checkpointing async save).")
    moe_dispatcher: Literal["alltoall", "allgather"] = option("alltoall", help="MoE token dispatcher: alltoall (tokens sent to their experts' ranks) or allgather (every rank gathers all tokens).")
    moe_experts: Literal["grouped", "sequential"] = option(
        "grouped", help="MoE experts without Transformer Engine: grouped (all local experts in one torch grouped matmul, "
        "same weights and checkpoint keys) or sequential (Megatron's SequentialMLP, a loop over experts).")
    moe_aux_loss_coef: float | None = option(
        None, help="Deprecated: Megatron's own per-layer load-balancing weight; it trains as --router-aux-loss-coef "
        "VALUE * MoE layers / top-k (the run prints that value): give --router-aux-loss-coef instead.")
    moe_z_loss_coef: float | None = option(
        None, help="Deprecated: Megatron's own per-layer z-loss weight; it trains as --router-z-loss-coef "
        "VALUE * MoE layers (the run prints that value): give --router-z-loss-coef instead.")
    logps_kernel: Literal["auto", "chunked", "compiled", "reference"] = option(
        "auto", help="Label log-probs: chunked (fp32 a chunk of tokens at a time, bf16 logits kept), compiled "
                     "(the same under torch.compile), reference (plain autograd over full fp32 logits), auto "
                     "(compiled on a GPU, chunked elsewhere).")
    packed_attention: Literal["auto", "flex", "sdpa-mask"] = option(
        "auto", help="Packed rows (--packing), sliding-window layers and soft-capped attention (Gemma 2): flex "
        "(FlexAttention with a BlockMask made once per micro-batch, soft-capping as its score_mod), sdpa-mask (a dense "
        "[b,1,s,s] mask for torch SDPA: no flash kernel; soft-capping keeps the [b,h,s,s] scores) or auto (flex on a GPU "
        "when torch has FlexAttention, else sdpa-mask). Attention dropout keeps the dense mask, and so do packed rows "
        "under context parallelism without a window.")
    fused_adam: bool = option(True, help="Use torch's fused AdamW kernel (Megatron's fallback without TE/Apex is the foreach one).")
    foreach_clipping: bool = option(True, help="Gradient clipping with torch foreach kernels instead of Megatron's per-tensor fallback loops.")
    compile_elementwise: bool | Literal["auto"] = option(
        "auto", help="torch.compile the elementwise pieces: rotary embeddings and SwiGLU (Megatron's "
                     "bias_activation_fusion, compiled by Megatron itself); auto: on a GPU only.")
    kernels: Literal["none", "torch", "triton", "auto"] = option(
        "auto", help="RMSNorm through the toolkit's fused kernels (toolkit.train.kernels): triton, torch (the "
                     "reference ops), auto (triton on a GPU with Triton, else Megatron-side torch ops), none.")
    overlap_grad_reduce: bool = option(False, help="Overlap the data-parallel gradient reduction with backward (Megatron DDP buckets).")
    fused_loss: bool | Literal["auto"] = option(
        "auto", help="Losses that give every label log-prob the same gradient (pt, sft): the last stage's output layer "
                     "hands over the final hidden states and the label log-probs and the head's input and weight "
                     "gradients are made in forward a chunk of tokens at a time (vocabulary-parallel under TP), so the "
                     "[tokens, V/tp] logits never exist. auto (the default): on a GPU only; true/false "
                     "(--megatron-fused-loss / --no-megatron-fused-loss) force it. Other losses keep the logits path.")

    def check(self) -> list[str]:
        """The deprecated router weights bypass the core's check of ``--router-*`` (they are converted later)."""
        return [f"{name} must be 0 (off) or more, got {value}"
                for name, value in (("moe_aux_loss_coef", self.moe_aux_loss_coef), ("moe_z_loss_coef", self.moe_z_loss_coef))
                if value is not None and not value >= 0]  # NaN too


class SpeedLevers(NamedTuple):
    """The engine's speed options as they resolved for this device and loss."""

    compile_elementwise: bool
    logps_kernel: str
    kernel_ops: Any
    fused_loss: bool
    """The fused output head (:mod:`toolkit_megatron.fused_head`): on, and the loss declares a uniform token gradient."""


def _check_router_flags(recipe: Any, config: MegatronConfig, hf_config: Any, moe: bool) -> None:
    """A router-loss coefficient for a model without a router would be silently ignored: refuse it."""
    from toolkit.errors import ConfigError

    for flag, value in (("--router-aux-loss-coef", recipe.router_aux_loss_coef),
                        ("--router-z-loss-coef", recipe.router_z_loss_coef),
                        ("--megatron-moe-aux-loss-coef", config.moe_aux_loss_coef),
                        ("--megatron-moe-z-loss-coef", config.moe_z_loss_coef)):
        if value and not moe:
            raise ConfigError(f"{flag} {value}: model type {hf_config.model_type!r} has no MoE router; leave the "
                              "flag out", source=flag)


def _packed_flex(choice: str, device: Any) -> bool:
    """``--megatron-packed-attention`` resolved: FlexAttention for packed rows, or the dense mask."""
    from toolkit.errors import ConfigError
    from toolkit.train.attention import flex_backward_refused, flex_missing

    if choice == "sdpa-mask" or (choice == "auto" and device.type != "cuda"):
        return False
    problem = flex_missing() or (f"torch has no FlexAttention backward on {device.type}" if flex_backward_refused(device) else None)
    if problem is None:
        return True
    if choice == "auto":
        return False
    raise ConfigError(f"--megatron-packed-attention flex: {problem}; use sdpa-mask or auto", source="--megatron-packed-attention")


def _speed_levers(config: MegatronConfig, device: Any, loss: Any = None, logit_softcap: float | None = None) -> SpeedLevers:
    """The speed levers with ``auto`` resolved for ``device``: the compiled pieces, the Triton kernels and
    the fused head on a GPU, the eager ops elsewhere (CPU runs unchanged). The fused head also needs a
    ``loss`` that declares a uniform token gradient (pt, sft); forced on for another loss, it is off with
    a note. A model whose logits are soft-capped (``logit_softcap``, Gemma 2/3) has no fused head: ``auto`` is
    off, forcing it is an error. Says on stderr (main rank) which levers are on."""
    import sys

    import torch

    from toolkit.train.kernels import load_ops
    from toolkit.train.speed import declares_uniform_gradient, resolve_fused_loss

    gpu = device.type == "cuda"
    compile_elementwise = gpu if config.compile_elementwise == "auto" else bool(config.compile_elementwise)
    logps_kernel = ("compiled" if gpu else "chunked") if config.logps_kernel == "auto" else config.logps_kernel
    kernel_ops = load_ops(config.kernels, flag="--megatron-kernels")
    fused_loss = resolve_fused_loss(config.fused_loss, device)
    if logit_softcap is not None:
        if config.fused_loss is True:
            from toolkit.errors import ConfigError

            raise ConfigError(f"this model soft-caps its logits (final_logit_softcapping="
                              f"{logit_softcap}) and the fused output head makes none to cap; drop the flag (auto leaves "
                              "it off for such models)", source="--megatron-fused-loss")
        fused_loss = False
    main = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    if fused_loss and not declares_uniform_gradient(loss):
        if config.fused_loss is True and main:
            name = loss.name
            print(f"toolkit: --megatron-fused-loss is off for the {name} loss: it does not give every token the same "
                  "gradient (the logits path serves it)", file=sys.stderr)
        fused_loss = False
    on = [name for name, active in (("compiled elementwise ops", compile_elementwise),
                                    (f"{logps_kernel} log-probs", logps_kernel != "chunked"),
                                    (f"RMSNorm kernels {getattr(kernel_ops, 'name', '')}", kernel_ops is not None),
                                    ("fused output head" + (" (auto)" if config.fused_loss == "auto" else ""), fused_loss))
          if active]
    if on and main:
        print(f"toolkit: megatron speed levers: {', '.join(on)}", file=sys.stderr)
    return SpeedLevers(compile_elementwise, logps_kernel, kernel_ops, fused_loss)


class MegatronStrategy:
    """Megatron-Core tensor/pipeline/sequence/context/data parallel training."""

    name: ClassVar[str] = "megatron"
    Config: ClassVar[type] = MegatronConfig
    parallel_axes: ClassVar[frozenset[str]] = frozenset(AXES)

    def __init__(self, config: MegatronConfig | None = None):
        self.config = config or MegatronConfig()

    def validate(self, recipe: Any, world_size: int) -> list[str]:
        problems = ParallelLayout.from_recipe(recipe).world_problems(world_size)
        if recipe.tuner not in ("full", "lora", "dora"):
            problems.append(f"--tuner {recipe.tuner}: the megatron strategy trains with --tuner full, lora or dora")
        if recipe.precision == "fp16":
            problems.append("--precision fp16: use bf16 or fp32 with the megatron strategy")
        return problems

    def build(self, source: Any, tuner: Any, loss: Any, recipe: Any) -> MegatronEngine:
        import os
        import sys

        import torch

        from toolkit_megatron.notices import fallback_notice

        notice = fallback_notice(torch.cuda.is_available(), recipe.tensor_parallel)
        if notice and os.environ.get("RANK", "0") == "0":
            print(notice, file=sys.stderr)
        return MegatronEngine(source, tuner, loss, recipe, self.config)

    def checkpoint_tensors(self, checkpoint: Path, source: Any, tuner: Any, recipe: Any) -> Iterator[tuple[str, Any]]:
        from toolkit_megatron.checkpoint import mcore_to_hf_tensors

        lora = None
        if tuner is not None and tuner.name != "full":
            from toolkit_megatron.lora import adapter_spec, hf_adapters

            lora = (hf_adapters(source, tuner, recipe), adapter_spec(tuner).dropout)
        yield from mcore_to_hf_tensors(Path(checkpoint) / "mcore", lora=lora)


class MegatronEngine(EngineBase):
    """Model chunks of this rank wrapped in Megatron DDP, with Megatron's optimizer."""

    skips_nonfinite_updates: ClassVar[bool] = True
    """``train_step`` checks the loss and gradient norm between Megatron's norm and its update."""

    def __init__(self, source: Any, tuner: Any, loss: Any, recipe: Any, config: MegatronConfig):
        import torch
        from megatron.core import parallel_state as ps

        from toolkit.train.distributed import init_world
        from toolkit_megatron.architectures import architecture_for
        from toolkit_megatron.bridge import SafetensorsReader, load_hf_weights
        from toolkit_megatron.model import build_model, initialize_parallel

        # a family the bridge does not know, or a config it cannot convert, is refused before anything else
        architecture = architecture_for(source.config.model_type)
        architecture.check(source.config)
        self.moe = architecture.moe
        _check_router_flags(recipe, config, source.config, self.moe)
        self.world = init_world()
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        from toolkit.train.distributed import one_process_group

        one_process_group(self.device)  # one GPU or CPU without torchrun: NCCL on CUDA, gloo on CPU
        self.recipe, self.source, self.config, self.tuner = recipe, source, config, tuner
        self.layout = ParallelLayout.from_recipe(recipe)
        self.layout.check(source.config, torch.distributed.get_world_size(), recipe.seq_len)
        if loss.needs_reference and not recipe.precompute_reference:
            from toolkit.errors import ConfigError

            raise ConfigError(f"--loss {loss.name} needs reference log-probs; under --strategy megatron they are computed "
                              "once before training from the initial policy: add --precompute-reference")
        initialize_parallel(self.layout, recipe.seed)
        self.dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[recipe.precision]
        overrides: dict[str, Any] = {"calculate_per_token_loss": True}
        if self.moe:
            from toolkit_megatron.moe import deprecated_coefficients, router_options

            aux, z = deprecated_coefficients(recipe, config, source.config, self.world.is_main)
            overrides.update(router_options(source.config, aux, z, config.moe_dispatcher))
        if recipe.gradient_checkpointing:
            overrides.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
        compile_elementwise, self.logps_kernel, kernel_ops, fused_loss = _speed_levers(
            config, self.device, loss, architecture.final_logit_softcap(source.config))
        if compile_elementwise:
            overrides["bias_activation_fusion"] = True
        chunks = build_model(source.config, self.layout, dtype=self.dtype, attention=config.attention,
                             compiled_rope=compile_elementwise, kernel_ops=kernel_ops, experts=config.moe_experts,
                             packed_flex=_packed_flex(config.packed_attention, self.device),
                             **overrides)
        load_hf_weights(chunks, source.config, SafetensorsReader.from_directory(source.directory))
        self.lora = tuner is not None and tuner.name != "full"
        if self.lora:
            from toolkit_megatron.lora import adapter_spec, apply_lora, hf_adapters

            apply_lora(chunks, hf_adapters(source, tuner, recipe), adapter_spec(tuner).dropout, source.config,
                       chunks[0].vocab_size)
        if self.moe:
            from toolkit_megatron.moe import mark_expert_parameters, unscaled_router_losses

            unscaled_router_losses(chunks)
            if recipe.expert_tensor_parallel != recipe.tensor_parallel:
                mark_expert_parameters(chunks)
        self.chunks = chunks
        self.fused_head: tuple[list[Any], Any] | None = None
        if fused_loss:
            from toolkit_megatron.fused_head import install_output_switches

            self.fused_head = (install_output_switches(chunks), kernel_ops)
        self.models, self.optimizer = self._wrap(chunks)
        self.dp_rank = ps.get_data_parallel_rank()
        self.dp_world_size = ps.get_data_parallel_world_size()
        self.is_main = torch.distributed.get_rank() == 0
        self.steps_done = 0
        self.total_steps = 1
        self.pending_save = None

    def _wrap(self, chunks: list[Any]) -> tuple[list[Any], Any]:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.transformer.module import Float16Module

        from toolkit_megatron.compat import cpu_compat

        recipe = self.recipe
        tconfig = chunks[0].config
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=self.config.overlap_grad_reduce,
                                                   use_distributed_optimizer=self.config.distributed_optimizer)
        models = []
        with cpu_compat():
            for index, chunk in enumerate(chunks):
                module = Float16Module(tconfig, chunk) if tconfig.bf16 else chunk
                models.append(DistributedDataParallel(config=tconfig, ddp_config=ddp_config, module=module,
                                                      disable_bucketing=index > 0))
            # The schedule would divide gradients by the step's token count; the loss already did.
            tconfig.finalize_model_grads_func = lambda model, *args, **kwargs: finalize_model_grads(model, None)
            if self.config.overlap_grad_reduce:  # reduce once per step: hooks stay off until the last micro-batch
                no_sync, start = [m.no_sync for m in models], [m.start_grad_sync for m in models]
                tconfig.no_sync_func = no_sync[0] if len(models) == 1 else no_sync
                tconfig.grad_sync_func = start[0] if len(models) == 1 else start
            opt_config = OptimizerConfig(optimizer="adam", lr=recipe.lr, weight_decay=recipe.weight_decay,
                                         adam_beta1=recipe.adam_beta1, adam_beta2=recipe.adam_beta2, adam_eps=recipe.adam_eps,
                                         clip_grad=recipe.max_grad_norm, bf16=tconfig.bf16, params_dtype=tconfig.params_dtype,
                                         use_distributed_optimizer=self.config.distributed_optimizer)
            optimizer = get_megatron_optimizer(opt_config, models)
        from toolkit_megatron.optim import foreach_clipping, fuse_adam

        foreach_clipping(self.config.foreach_clipping)
        if self.config.fused_adam:
            fuse_adam(optimizer)
        return models, optimizer

    # ------------------------------------------------------------------ schedule
    def set_total_steps(self, total_steps: int) -> None:
        self.total_steps = total_steps

    def current_lr(self) -> float:
        from toolkit.train.optim import lr_factor

        r = self.recipe
        return r.lr * lr_factor(self.steps_done, self.total_steps, r.warmup_steps, r.schedule, r.min_lr_ratio)

    def _run(self, micro_batches: list[dict], loss: Any, ctx: StepContext, forward_only: bool) -> tuple[float, dict]:
        import torch
        from megatron.core import parallel_state as ps

        from toolkit_megatron.logps import make_loss_func, prepare_micro_batches
        from toolkit_megatron.schedule import run_schedule

        longest = None
        if self.moe:  # one length on every rank: the allgather dispatcher gathers equal token counts
            local = max(mb["input_ids"].shape[1] for mb in micro_batches)
            longest = self.all_reduce_max(local)
        fused = self._fused_head_for(loss, forward_only)
        batches = prepare_micro_batches(micro_batches, self.layout, self.source.config.vocab_size, self.device, longest,
                                        label_positions=fused is not None)
        router = contextlib.nullcontext()
        share = 1.0 / (len(batches) * ps.get_data_parallel_world_size())  # router losses: mean over forwards
        if self.moe:
            from toolkit_megatron.moe import router_loss_scale, with_padding_masks

            batches = with_padding_masks(batches, self.layout)
            router = router_loss_scale(share)
        with router, self._switched(fused):
            collected = run_schedule(self.models, batches, make_loss_func(loss, ctx, self.logps_kernel, fused),
                                     forward_only=forward_only, fp32_logits=self.logps_kernel == "reference" and not fused)
        counted = ps.is_pipeline_last_stage(ignore_virtual=True) and ps.get_tensor_model_parallel_rank() == 0 \
            and ps.get_context_parallel_rank() == 0
        keys = sorted({k for item in collected for k in item}) if counted else []
        names: list[Any] = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(names, keys)
        keys = sorted({k for group in names for k in group})
        values = [sum(float(item.get(k, 0.0)) for item in collected) if counted else 0.0 for k in keys]
        reduced = self.all_reduce_sum(values)
        totals = dict(zip(keys, reduced))
        if self.moe and not forward_only:
            from toolkit_megatron.moe import pop_router_metrics

            tp_cp = ps.get_tensor_model_parallel_world_size() * ps.get_context_parallel_world_size()
            router_metrics = pop_router_metrics(self.chunks[0].config, share, tp_cp)
            names = sorted(router_metrics)
            totals.update(zip(names, self.all_reduce_sum([router_metrics[n] for n in names])))
        return totals.pop("loss", 0.0), totals

    def _fused_head_for(self, loss: Any, forward_only: bool) -> tuple[Any, Any] | None:
        """``(switch, kernel ops)`` when this run's label log-probs go through the fused head: it is on, this
        rank holds the output layer, gradients are wanted and ``loss`` gives every token the same gradient
        (evaluation and the reference pass take the logits path)."""
        import torch

        from toolkit.train.speed import declares_uniform_gradient

        if self.fused_head is None or forward_only or not torch.is_grad_enabled() or not declares_uniform_gradient(loss):
            return None
        switches, ops = self.fused_head
        return (switches[0], ops) if switches else None

    @contextlib.contextmanager
    def _switched(self, fused: tuple[Any, Any] | None) -> Iterator[None]:
        switch = fused[0] if fused is not None else None
        if switch is not None:
            switch.active = True
        try:
            yield
        finally:
            if switch is not None:
                switch.active, switch.weight = False, None

    def train_step(self, micro_batches: list[dict], loss: Any, ctx: StepContext) -> StepResult:
        from toolkit_megatron.compat import cpu_compat

        lr = self.current_lr()
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        for model in self.models:
            model.train()
            model.zero_grad_buffer()
        self.optimizer.zero_grad()
        total, metrics = self._run(micro_batches, loss, ctx, forward_only=False)
        with cpu_compat():
            grad_norm, applied = self._guarded_optimizer_step(total)
        if applied:  # a skipped update leaves the LR schedule where it was too
            self.steps_done += 1
        return StepResult(loss=total, grad_norm=grad_norm, metrics=metrics, applied=applied)

    def _guarded_optimizer_step(self, loss: float) -> tuple[float, bool]:
        """Megatron's ``optimizer.step()`` with a check between the gradient norm and the update:
        a non-finite loss (already reduced over ranks) or norm (reduced over model-parallel ranks)
        leaves weights and optimizer state untouched (``--on-nan skip``)."""

        import torch
        from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

        with torch.no_grad():
            if self.optimizer.prepare_grads():  # fp16 loss scaling found an inf
                return float("inf"), False
            grad_norm = float(self.optimizer.get_grad_norm())
            if not (math.isfinite(loss) and math.isfinite(grad_norm)):
                return grad_norm, False
            for inner in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
                parameters = [] if getattr(inner, "is_stub_optimizer", False) else inner.get_parameters()
                if parameters and inner.config.clip_grad > 0.0:
                    decoupled = getattr(inner.config, "use_precision_aware_optimizer_no_fp8_or_ds_fp8", False)
                    clip_grad_by_total_norm_fp32(parameters, max_norm=inner.config.clip_grad, total_norm=grad_norm,
                                                 use_decoupled_grad=decoupled)
            return grad_norm, bool(self.optimizer.step_with_ready_grads())

    def evaluate(self, micro_batches: list[dict], loss: Any, ctx: StepContext) -> dict[str, float]:
        import torch

        for model in self.models:
            model.eval()
        with torch.no_grad():
            total, metrics = self._run(micro_batches, loss, ctx, forward_only=True)
        return {"loss": total, **metrics}

    def reference_logps(self, micro_batch: dict) -> Any:
        """Summed log-probs per sequence of the policy as it is before the first optimizer step.

        Before training the policy is the reference, so ``--precompute-reference`` needs no second
        model. Computed at the last pipeline stage and shared with every rank.
        """
        import torch

        from toolkit.contracts import LossOutput
        from toolkit.errors import ToolkitError

        if self.steps_done:
            raise ToolkitError("--strategy megatron computes reference log-probs only before training starts "
                               "(--precompute-reference); this engine has already taken optimizer steps")
        captured: list[Any] = []

        class _Capture:
            name, consumes, needs_reference, example_kinds = "reference", "logps", False, ("lm", "preference", "unpaired")

            def __call__(self, out: Any, ctx: Any) -> Any:
                captured.append(out.sequence_sums().detach())
                return LossOutput(loss=out.logps.sum() * 0.0)

        for model in self.models:
            model.eval()
        with torch.no_grad():
            self._run([micro_batch], _Capture(), StepContext(label_tokens=1, sequences=1, examples=1), forward_only=True)
        count = micro_batch["num_sequences"]
        local = captured[0].double().cpu().tolist() if captured else [0.0] * count
        # one last-stage rank per data-parallel replica holds the values; all replicas saw the same batch
        counted = self.all_reduce_sum([1.0 if captured else 0.0])[0]
        return torch.tensor(self.all_reduce_sum(local)) / max(counted, 1.0)

    # ------------------------------------------------------------------ checkpoints / export
    def save_checkpoint(self, directory: Path) -> None:
        from toolkit_megatron.checkpoint import save_mcore

        self.finish_pending_save()
        request = save_mcore(self.models, Path(directory) / "mcore", self.source.config, self.layout,
                             extra={"dtype": str(self.dtype).removeprefix("torch."), "steps_done": self.steps_done},
                             tokenizer_source=self.source.directory, optimizer=self.optimizer,
                             async_save=self.config.async_save)
        self.pending_save = request
        self._save_adapters(Path(directory))
        if self.is_main:
            (Path(directory) / "engine_state.json").write_text(json.dumps({"steps_done": self.steps_done}))
        if request is not None:  # the runner renames the directory right away: finish before that
            self.finish_pending_save()

    def _save_adapters(self, directory: Path) -> None:
        """A LoRA run's adapters also as ``model.safetensors`` under the tuner's names and in its layout (what
        ``checkpoint_state`` gives on the HF model), so the tuner reads them for ``--adapter-only`` exports without
        Megatron; the run resumes from ``mcore/``."""
        if not self.lora:
            return
        from toolkit.train.checkpoint import write_model_state
        from toolkit_megatron.lora import adapter_state

        state = adapter_state(self.chunks)
        if self.is_main:
            write_model_state(directory, state, self.tuner.name)

    def adapter_export(self) -> Any:
        """``ExportModel.adapter`` after training: the tuner's reading of the newest checkpoint's adapters (the runner
        saves one at the last step before it exports), or None without adapters."""
        from toolkit.contracts import member

        if not self.lora or member(self.tuner, "tuner", "adapter_from_checkpoint") is None:
            return None
        from toolkit.train.checkpoint import list_checkpoints

        run_dir = Path(self.recipe.output)
        return lambda: self.tuner.adapter_from_checkpoint(list_checkpoints(run_dir)[-1], self.source, self.recipe)

    def finish_pending_save(self) -> None:
        if self.pending_save is not None:
            from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

            from toolkit_megatron.compat import cpu_compat

            with cpu_compat():
                queue = AsyncCallsQueue()
                queue.schedule_async_request(self.pending_save)
                queue.maybe_finalize_async_calls(blocking=True)
            self.pending_save = None

    def load_checkpoint(self, directory: Path) -> None:
        from toolkit_megatron.checkpoint import check_reload_layout, load_mcore

        check_reload_layout(Path(directory) / "mcore", self.layout)
        self._materialise_optimizer_state()
        load_mcore(self.models, Path(directory) / "mcore", optimizer=self.optimizer)
        self.steps_done = json.loads((Path(directory) / "engine_state.json").read_text())["steps_done"]
        self._restore_adam_steps()
        self.barrier()

    def _restore_adam_steps(self) -> None:
        """Give every Adam state its own step count equal to the steps done.

        megatron-core 0.16's distributed optimizer (without Apex/TE) loads one ``step`` tensor shared
        by every parameter's state, which torch's Adam then increments once per parameter.
        """
        import torch

        for inner in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            for group in inner.optimizer.param_groups:
                for param in group["params"]:
                    state = inner.optimizer.state.get(param, {})
                    if "step" not in state:
                        continue
                    step = state["step"]
                    device = param.device if group.get("fused") else getattr(step, "device", None)  # fused: steps on the device
                    state["step"] = torch.tensor(float(self.steps_done), dtype=step.dtype, device=device) \
                        if isinstance(step, torch.Tensor) else self.steps_done

    def _materialise_optimizer_state(self) -> None:
        """Megatron loads optimizer state only into existing state: take a zero-lr, zero-grad step."""
        from toolkit_megatron.compat import cpu_compat

        for group in self.optimizer.param_groups:
            group["lr"] = 0.0
        for model in self.models:
            model.zero_grad_buffer()
        with cpu_compat():
            self.optimizer.step()

    def export_tensors(self) -> Iterator[tuple[str, Any]]:
        """HF tensors on rank 0 (every rank iterates); LoRA adapters are merged into the base weights."""
        from toolkit_megatron.lora import export_merged

        yield from export_merged(self.chunks, self.source.config)

    def all_reduce_sum(self, values: list[float]) -> list[float]:
        from toolkit.train.distributed import all_reduce_sum

        return all_reduce_sum(values, self.device if self.device.type == "cuda" else None)

    def all_reduce_max(self, value: int) -> int:
        import torch

        tensor = torch.tensor([value], dtype=torch.long, device=self.device)
        torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX)
        return int(tensor.item())

    def barrier(self) -> None:
        import torch

        torch.distributed.barrier()

    def close(self) -> None:
        from toolkit_megatron.checkpoint import stop_checkpoint_workers

        self.finish_pending_save()
        stop_checkpoint_workers()
