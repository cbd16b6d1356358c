"""``--tuner lisa``: Layerwise Importance Sampled AdamW (Pan et al., 2024, arXiv:2403.17919).

Embeddings, the head and the final norm always train; of the decoder layers only ``--lisa-layers``
train at a time, drawn uniformly without replacement and redrawn every ``--lisa-interval`` steps.
Written here because no maintained library does it outside a trainer (LMFlow's is a callback of
its own HF-Trainer fork). The draw of period ``p`` is a pure function of (``--seed``, ``p``), so a
resumed run trains the same layers without saving anything; a layer leaving the sampled set drops
its optimizer state, as the paper's algorithm restarts the optimizer for each period, and that is
where the memory saving comes from (states and gradients only for the sampled layers).
"""

from __future__ import annotations

import dataclasses
import os
import random
import re
from typing import Any, ClassVar

from toolkit.builtins.tuners import FullTuner
from toolkit.config import option

LAYER = re.compile(r"\.layers\.(\d+)\.")


@dataclasses.dataclass(kw_only=True)
class LISAConfig:
    layers: int = option(2, help="Decoder layers that train at a time (the paper's gamma).")
    interval: int = option(20, help="Steps between drawing a new set of layers (the paper's K).")

    def check(self) -> list[str]:
        return [f"lisa {name} must be at least 1, got {getattr(self, name)}"
                for name in ("layers", "interval") if getattr(self, name) < 1]


def layer_of(name: str) -> int | None:
    """Decoder layer index of a parameter name (``model.layers.3.mlp...`` -> 3); None outside the layers."""
    match = LAYER.search(name)
    return int(match.group(1)) if match else None


class LISATuner(FullTuner):
    """Full fine-tuning of embeddings + head + a seeded sample of decoder layers, resampled every K steps."""

    name: ClassVar[str] = "lisa"
    Config: ClassVar[type] = LISAConfig

    def __init__(self, config: Any = None):
        super().__init__(config)
        self.seed, self.num_layers, self.period = 42, 0, None

    def validate(self, recipe: Any, source: Any) -> list[str]:
        self.seed = recipe.seed
        self.num_layers = getattr(source.config, "num_hidden_layers", 0)
        problems = [f"lisa: {p}" for p in self.config.check()]
        if self.config.layers > self.num_layers:
            problems.append(f"--lisa-layers {self.config.layers} exceeds the model's {self.num_layers} decoder layers")
        if recipe.strategy not in ("local", "fsdp"):
            problems.append(f"--tuner lisa changes which layers train every --lisa-interval steps; --strategy {recipe.strategy} "
                            "fixes the trainable set when it shards or wraps the model: use --strategy local (DDP under "
                            "torchrun) or fsdp")
        distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
        if distributed and recipe.strategy == "local" and not recipe.section("local").get("find_unused_parameters", False):
            problems.append("--tuner lisa under torchrun needs --local-find-unused-parameters: DDP must skip the "
                            "layers that are frozen in this period")
        return problems

    def sampled_layers(self, period: int) -> list[int]:
        """The decoder layers that train in ``period`` (steps ``[period * K, (period + 1) * K)``)."""
        draw = random.Random(f"lisa-{self.seed}-{period}")  # str seeds hash with SHA-512: the same in every process
        return sorted(draw.sample(range(self.num_layers), self.config.layers))

    def apply(self, model: Any, source: Any) -> Any:
        # Everything is trainable while the engine builds its optimizer and DDP, so every tensor has a
        # place in both; before_step then freezes what the period does not sample.
        self.num_layers = source.config.num_hidden_layers
        self.period = None
        return super().apply(model, source)

    def before_step(self, model: Any, optimizer: Any, optimized: dict[str, Any], step: int) -> None:
        period = step // self.config.interval
        if period == self.period:
            return
        active = set(self.sampled_layers(period))
        for name, param in model.named_parameters():
            layer = layer_of(name)
            train = layer is None or layer in active
            if not train and name in optimized:
                optimizer.state.pop(optimized[name], None)
            param.requires_grad_(train)
        self.period = period

    def checkpoint_state(self, model: Any) -> dict[str, Any]:
        # every tensor, not only this period's: the frozen layers were trained in earlier periods
        return {name: p.detach() for name, p in model.named_parameters()}

    def load_checkpoint_state(self, model: Any, state: dict[str, Any]) -> None:
        for param in model.parameters():
            param.requires_grad_(True)
        super().load_checkpoint_state(model, state)
        self.period = None  # the next before_step sets the resumed period's layers
