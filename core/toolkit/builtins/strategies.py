"""Core built-in plugin: the ``local`` strategy (one process, or DDP under torchrun); its engine is
:class:`toolkit.train.hf_engine.LocalEngine`."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

from toolkit import hookimpl
from toolkit.models import load_hf_model
from toolkit.train.hf_engine import LocalConfig, LocalEngine


class LocalStrategy:
    """One process, or plain PyTorch DDP when launched with torchrun (gloo on CPU, NCCL on GPU)."""

    name: ClassVar[str] = "local"
    Config: ClassVar[type] = LocalConfig

    def __init__(self, config: LocalConfig | None = None):
        self.config = config or LocalConfig()

    def validate(self, recipe: Any, world_size: int) -> list[str]:
        from toolkit.plugins import install_hint

        problems = []
        if recipe.zero:
            problems.append(f"--zero {recipe.zero} needs --strategy deepspeed ({install_hint('toolkit-deepspeed')})")
        if getattr(self.config, "fp8", False) and recipe.tuner not in ("full", "freeze"):
            problems.append(f"--local-fp8 trains the decoder's linear layers in float8: it needs --tuner full or freeze, not {recipe.tuner}")
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
