"""Core built-in plugin: the ``local`` strategy (one process, or DDP under torchrun)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

from toolkit import hookimpl
from toolkit.config import option
from toolkit.contracts import StepContext, StepResult
from toolkit.train.numerics import nonfinite_quantities


@dataclasses.dataclass(kw_only=True)
class LocalConfig:
    find_unused_parameters: bool = option(False, help="DDP: tolerate parameters that get no gradient (some MoE models).")
    logps_chunk_tokens: int = option(2048, help="Tokens per chunk when computing label log-probs (bounds logits memory).")
    recompute_logits: bool = option(False, help="Recompute each chunk's logits in backward instead of keeping them in the compute dtype (less memory, slower).")
    master_weights: bool = option(True, help="--precision bf16: bf16 parameters with fp32 master weights (false: fp32 parameters under bf16 autocast).")


def wants_scores(recipe: Any) -> bool:
    """Whether the recipe's loss consumes per-sequence scores (reward modeling) instead of label log-probs."""
    from toolkit.plugins import get_plugin_manager

    return getattr(get_plugin_manager().get("loss", recipe.loss), "consumes", "logps") == "scores"


def load_hf_model(source: Any, tuner: Any, recipe: Any, device: Any) -> Any:
    """The HF causal LM in fp32 master weights, with the tuner applied, on ``device``.

    For a loss that consumes scores it is the ``*ForSequenceClassification`` model with one label
    (the value head starts from the seeded initialisation; the LM head is dropped).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    torch.manual_seed(recipe.seed)
    kwargs = {"dtype": torch.float32, **tuner.model_load_kwargs()}
    if wants_scores(recipe):
        pad = source.tokenizer.pad_token_id if source.tokenizer.pad_token_id is not None else source.tokenizer.eos_token_id
        model = AutoModelForSequenceClassification.from_pretrained(
            source.directory, trust_remote_code=source.trust_remote_code, num_labels=1, pad_token_id=pad, **kwargs)
    else:
        model = AutoModelForCausalLM.from_pretrained(source.directory, trust_remote_code=source.trust_remote_code, **kwargs)
    if "quantization_config" not in kwargs:
        model.to(device)
    if recipe.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    from toolkit.plugins import get_plugin_manager

    get_plugin_manager().patch_model(model, source, recipe)
    torch.manual_seed(recipe.seed)
    return tuner.apply(model, source)


def autocast_dtype(precision: str) -> Any:
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)


class LocalEngine:
    """HF model on one device; DDP over all processes when launched by torchrun."""

    master: Any = None
    """fp32 master weights under ``--precision bf16`` (subclasses with their own mixed precision keep None)."""
    skips_nonfinite_updates: ClassVar[bool] = True
    """``train_step`` checks the reduced loss and gradient norm before the optimizer step (``--on-nan skip``)."""

    def __init__(self, source: Any, tuner: Any, loss: Any, recipe: Any, config: LocalConfig):
        import torch

        from toolkit.train import logps
        from toolkit.train.distributed import init_world
        from toolkit.train.optim import MasterWeights, build_optimizer, cast_float_parameters

        self.world = init_world()
        self.dp_rank, self.dp_world_size, self.is_main = self.world.rank, self.world.world_size, self.world.is_main
        self.device = self.world.device
        self.recipe, self.tuner, self.source = recipe, tuner, source
        logps.LOGPS_CHUNK_TOKENS = config.logps_chunk_tokens
        logps.RECOMPUTE_LOGITS = config.recompute_logits
        self.model = load_hf_model(source, tuner, recipe, self.device)
        self.master = None
        compute_autocast = autocast_dtype(recipe.precision)
        if recipe.precision == "bf16" and config.master_weights:
            self.master = MasterWeights([(n, p) for n, p in self.model.named_parameters() if p.requires_grad])
            cast_float_parameters(self.model, torch.bfloat16)
            compute_autocast = None
        self.module = logps.CausalLMLogps(self.model, compute_autocast)
        if self.world.distributed:
            ids = [self.device.index] if self.device.type == "cuda" else None
            self.module = torch.nn.parallel.DistributedDataParallel(
                self.module, device_ids=ids, find_unused_parameters=config.find_unused_parameters)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        optimized = self.master.master if self.master else self.params
        self.optimizer = build_optimizer(optimized, recipe, getattr(tuner, "optimizer_factory", None))
        self.scheduler = None
        self.reference = self._build_reference(loss) if getattr(loss, "needs_reference", False) else None

    def set_total_steps(self, total_steps: int) -> None:
        from toolkit.train.optim import build_scheduler

        self.scheduler = build_scheduler(self.optimizer, self.recipe, total_steps)

    # ------------------------------------------------------------------ reference model
    def _build_reference(self, loss: Any) -> Any:
        import copy

        from toolkit.train.logps import CausalLMLogps

        if hasattr(self.tuner, "disabled_adapters"):
            return None  # the policy with adapters disabled is the reference: no second copy
        frozen = copy.deepcopy(self.model).eval().requires_grad_(False)
        return CausalLMLogps(frozen, autocast_dtype(self.recipe.precision))

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
                context = self.tuner.disabled_adapters(self.model) if hasattr(self.tuner, "disabled_adapters") else contextlib.nullcontext()
                with context:
                    out = token_logps(CausalLMLogps(self.model, autocast_dtype(self.recipe.precision)), micro_batch, self.device)
        return out.sequence_sums().detach()

    # ------------------------------------------------------------------ stepping
    def _forward_loss(self, micro_batch: dict, loss: Any, ctx: StepContext) -> Any:
        from toolkit.train.logps import token_logps

        out = token_logps(self.module, micro_batch, self.device)
        if getattr(loss, "needs_reference", False) and out.reference_logps is None:
            out.reference_logps = self.reference_logps(micro_batch)
        return out, loss(out, ctx)

    def _gradient_sync(self, last: bool) -> Any:
        """Skip DDP's all-reduce on all but the last micro-batch of a step.

        With fp32 master weights every micro-batch is reduced: its bf16 gradients move into the
        fp32 accumulators right after backward, so nothing may be left for a later all-reduce.
        """
        skip = self.world.distributed and not last and self.master is None
        return self.module.no_sync() if skip else contextlib.nullcontext()

    def _clip_gradients(self) -> float:
        import torch

        max_norm = self.recipe.max_grad_norm if self.recipe.max_grad_norm > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(self.master.master if self.master else self.params, max_norm)
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)

    def train_step(self, micro_batches: list[dict], loss: Any, ctx: StepContext) -> StepResult:
        self.module.train()
        total, metrics = 0.0, {}
        share = 1.0 / (len(micro_batches) * self.dp_world_size)  # averages per-forward values over the step
        for index, micro_batch in enumerate(micro_batches):
            with self._gradient_sync(index == len(micro_batches) - 1):
                out, result = self._forward_loss(micro_batch, loss, ctx)
                objective = result.loss
                if out.aux_loss is not None:
                    objective = objective + out.aux_loss * share
                    metrics["aux_loss"] = metrics.get("aux_loss", 0.0) + float(out.aux_loss.detach()) * share
                # DDP/FSDP average gradients over ranks; the loss contract wants their sum.
                (objective * self.dp_world_size).backward()
            if self.master is not None:
                self.master.accumulate_grads()
            total += float(result.loss.detach())
            for key, value in [*result.metrics.items(), *((k, v * share) for k, v in out.aux_metrics.items())]:
                metrics[key] = metrics.get(key, 0.0) + float(value)
        # The loss is reduced before the update, so a NaN on any rank stops every rank's update;
        # the gradient norm is global already (DDP/FSDP reduced the gradients).
        keys = sorted(metrics)
        reduced = self.all_reduce_sum([total, *(metrics[k] for k in keys)])
        grad_norm = self._clip_gradients()
        applied = not nonfinite_quantities(reduced[0], grad_norm)
        if applied:  # a non-finite step leaves weights, optimizer state and LR schedule as they were
            self.optimizer.step()
            if self.master is not None:
                self.master.write_back()
            if self.scheduler is not None:
                self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return StepResult(loss=reduced[0], grad_norm=grad_norm, metrics=dict(zip(keys, reduced[1:])), applied=applied)

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

        if self.is_main:
            state = {k: v.detach().contiguous().cpu() for k, v in self.tuner.checkpoint_state(self.model).items()}
            save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt", "tuner": self.tuner.name})
            torch.save(self.optimizer.state_dict(), directory / "optimizer.pt")
            torch.save(self.scheduler.state_dict() if self.scheduler else {}, directory / "scheduler.pt")
            if self.master is not None:
                save_file(self.master.state_dict(), str(directory / "master.safetensors"), metadata={"format": "pt"})

    def load_checkpoint(self, directory: Path) -> None:
        import torch
        from safetensors.torch import load_file

        self.tuner.load_checkpoint_state(self.model, load_file(str(directory / "model.safetensors"), device=str(self.device)))
        if self.master is not None and (directory / "master.safetensors").is_file():
            self.master.load_state_dict(load_file(str(directory / "master.safetensors"), device=str(self.device)))
        self.optimizer.load_state_dict(torch.load(directory / "optimizer.pt", map_location=self.device, weights_only=True))
        if self.scheduler is not None:
            self.scheduler.load_state_dict(torch.load(directory / "scheduler.pt", weights_only=True))

    def export_tensors(self) -> Iterator[tuple[str, Any]]:
        if self.is_main:
            yield from self.tuner.export_tensors(self.model)

    def all_reduce_sum(self, values: list[float]) -> list[float]:
        from toolkit.train.distributed import all_reduce_sum

        return all_reduce_sum(values, self.device if self.device.type == "cuda" else None)

    def barrier(self) -> None:
        from toolkit.train.distributed import barrier

        barrier()

    def close(self) -> None:
        pass


class LocalStrategy:
    """One process, or plain PyTorch DDP when launched with torchrun (gloo on CPU, NCCL on GPU)."""

    name: ClassVar[str] = "local"
    Config: ClassVar[type] = LocalConfig

    def __init__(self, config: LocalConfig | None = None):
        self.config = config or LocalConfig()

    def validate(self, recipe: Any, world_size: int) -> list[str]:
        problems = []
        for flag, value in (("--tp", recipe.tensor_parallel), ("--pp", recipe.pipeline_parallel), ("--cp", recipe.context_parallel),
                            ("--ep", recipe.expert_parallel), ("--vpp", recipe.virtual_pipeline)):
            if value != 1:
                problems.append(f"{flag} {value} needs --strategy megatron (pip install toolkit-megatron); the local strategy is data-parallel only")
        if recipe.zero:
            problems.append(f"--zero {recipe.zero} needs --strategy deepspeed (pip install toolkit-deepspeed)")
        if recipe.sequence_parallel:
            problems.append("--sequence-parallel needs --strategy megatron with --tp > 1")
        return problems

    def build(self, source: Any, tuner: Any, loss: Any, recipe: Any) -> LocalEngine:
        return LocalEngine(source, tuner, loss, recipe, self.config)

    def checkpoint_tensors(self, checkpoint: Path, source: Any, tuner: Any, recipe: Any) -> Iterator[tuple[str, Any]]:
        import torch
        from safetensors.torch import load_file

        model = load_hf_model(source, tuner, recipe, torch.device("cpu"))
        tuner.load_checkpoint_state(model, load_file(str(checkpoint / "model.safetensors")))
        yield from tuner.export_tensors(model)


@hookimpl
def toolkit_register_strategies(register):
    from toolkit.builtins.fsdp import FSDPStrategy

    register(LocalStrategy)
    register(FSDPStrategy)
