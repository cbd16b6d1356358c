"""Core built-in strategy ``fsdp``: PyTorch FSDP2 (``fully_shard``) per decoder layer, DCP checkpoints."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar, Literal

from toolkit.builtins.strategies import LocalStrategy
from toolkit.config import option
from toolkit.contracts import member
from toolkit.models import autocast_dtype, load_hf_model
from toolkit.train.hf_engine import LocalEngine


@dataclasses.dataclass(kw_only=True)
class FSDPConfig:
    reshard_after_forward: bool = option(True, help="Free gathered parameters after forward (ZeRO-3-like); false keeps them (ZeRO-2-like).")
    cpu_offload: bool = option(False, help="Keep sharded parameters and optimizer state in CPU memory.")
    mixed_precision: bool = option(True, help="With --precision bf16: bf16 compute copies, fp32 sharded master weights and fp32 gradient reduction.")
    packed_attention: Literal["auto", "flex", "sdpa-mask"] = option(
        "auto", help="Rows holding several samples: flex (FlexAttention, block-causal BlockMask), sdpa-mask (dense mask "
        "for HF's sdpa attention) or auto (flex on a CUDA device when it can run, else sdpa-mask); as --local-packed-attention.")


class FSDPEngine(LocalEngine):
    """The local engine's loop on an FSDP2-sharded model: same loss contract, sharded state."""

    def __init__(self, source: Any, tuner: Any, loss: Any, recipe: Any, config: FSDPConfig):
        import torch
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

        from toolkit.train import attention, logps
        from toolkit.train.distributed import init_world
        from toolkit.train.optim import build_optimizer

        self.world = init_world()
        self.dp_rank, self.dp_world_size, self.is_main = self.world.rank, self.world.world_size, self.world.is_main
        self.device = self.world.device
        self.recipe, self.tuner, self.source, self.config = recipe, tuner, source, config
        self.model = load_hf_model(source, tuner, recipe, self.device)
        self.packed_attention = attention.apply_packed_attention(config.packed_attention, self.model, self.device,
                                                                 "--fsdp-packed-attention")
        self.shard_options: dict[str, Any] = {"reshard_after_forward": config.reshard_after_forward}
        if config.cpu_offload:
            self.shard_options["offload_policy"] = CPUOffloadPolicy(pin_memory=self.device.type == "cuda")
        self.use_policy = config.mixed_precision and recipe.precision == "bf16"
        if self.use_policy:
            self.shard_options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        self._ensure_group()
        # a frozen reference (DPO with full/freeze tuning) is copied before the policy is sharded, then sharded too
        self.reference = self._build_reference(loss) if loss.needs_reference else None
        compute_autocast = None if self.use_policy else autocast_dtype(recipe.precision)
        self.module = self._shard(logps.CausalLMLogps(self.model, compute_autocast, self.packed_attention))
        self.optimized = {n: p for n, p in self.model.named_parameters() if p.requires_grad}
        self.params = list(self.optimized.values())
        self.optimizer = build_optimizer(list(self.optimized.items()), recipe, member(tuner, "tuner", "optimizer_factory"))
        self.scheduler = None

    def _shard(self, module: Any) -> Any:
        """``fully_shard`` each decoder layer of ``module.model``, then ``module`` itself (embeddings, norm, head)."""
        from torch.distributed.fsdp import fully_shard

        from toolkit.train.logps import decoder_layers

        for layer in decoder_layers(module.model, "--strategy fsdp: "):
            fully_shard(layer, **self.shard_options)
        fully_shard(module, **self.shard_options)
        return module

    def _build_reference(self, loss: Any) -> Any:
        reference = super()._build_reference(loss)
        if reference is None:
            return None
        if self.use_policy:
            reference.autocast_dtype = None  # the mixed precision policy casts to bf16 instead
        return self._shard(reference)

    def reference_logps(self, micro_batch: dict) -> Any:
        """Reference log-probs; with adapters, the sharded policy itself with its adapters disabled.

        The policy must run through its FSDP root (``self.module``): calling the inner HF model as
        the local engine does would meet still-sharded embeddings and head.
        """
        if self.reference is not None or member(self.tuner, "tuner", "disabled_adapters") is None or getattr(self, "reference_released", False):
            return super().reference_logps(micro_batch)
        import torch

        from toolkit.train.logps import token_logps

        with torch.no_grad(), self.tuner.disabled_adapters(self.model):
            out = token_logps(self.module, micro_batch, self.device)
        return out.sequence_sums().detach()

    def _ensure_group(self) -> None:
        from toolkit.train.distributed import one_process_group

        if one_process_group(self.device):  # FSDP needs a process group even on one process
            self._own_group = True

    def close(self) -> None:
        import torch.distributed as dist

        if getattr(self, "_own_group", False) and dist.is_initialized():
            dist.destroy_process_group()

    def _gradient_sync(self, last: bool) -> Any:
        import contextlib

        self.module.set_requires_gradient_sync(last)
        return contextlib.nullcontext()

    def _trainable_names(self) -> set[str]:
        # what the optimizer was built over, not only what trains now: a tuner that freezes layers during the run
        # (toolkit-optim's lisa) must still save the layers it trained in earlier periods
        return {name for name, p in self.model.named_parameters() if p.requires_grad or name in self.optimized}

    def save_checkpoint(self, directory: Path) -> None:
        import torch
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        trainable = self._trainable_names()
        model_state = {k: v for k, v in model_state.items() if k in trainable}
        dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(directory / "dcp"))
        if self.is_main:
            torch.save(self.scheduler.state_dict() if self.scheduler else {}, directory / "scheduler.pt")

    def load_checkpoint(self, directory: Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

        from toolkit.train.safe_load import check_dcp_metadata, load_tensors_file, named_refusal, weights_only_planner

        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        trainable = self._trainable_names()
        check_dcp_metadata(directory / "dcp")  # its .metadata is a pickle: refuse one that would run code
        # a parameter that had no optimizer state when the checkpoint was written (never stepped yet, or dropped by a
        # tuner that freezes layers during the run, toolkit-optim's lisa) starts without state, as it was
        saved = dcp.FileSystemReader(str(directory / "dcp")).read_metadata().state_dict_metadata
        stepped = [key for key in saved if key.startswith("optimizer.state.")]
        optim_state = {**optim_state, "state": {fqn: entry for fqn, entry in optim_state["state"].items()
                                                 if any(key.startswith(f"optimizer.state.{fqn}.") for key in stepped)}}
        state = {"model": {k: v for k, v in model_state.items() if k in trainable}, "optimizer": optim_state}
        with named_refusal(directory / "dcp"):  # its non-tensor entries are pickles too: read weights-only
            dcp.load(state, checkpoint_id=str(directory / "dcp"), planner=weights_only_planner()())
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                       options=StateDictOptions(strict=False))
        if self.scheduler is not None:
            self.scheduler.load_state_dict(load_tensors_file(directory / "scheduler.pt"))

    def adapter_export(self) -> Any:
        """``ExportModel.adapter`` after training: the adapters of the newest checkpoint, read by rank 0 alone.

        The live adapters are sharded (gathering them would need every rank); the runner saves a
        checkpoint at the last step before it exports, so the newest one holds the final adapters.
        """
        if member(self.tuner, "tuner", "adapter_from_checkpoint") is None:
            return None
        from toolkit.train.checkpoint import list_checkpoints

        run_dir = Path(self.recipe.output)
        return lambda: self.tuner.adapter_from_checkpoint(list_checkpoints(run_dir)[-1], self.source, self.recipe)

    def export_tensors(self) -> Iterator[tuple[str, Any]]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.is_main:
            yield from self.tuner.export_tensors(_FullStateModel(self.model, full))


class _FullStateModel:
    """Presents a gathered full state dict through the module API tuners use for export."""

    def __init__(self, model: Any, state: dict[str, Any]):
        self._model, self._state = model, state

    def state_dict(self) -> dict[str, Any]:
        return self._state

    def named_parameters(self) -> Iterator[tuple[str, Any]]:
        return iter(self._state.items())

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


class FSDPStrategy(LocalStrategy):
    """PyTorch FSDP2: parameters, gradients and optimizer state sharded over the data-parallel ranks."""

    name: ClassVar[str] = "fsdp"
    Config: ClassVar[type] = FSDPConfig

    def __init__(self, config: FSDPConfig | None = None):
        self.config = config or FSDPConfig()

    def build(self, source: Any, tuner: Any, loss: Any, recipe: Any) -> FSDPEngine:
        return FSDPEngine(source, tuner, loss, recipe, self.config)

    def checkpoint_tensors(self, checkpoint: Path, source: Any, tuner: Any, recipe: Any) -> Iterator[tuple[str, Any]]:
        import torch

        from toolkit.train.checkpoint import read_model_state

        model = load_hf_model(source, tuner, recipe, torch.device("cpu"))
        trainable = {name: p for name, p in model.named_parameters() if p.requires_grad}
        tuner.load_checkpoint_state(model, read_model_state(checkpoint, trainable))
        yield from tuner.export_tensors(model)
