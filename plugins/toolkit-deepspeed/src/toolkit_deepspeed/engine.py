"""The DeepSpeed engine: an HF causal LM under ZeRO-1/2/3, stepped with the toolkit's loss contract.

Each micro-batch's loss is a contribution normalised by the step's global counts; DeepSpeed
averages gradients over data-parallel ranks, so the engine multiplies the loss by the DP size
before ``backward`` (and turns off DeepSpeed's own division by the accumulation steps): the
reduced gradient is then the SUM over ranks and micro-batches, as with the ``local`` strategy.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from toolkit.contracts import StepContext, StepResult, member
from toolkit.errors import ToolkitError
from toolkit.train.hf_engine import LocalEngine

CHECKPOINT_TAG = "deepspeed"
LAYOUT_FILE = "deepspeed-layout.json"


class ZeroEngine(LocalEngine):
    """``--strategy deepspeed``: one ``deepspeed.DeepSpeedEngine`` around the toolkit's log-prob module.

    Evaluation, the schedule and collectives are the local engine's, run through ``self.module``
    (the DeepSpeed engine) and ``self.optimizer`` (the AdamW that ZeRO wraps).
    """

    training_state_bytes = None
    """Not measured: ZeRO keeps its fp32 partitions and optimizer states inside DeepSpeed's optimizer, not in the
    tensors the local engine counts (``forward_loss`` is the local engine's, through the DeepSpeed engine)."""

    def __init__(self, source: Any, tuner: Any, loss: Any, recipe: Any, options: Any, ds_config: dict[str, Any]):
        import torch

        from toolkit.models import autocast_dtype, load_hf_model
        from toolkit.train import attention, logps
        from toolkit_deepspeed.runtime import init_distributed

        self.world = init_distributed()
        self.dp_rank, self.dp_world_size, self.is_main = self.world.rank, self.world.world_size, self.world.is_main
        self.recipe, self.tuner, self.source, self.options = recipe, tuner, source, options
        self.zero_stage = recipe.zero
        self.ds_config = ds_config
        import deepspeed
        from deepspeed.accelerator import get_accelerator

        self.device = torch.device(get_accelerator().current_device_name())
        logps.LOGPS_CHUNK_TOKENS = options.logps_chunk_tokens
        self._hf_zero3 = None
        if self.zero_stage == 3 and options.zero_init:
            # While this object lives, transformers builds models already partitioned (zero.Init).
            from transformers.integrations import HfDeepSpeedConfig

            self._hf_zero3 = HfDeepSpeedConfig(ds_config)
        # A zero.Init model is already partitioned where DeepSpeed wants it (the device, or the CPU
        # under parameter offload): ``to(None)`` leaves it there.
        self.load_device = None if self._hf_zero3 is not None else self.device
        self.model = load_hf_model(source, tuner, recipe, self.load_device)
        # before the reference is copied or built, so it runs the same attention
        self.packed_attention = attention.apply_packed_attention(options.packed_attention, self.model, self.device,
                                                                 "--deepspeed-packed-attention")
        self.reference = self._build_reference(loss) if loss.needs_reference else None
        # DeepSpeed's bf16 mode holds bf16 weights with fp32 masters; no autocast on top of it.
        precision = "fp32" if recipe.precision == "bf16" else recipe.precision
        wrapped = logps.CausalLMLogps(self.model, autocast_dtype(precision), self.packed_attention)
        self.params = [p for p in wrapped.parameters() if p.requires_grad]
        if not self.params:
            raise ToolkitError(f"--tuner {tuner.name} left no trainable parameter; DeepSpeed has nothing to optimise")
        # ZeRO wraps this optimizer but keeps its param-group dicts: the schedule set on it reaches the real step.
        self.optimizer = self._build_optimizer()
        self.ds, *_ = deepspeed.initialize(model=wrapped, optimizer=self.optimizer, model_parameters=self.params, config=ds_config)
        self.module = self.ds
        self.scheduler = None

    # ------------------------------------------------------------------ construction
    def _build_optimizer(self) -> Any:
        from toolkit.train.optim import build_optimizer

        factory = member(self.tuner, "tuner", "optimizer_factory")
        if factory is not None:
            return build_optimizer([(str(i), p) for i, p in enumerate(self.params)], self.recipe, factory)
        offloaded = self.ds_config.get("zero_optimization", {}).get("offload_optimizer", {}).get("device") == "cpu"
        # torch AdamW on offloaded fp32 states is several times slower than DeepSpeed's CPU Adam.
        return adamw(self.params, self.recipe, cpu_adam=offloaded and self.device.type != "cpu")

    def _build_reference(self, loss: Any) -> Any:
        """A frozen copy of the policy for losses that need reference log-probs (DPO family)."""
        import copy

        import deepspeed

        from toolkit.models import load_hf_model
        from toolkit.train.logps import CausalLMLogps

        if member(self.tuner, "tuner", "disabled_adapters") is not None:
            return None  # the policy with its adapters disabled is the reference
        if self.zero_stage != 3:
            return CausalLMLogps(copy.deepcopy(self.model).eval().requires_grad_(False), packed_attention=self.packed_attention)
        frozen = load_hf_model(self.source, _FrozenTuner(), self.recipe, self.load_device).eval().requires_grad_(False)
        if self.packed_attention == "flex":
            from toolkit.train.attention import use_flex

            use_flex(frozen)
        config = {key: value for key, value in self.ds_config.items() if key not in ("gradient_clipping",)}
        config["zero_optimization"] = {k: v for k, v in self.ds_config["zero_optimization"].items() if k != "offload_optimizer"}
        engine, *_ = deepspeed.initialize(model=CausalLMLogps(frozen, packed_attention=self.packed_attention), config=config)
        engine.eval()
        return engine

    # ------------------------------------------------------------------ stepping
    def reference_logps(self, micro_batch: dict) -> Any:
        """Summed reference log-probs per sequence ``[num_sequences]`` (no gradient)."""
        import torch

        from toolkit.train.logps import token_logps

        with torch.no_grad():
            if self.reference is not None:
                out = token_logps(self.reference, micro_batch, self.device)
            else:
                with self.tuner.disabled_adapters(self.model):
                    out = token_logps(self.ds, micro_batch, self.device)
        return out.sequence_sums().detach()

    def train_step(self, micro_batches: list[dict], loss: Any, ctx: StepContext) -> StepResult:
        self.ds.train()
        total, metrics = 0.0, {}
        share = 1.0 / (len(micro_batches) * self.dp_world_size)  # averages per-forward values over the step
        for index, micro_batch in enumerate(micro_batches):
            # The runner decides how many micro-batches make a step; DeepSpeed follows it.
            self.ds.set_gradient_accumulation_boundary(index == len(micro_batches) - 1)
            out, result = self._forward_loss(micro_batch, loss, ctx)
            objective = result.loss
            if out.aux_loss is not None:
                objective = objective + out.aux_loss * share
                metrics["aux_loss"] = metrics.get("aux_loss", 0.0) + float(out.aux_loss.detach()) * share
            # DeepSpeed averages gradients over ranks (and would divide by the accumulation steps):
            # the loss contract wants their sum.
            self.ds.backward(objective * self.dp_world_size, scale_wrt_gas=False)
            total += float(result.loss.detach())
            for key, value in [*result.metrics.items(), *((k, v * share) for k, v in out.aux_metrics.items())]:
                metrics[key] = metrics.get(key, 0.0) + float(value)
        self.ds.step()  # reduces what is left, clips to --max-grad-norm, steps AdamW, zeroes gradients
        if self.scheduler is not None:
            self.scheduler.step()
        grad_norm = self.ds.get_global_grad_norm()
        keys = sorted(metrics)
        reduced = self.all_reduce_sum([total, *(metrics[k] for k in keys)])
        return StepResult(loss=reduced[0], grad_norm=float(grad_norm) if grad_norm is not None else float("nan"),
                          metrics=dict(zip(keys, reduced[1:])))

    # ------------------------------------------------------------------ checkpoints
    def _frozen_excluded(self) -> bool:
        return any(not p.requires_grad for p in self.model.parameters())

    def save_checkpoint(self, directory: Path) -> None:
        """DeepSpeed's own checkpoint (every rank writes its shards) plus the LR schedule."""
        client = {"scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
                  "tuner": self.tuner.name, "zero_stage": self.zero_stage}
        # Frozen weights come back from the base model at resume; only trained ones are stored.
        self.ds.save_checkpoint(str(directory), tag=CHECKPOINT_TAG, client_state=client,
                                exclude_frozen_parameters=self._frozen_excluded())
        if self._frozen_excluded():
            self._save_tuner_state(Path(directory))
        if self.is_main:
            layout = {"zero_stage": self.zero_stage, "world_size": self.dp_world_size, "tuner": self.tuner.name}
            (Path(directory) / LAYOUT_FILE).write_text(json.dumps(layout) + "\n")

    def _save_tuner_state(self, directory: Path) -> None:
        """The tuner's own (small) trained state as ``model.safetensors``, the file adapter-only exports read."""
        import deepspeed
        from safetensors.torch import save_file

        trainable = [p for p in self.model.parameters() if p.requires_grad]
        gather = deepspeed.zero.GatheredParameters(trainable) if self.zero_stage == 3 else contextlib.nullcontext()
        with gather:
            if self.is_main:
                state = {k: v.detach().cpu().contiguous().clone() for k, v in self.tuner.checkpoint_state(self.model).items()}
                save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt", "tuner": self.tuner.name})

    def load_checkpoint(self, directory: Path) -> None:
        check_checkpoint(Path(directory), self.dp_world_size, self.zero_stage)
        check_pickles(Path(directory) / CHECKPOINT_TAG)
        path, client = self.ds.load_checkpoint(str(directory), tag=CHECKPOINT_TAG, load_optimizer_states=True,
                                               load_lr_scheduler_states=False, load_module_strict=not self._frozen_excluded())
        if path is None:
            raise ToolkitError(f"DeepSpeed could not load the checkpoint in {directory}")
        if self.scheduler is not None and client.get("scheduler") is not None:
            self.scheduler.load_state_dict(client["scheduler"])

    def export_tensors(self) -> Iterator[tuple[str, Any]]:
        """HF-named full tensors on the main rank. Collective under ZeRO-3: every rank iterates."""
        from toolkit_deepspeed.export import gathered_tensors

        if self.zero_stage < 3:
            if self.is_main:
                yield from self.tuner.export_tensors(self.model)
            return
        yield from gathered_tensors(self.model, self.tuner, self.is_main)

    def close(self) -> None:
        """Remove DeepSpeed's hooks so another engine can be built in this process."""
        for engine in (self.ds, self.reference):
            destroy = getattr(engine, "destroy", None)
            if callable(destroy):
                with contextlib.suppress(Exception):
                    destroy()
        self._hf_zero3 = None


def check_checkpoint(directory: Path, world_size: int, zero_stage: int) -> None:
    """Refuse, with what to do, a checkpoint this engine cannot resume from (before DeepSpeed reads it)."""
    shards = directory / CHECKPOINT_TAG
    if not shards.is_dir():
        raise ToolkitError(f"{directory} holds no DeepSpeed checkpoint ({CHECKPOINT_TAG}/ missing); "
                           "was it written by another --strategy? Resume with the strategy that wrote it.")
    layout = json.loads((directory / LAYOUT_FILE).read_text()) if (directory / LAYOUT_FILE).is_file() else {}
    if layout.get("zero_stage", zero_stage) != zero_stage:
        raise ToolkitError(f"{directory} was written with --zero {layout['zero_stage']} and this run has --zero {zero_stage}; "
                           f"resume with --zero {layout['zero_stage']}, or export the checkpoint and start a new run from it")
    written = layout.get("world_size") or len(list(shards.glob("*_optim_states.pt")))
    if written and written != world_size:
        raise ToolkitError(f"{directory} was written by {written} data-parallel ranks and this run has {world_size}; "
                           f"DeepSpeed resumes ZeRO partitions on the same number of ranks: launch with --nproc {written}, "
                           "or export the checkpoint (toolkit export RUN_DIR --to hf --output DIR) and start a new run "
                           "with --model DIR")


def check_pickles(shards: Path) -> None:
    """Refuse DeepSpeed files that would run code: DeepSpeed reads them with ``torch.load(weights_only=False)``
    (resume and zero_to_fp32 alike). Each is loaded first weights-only and memory-mapped (only its pickle is
    read), admitting the few DeepSpeed classes its checkpoints hold (loss scaler, ZeRO stage, fragment
    addresses: plain records); anything else is a one-line refusal naming the file."""
    import torch
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    from toolkit.train.safe_load import load_tensors_file

    with torch.serialization.safe_globals([LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]):
        for path in sorted(shards.rglob("*.pt")):
            load_tensors_file(path, map_location="cpu", mmap=True)


class _FrozenTuner:
    """Loads the base model unchanged (the ZeRO-3 reference model)."""

    name = "frozen"

    def model_load_kwargs(self) -> dict[str, Any]:
        return {}

    def apply(self, model: Any, source: Any) -> Any:
        return model


def adamw(params: list[Any], recipe: Any, cpu_adam: bool = False) -> Any:
    """AdamW with the toolkit's groups: weight decay on matrices, none on vectors.

    Under ``zero.Init`` a parameter is an empty partition, so its rank is read from ``ds_shape``
    (grouping by ``p.ndim`` would silently turn weight decay off for every ZeRO-3 parameter).
    """
    import torch

    def rank(p: Any) -> int:
        return len(getattr(p, "ds_shape", p.shape))

    groups = [{"params": [p for p in params if rank(p) >= 2], "weight_decay": recipe.weight_decay},
              {"params": [p for p in params if rank(p) < 2], "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    betas = (recipe.adam_beta1, recipe.adam_beta2)
    if cpu_adam:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(groups, lr=recipe.lr, betas=betas, eps=recipe.adam_eps, adamw_mode=True)
    return torch.optim.AdamW(groups, lr=recipe.lr, betas=betas, eps=recipe.adam_eps)
