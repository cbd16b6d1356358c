"""The engine of HF modules: one process, or plain PyTorch DDP under torchrun (gloo on CPU, NCCL on GPU).

:class:`LocalEngine` is the ``local`` strategy's engine and the base of the engines that place the same
HF model another way (the core's ``fsdp``, toolkit-deepspeed's ZeRO): they override ``__init__`` (how the
model is placed and wrapped), ``_build_reference``, ``_gradient_sync``, checkpoints and exports, and keep
its step, evaluation and reference log-prob logic. :class:`LocalConfig` holds the ``--local-*`` options
(the planner reads them too). The strategy's registration is ``toolkit.builtins.strategies``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar, Literal

from toolkit.config import option
from toolkit.contracts import EngineBase, StepContext, StepResult, member
from toolkit.models import autocast_dtype, load_hf_model
from toolkit.train.numerics import nonfinite_quantities


@dataclasses.dataclass(kw_only=True)
class LocalConfig:
    find_unused_parameters: bool = option(False, help="DDP: tolerate parameters that get no gradient (some MoE models).")
    logps_chunk_tokens: int = option(2048, help="Tokens per chunk when computing label log-probs (bounds logits memory).")
    recompute_logits: bool = option(False, help="Recompute each chunk's logits in backward instead of keeping them in the compute dtype (less memory, slower).")
    bf16_mode: Literal["master", "autocast", "pure"] | None = option(
        None, help="What --precision bf16 keeps in which dtype: master (the default: bf16 parameters, fp32 master weights, "
        "fp32 master gradients and fp32 AdamW states), autocast (fp32 parameters and AdamW states, bf16 compute), pure "
        "(bf16 parameters, gradients and AdamW states, no fp32 copy: 2+2+4 bytes per parameter instead of 2+4+4+8, "
        "as HF transformers with a bf16 model and torch AdamW; updates smaller than bf16's resolution of a weight are lost).")
    master_weights: bool | None = option(
        None, help="Older spelling of --local-bf16-mode: true = master, false = autocast.")
    kernels: Literal["none", "torch", "triton", "liger", "auto"] = option(
        "auto", help="Fused RMSNorm, SwiGLU and RoPE for llama/mistral/qwen2/qwen3 (and the fused loss's softmax): "
        "auto (the default: triton on a CUDA GPU when triton imports, else none; other model families keep HF's "
        "modules), triton (the toolkit's kernels), liger (liger-kernel), torch (reference ops, CPU), none (HF's "
        "modules). Falls back to torch, saying so, where an explicitly chosen backend cannot run.")
    fused_loss: bool | Literal["auto"] = option(
        "auto", help="Losses that give every label log-prob the same gradient (pt, sft): make the output head's input "
        "and weight gradients in forward while each chunk's logits exist (fused linear + cross-entropy), keeping "
        "nothing of vocabulary size for backward. auto (the default): on for a CUDA device, off on CPU; "
        "true/false (--local-fused-loss / --no-local-fused-loss) force it.")
    compile: bool = option(
        False, help="torch.compile each decoder layer (static shapes). The first step compiles; if that fails the run "
        "continues eagerly with a message. Takes the place of --local-kernels inside the layers.")
    attention: Literal["auto", "cudnn", "flash", "efficient"] = option(
        "auto", help="The torch SDPA kernel to try first for HF's sdpa attention: auto (torch's own order), cudnn, "
        "flash or efficient; inputs a kernel cannot take fall through to the next one.")
    packed_attention: Literal["auto", "flex", "sdpa-mask"] = option(
        "auto", help="Rows holding several samples (--packing, or padded rows): flex (FlexAttention with a "
        "block-causal BlockMask built from the sequence ids: the compiled kernel skips masked blocks), sdpa-mask (a "
        "dense [B,1,T,T] boolean mask for HF's sdpa attention: no flash/cuDNN kernel) or auto (flex on a "
        "CUDA device when torch has FlexAttention and the model runs sdpa attention, or eager for Gemma 2's soft cap, "
        "else sdpa-mask). A micro-batch "
        "whose rows each hold one sample (right-padded or not) always takes is_causal SDPA.")
    fp8: bool = option(
        False, help="float8 training of the decoder's linear layers (torchao, dynamic tensorwise scaling; output head "
        "excluded): Hopper/Ada GPUs, full or freeze tuner. Best with --local-compile.")

    def bf16_scheme(self) -> str:
        """``master``, ``autocast`` or ``pure``: ``bf16_mode``, else the older ``master_weights`` flag, else master."""
        if self.bf16_mode is not None:
            return self.bf16_mode
        return "autocast" if self.master_weights is False else "master"

    def check(self) -> list[str]:
        if self.bf16_mode is None or self.master_weights is None:
            return []
        if self.master_weights != (self.bf16_mode == "master"):
            return [f"master_weights {str(self.master_weights).lower()} contradicts bf16_mode {self.bf16_mode!r}: "
                    "set only --local-bf16-mode (master_weights is its older spelling)"]
        return []


class LocalEngine(EngineBase):
    """HF model on one device; DDP over all processes when launched by torchrun."""

    master: Any = None
    """fp32 master weights under ``--precision bf16`` (subclasses with their own mixed precision keep None)."""
    skips_nonfinite_updates: ClassVar[bool] = True
    """``train_step`` can check the reduced loss and gradient norm before the optimizer step (``--on-nan skip``)."""
    skip_nonfinite: bool = False
    """Set by the runner under ``--on-nan skip``: read the step's values before the update (one host read
    either way; before the update the GPU waits for it while the optimizer's kernels are queued)."""
    logps_module: Any = None
    """The unwrapped :class:`~toolkit.train.logps.CausalLMLogps` (``None`` in subclasses: no fused loss there)."""
    fused_loss: bool = False
    attention: str = "auto"
    packed_attention: str = "sdpa-mask"
    """Resolved ``--local-packed-attention``: ``flex`` or ``sdpa-mask`` (what every CausalLMLogps of the engine uses)."""
    kernel_ops: Any = None
    compile_pending: bool = False
    shards: dict[int, Any] = {}
    """``id(optimized tensor) -> toolkit.train.sharded.Shard`` for parameters split over ranks (expert parallelism)."""
    shard_names: dict[str, Any] = {}

    def __init__(self, source: Any, tuner: Any, loss: Any, recipe: Any, config: LocalConfig):
        import torch

        from toolkit.train import attention, logps, speed
        from toolkit.train.distributed import init_world
        from toolkit.train.optim import MasterWeights, build_optimizer, cast_float_parameters
        from toolkit.train.sharded import shard_of, sharded_names

        self.world = init_world()
        self.dp_rank, self.dp_world_size, self.is_main = self.world.rank, self.world.world_size, self.world.is_main
        self.device = self.world.device
        self.recipe, self.tuner, self.source = recipe, tuner, source
        logps.LOGPS_CHUNK_TOKENS = config.logps_chunk_tokens
        logps.RECOMPUTE_LOGITS = config.recompute_logits
        self.model = load_hf_model(source, tuner, recipe, self.device)
        self.kernel_ops, self.compile_pending = speed.apply_speed_options(self.model, config, self.device)
        self.packed_attention = attention.apply_packed_attention(config.packed_attention, self.model, self.device,
                                                                 "--local-packed-attention")
        self.master = None
        compute_autocast = autocast_dtype(recipe.precision)
        self.bf16_scheme = config.bf16_scheme() if recipe.precision == "bf16" else None
        if self.bf16_scheme == "master":
            self.master = MasterWeights([(n, p) for n, p in self.model.named_parameters() if p.requires_grad])
        if self.bf16_scheme in ("master", "pure"):  # pure: AdamW updates the bf16 parameters, its states are bf16 too
            cast_float_parameters(self.model, torch.bfloat16)
            compute_autocast = None
        self.module = self.logps_module = logps.CausalLMLogps(self.model, compute_autocast, self.packed_attention)
        self.fused_loss, self.attention = speed.resolve_fused_loss(config.fused_loss, self.device), config.attention
        if self.is_main:
            speed.report_levers(config, self.kernel_ops, self.fused_loss, loss, self.packed_attention)
        self.shard_names = sharded_names(self.model)
        if self.world.distributed:
            # sharded parameters (experts split over ranks) hold different slices per rank: DDP must not average them
            self.module._ddp_params_and_buffers_to_ignore = list(sharded_names(self.module))
            ids = [self.device.index] if self.device.type == "cuda" else None
            self.module = torch.nn.parallel.DistributedDataParallel(
                self.module, device_ids=ids, find_unused_parameters=config.find_unused_parameters)
        trained = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        self.params = [p for _, p in trained]
        optimized = self.master.master if self.master else self.params
        self.optimized = {name: tensor for (name, _), tensor in zip(trained, optimized)}
        self.shards = {id(t): shard_of(p) for t, p in zip(optimized, self.params) if shard_of(p) is not None}
        self.optimizer = build_optimizer(list(self.optimized.items()), recipe, member(tuner, "tuner", "optimizer_factory"))
        self.scheduler = None
        self.reference = self._build_reference(loss) if loss.needs_reference else None

    def set_total_steps(self, total_steps: int) -> None:
        from toolkit.train.optim import build_scheduler

        self.scheduler = build_scheduler(self.optimizer, self.recipe, total_steps)

    # ------------------------------------------------------------------ reference model
    def _build_reference(self, loss: Any) -> Any:
        import copy

        from toolkit.train.logps import CausalLMLogps

        if member(self.tuner, "tuner", "disabled_adapters") is not None:
            return None  # the policy with adapters disabled is the reference: no second copy
        frozen = copy.deepcopy(self.model).eval().requires_grad_(False)
        return CausalLMLogps(frozen, autocast_dtype(self.recipe.precision), self.packed_attention)

    def release_reference(self) -> None:
        """Free the frozen reference once every example carries precomputed reference log-probs."""
        self.reference = None
        self.reference_released = True

    def reference_logps(self, micro_batch: dict) -> Any:
        """Summed reference log-probs per sequence ``[num_sequences]`` (no gradient)."""
        import torch

        from toolkit.errors import ToolkitError
        from toolkit.train.logps import CausalLMLogps, token_logps

        if getattr(self, "reference_released", False):
            raise ToolkitError("the reference model was freed after --precompute-reference, but a micro-batch "
                               "arrived without precomputed reference_logps")
        with torch.no_grad():
            if self.reference is not None:
                out = token_logps(self.reference, micro_batch, self.device)
            else:
                context = self.tuner.disabled_adapters(self.model) if member(self.tuner, "tuner", "disabled_adapters") else contextlib.nullcontext()
                with context:
                    policy = CausalLMLogps(self.model, autocast_dtype(self.recipe.precision), self.packed_attention)
                    out = token_logps(policy, micro_batch, self.device)
        return out.sequence_sums().detach()

    # ------------------------------------------------------------------ stepping
    def forward_loss(self, micro_batch: dict, loss: Any, ctx: StepContext) -> Any:
        """One micro-batch's training forward, as ``train_step`` runs it (the planner's measurement harness)."""
        return self._forward_loss(micro_batch, loss, ctx)[1]

    def training_state_bytes(self) -> int:
        """Bytes this rank holds between steps: parameters (this rank's shards under FSDP), their gradients, fp32
        master weights and theirs, and optimizer states (the planner's measurement harness)."""
        import torch
        from torch.distributed.tensor import DTensor

        def size(tensor: Any) -> int:
            local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
            return local.numel() * local.element_size()

        tensors = [*self.model.parameters(), *(self.master.master if self.master is not None else [])]
        total = sum(size(t) + (size(t.grad) if t.grad is not None else 0) for t in tensors)
        for state in self.optimizer.state.values():
            total += sum(size(t) for t in state.values() if torch.is_tensor(t) and t.dim())
        return total

    def _forward_loss(self, micro_batch: dict, loss: Any, ctx: StepContext) -> Any:
        from toolkit.train.logps import token_logps
        from toolkit.train.speed import fused_head_ops, sdpa_preference

        if self.logps_module is not None:
            # only a loss that gives every label log-prob the same gradient may take the fused head
            self.logps_module.fused_ops = fused_head_ops(loss, self.kernel_ops) if self.fused_loss else None
        with sdpa_preference(self.attention):
            out = token_logps(self.module, micro_batch, self.device)
        if loss.needs_reference and out.reference_logps is None:
            out.reference_logps = self.reference_logps(micro_batch)
        return out, loss(out, ctx)

    def _gradient_sync(self, last: bool) -> Any:
        """Skip DDP's all-reduce on all but the last micro-batch of a step.

        With fp32 master weights every micro-batch is reduced: its bf16 gradients move into the
        fp32 accumulators right after backward, so nothing may be left for a later all-reduce.
        """
        skip = self.world.distributed and not last and self.master is None
        return self.module.no_sync() if skip else contextlib.nullcontext()

    def _clip_gradients(self) -> Any:
        """Clip to ``--max-grad-norm``; the norm before clipping, as a device tensor (no host read)."""
        import torch

        max_norm = self.recipe.max_grad_norm if self.recipe.max_grad_norm > 0 else float("inf")
        optimized = self.master.master if self.master else self.params
        if self.shards:
            from toolkit.train.sharded import grad_norm, reduce_sharded_grads

            reduce_sharded_grads([(t, self.shards[id(t)]) for t in optimized if id(t) in self.shards], 1.0 / self.dp_world_size)
            norm = grad_norm(optimized, self.shards)
        else:
            norm = torch.nn.utils.get_total_norm([t.grad for t in optimized if t.grad is not None])
        # clip_grads_with_norm_ clamps the factor to 1 on the device: no host read inside the step
        torch.nn.utils.clip_grads_with_norm_(optimized, max_norm, norm)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    def train_step(self, micro_batches: list[dict], loss: Any, ctx: StepContext) -> StepResult:
        if not self.compile_pending:
            return self._train_step(micro_batches, loss, ctx)
        from toolkit.train.kernels.patch import compile_failed_message, uncompile_decoder_layers

        try:
            result = self._train_step(micro_batches, loss, ctx)
        except Exception as exc:  # the first step compiles the layers; a compiler failure must not end the run
            if not type(exc).__module__.startswith(("torch._dynamo", "torch._inductor")):
                raise
            import sys

            print(f"toolkit: {compile_failed_message(exc)}; continuing without compilation", file=sys.stderr)
            uncompile_decoder_layers(self.model)
            self.model.zero_grad(set_to_none=True)
            self.optimizer.zero_grad(set_to_none=True)
            result = self._train_step(micro_batches, loss, ctx)
        self.compile_pending = False
        return result

    def _train_step(self, micro_batches: list[dict], loss: Any, ctx: StepContext) -> StepResult:
        """One optimizer step. Losses and metrics stay on the device; they are read once, after the
        optimizer step is queued, so the GPU never waits for the host inside the step."""
        if member(self.tuner, "tuner", "before_step") is not None:  # a trainable set that changes during the run
            self.tuner.before_step(self.model, self.optimizer, self.optimized, ctx.step)
        self.module.train()
        total: Any = 0.0
        metrics: dict[str, Any] = {}
        share = 1.0 / (len(micro_batches) * self.dp_world_size)  # averages per-forward values over the step
        for index, micro_batch in enumerate(micro_batches):
            with self._gradient_sync(index == len(micro_batches) - 1):
                out, result = self._forward_loss(micro_batch, loss, ctx)
                objective = result.loss
                if out.aux_loss is not None:
                    objective = objective + out.aux_loss * share
                    metrics["aux_loss"] = metrics.get("aux_loss", 0.0) + out.aux_loss.detach() * share
                # DDP/FSDP average gradients over ranks; the loss contract wants their sum.
                (objective * self.dp_world_size).backward()
            if self.master is not None:
                self.master.accumulate_grads()
            total = total + result.loss.detach()
            for key, value in [*result.metrics.items(), *((k, v * share) for k, v in out.aux_metrics.items())]:
                metrics[key] = metrics.get(key, 0.0) + (value.detach() if hasattr(value, "detach") else value)
        grad_norm = self._clip_gradients()
        keys = sorted(metrics)
        from toolkit.train.distributed import read_step_values

        def read() -> list[float]:
            return read_step_values([total, *(metrics[k] for k in keys)], [grad_norm], self.device)

        # The loss is summed over ranks (a NaN on one rank is a NaN on all); the norm is global already.
        values = read() if self.skip_nonfinite else None
        applied = values is None or not nonfinite_quantities(values[0], values[-1])
        if applied:  # a skipped step leaves weights, optimizer state and LR schedule as they were
            self.optimizer.step()
            if self.master is not None:
                self.master.write_back()
            if self.scheduler is not None:
                self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        values = values or read()
        return StepResult(loss=values[0], grad_norm=values[-1], metrics=dict(zip(keys, values[1:-1])), applied=applied)

    def evaluate(self, micro_batches: list[dict], loss: Any, ctx: StepContext) -> dict[str, float]:
        import torch

        self.module.eval()
        total, metrics = 0.0, {}
        with torch.no_grad():
            for micro_batch in micro_batches:
                _, result = self._forward_loss(micro_batch, loss, ctx)
                total += float(result.loss)
                for key, value in result.metrics.items():
                    metrics[key] = metrics.get(key, 0.0) + float(value)
        keys = sorted(metrics)
        reduced = self.all_reduce_sum([total, *(metrics[k] for k in keys)])
        return {"loss": reduced[0], **dict(zip(keys, reduced[1:]))}

    def current_lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, directory: Path) -> None:
        import torch
        from safetensors.torch import save_file

        from toolkit.train.checkpoint import write_model_state
        from toolkit.train.sharded import full_optimizer_state, full_tensors

        if not self.is_main and not self.shard_names:
            return
        # sharded tensors are gathered on the device (every rank takes part), so a checkpoint holds
        # the full model at any layout
        model_state = full_tensors(self.tuner.checkpoint_state(self.model), self.shard_names)
        optimizer_state = full_optimizer_state(self.optimizer, self.shards) if self.shards else self.optimizer.state_dict()
        master_state = None
        if self.master is not None:
            master_state = full_tensors(dict(zip(self.master.names, self.master.master)), self.shard_names)
        if self.is_main:
            def host(state: dict) -> dict:
                return {k: v.detach().contiguous().cpu() for k, v in state.items()}

            write_model_state(directory, model_state, self.tuner.name)
            torch.save(optimizer_state, directory / "optimizer.pt")
            torch.save(self.scheduler.state_dict() if self.scheduler else {}, directory / "scheduler.pt")
            if master_state is not None:
                save_file(host(master_state), str(directory / "master.safetensors"), metadata={"format": "pt"})

    def load_checkpoint(self, directory: Path) -> None:
        from safetensors.torch import load_file

        from toolkit.train.safe_load import load_tensors_file
        from toolkit.train.sharded import local_optimizer_state, local_tensors

        model_state = load_file(str(directory / "model.safetensors"), device=str(self.device))
        self.tuner.load_checkpoint_state(self.model, local_tensors(model_state, self.shard_names))
        if self.master is not None and (directory / "master.safetensors").is_file():
            master_state = load_file(str(directory / "master.safetensors"), device=str(self.device))
            self.master.load_state_dict(local_tensors(master_state, self.shard_names))
        elif self.master is not None:  # saved under --local-bf16-mode autocast or pure: start the masters from the weights
            self.master.copy_from_params()
        optimizer_state = load_tensors_file(directory / "optimizer.pt", map_location=self.device)
        self.optimizer.load_state_dict(local_optimizer_state(self.optimizer, optimizer_state, self.shards))
        if self.scheduler is not None:
            self.scheduler.load_state_dict(load_tensors_file(directory / "scheduler.pt"))

    def export_tensors(self) -> Iterator[tuple[str, Any]]:
        if not self.shard_names:
            if self.is_main:
                yield from self.tuner.export_tensors(self.model)
            return
        for name, tensor in self.tuner.export_tensors(self.model):  # every rank iterates: the gathers are collective
            shard = self.shard_names.get(name)
            tensor = shard.gather(tensor) if shard is not None else tensor
            if self.is_main:
                yield name, tensor

    def all_reduce_sum(self, values: list[float]) -> list[float]:
        from toolkit.train.distributed import all_reduce_sum

        return all_reduce_sum(values, self.device if self.device.type == "cuda" else None)

    def barrier(self) -> None:
        from toolkit.train.distributed import barrier

        barrier()

    def close(self) -> None:
        pass
