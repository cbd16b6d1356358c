"""Core built-in plugin: the ``full`` and ``freeze`` tuners."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from typing import Any, ClassVar

from toolkit import hookimpl
from toolkit.config import option


@dataclasses.dataclass(kw_only=True)
class FullConfig:
    """Every parameter trains."""


class FullTuner:
    """Full fine-tuning: every parameter trains; checkpoints hold the whole model."""

    name: ClassVar[str] = "full"
    Config: ClassVar[type] = FullConfig

    def __init__(self, config: Any = None):
        self.config = config or self.Config()

    def validate(self, recipe: Any, source: Any) -> list[str]:
        return []

    def model_load_kwargs(self) -> dict[str, Any]:
        return {}

    def apply(self, model: Any, source: Any) -> Any:
        for param in model.parameters():
            param.requires_grad_(True)
        return model

    def trainable(self, name: str) -> bool:
        return True

    def checkpoint_state(self, model: Any) -> dict[str, Any]:
        return {name: p.detach() for name, p in model.named_parameters() if p.requires_grad}

    def load_checkpoint_state(self, model: Any, state: dict[str, Any]) -> None:
        import torch

        params = dict(model.named_parameters())
        missing = [name for name, p in params.items() if p.requires_grad and name not in state]
        if missing:
            from toolkit.errors import ToolkitError

            raise ToolkitError(f"checkpoint lacks {len(missing)} trainable tensors (first: {missing[0]}); was it written by another tuner?")
        with torch.no_grad():
            for name, tensor in state.items():
                params[name].copy_(tensor)

    def export_tensors(self, model: Any) -> Iterator[tuple[str, Any]]:
        yield from model.state_dict().items()


@dataclasses.dataclass(kw_only=True)
class FreezeConfig:
    trainable_layers: int = option(2, help="Train only the last N decoder layers (plus what --freeze-trainable matches).")
    trainable: str = option("", help="Regex of parameter names that also train (e.g. 'lm_head|embed_tokens').")


class FreezeTuner(FullTuner):
    """Freeze tuning: only the last N decoder layers (and parameters matching a regex) train."""

    name: ClassVar[str] = "freeze"
    Config: ClassVar[type] = FreezeConfig

    def validate(self, recipe: Any, source: Any) -> list[str]:
        layers = getattr(source.config, "num_hidden_layers", 0)
        problems = []
        if self.config.trainable_layers > layers:
            problems.append(f"--freeze-trainable-layers {self.config.trainable_layers} exceeds the model's {layers} layers")
        if self.config.trainable:
            try:
                re.compile(self.config.trainable)
            except re.error as exc:
                problems.append(f"--freeze-trainable {self.config.trainable!r} is not a valid regex: {exc}")
        return problems

    def apply(self, model: Any, source: Any) -> Any:
        layers = source.config.num_hidden_layers
        first = layers - self.config.trainable_layers
        pattern = re.compile(self.config.trainable) if self.config.trainable else None
        for name, param in model.named_parameters():
            match = re.search(r"\.layers\.(\d+)\.", name)
            in_tail = match is not None and int(match.group(1)) >= first
            param.requires_grad_(in_tail or bool(pattern and pattern.search(name)))
        if not any(p.requires_grad for p in model.parameters()):
            from toolkit.errors import ConfigError

            raise ConfigError("--tuner freeze left nothing trainable; raise --freeze-trainable-layers or set --freeze-trainable")
        return model


@hookimpl
def toolkit_register_tuners(register):
    register(FullTuner)
    register(FreezeTuner)
