"""``--strategy deepspeed``: validation before any memory is allocated, engine construction, checkpoint export."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

from toolkit.contracts import member
from toolkit.errors import ConfigError
from toolkit_deepspeed.config import DeepSpeedOptions, layout_problems, merge_config, read_user_config


def quantized(tuner: Any) -> bool:
    """A tuner that loads the base model quantized (QLoRA's 4-bit weights) through the Tuner protocol."""
    if member(tuner, "tuner", "quantized") is True:
        return True
    try:
        kwargs = tuner.model_load_kwargs()
    except Exception:
        return False
    return "quantization_config" in kwargs or bool(kwargs.get("load_in_4bit") or kwargs.get("load_in_8bit"))


def tuner_problems(recipe: Any, tuner: Any) -> list[str]:
    problems = []
    if recipe.zero == 3 and quantized(tuner):
        problems.append(f"--zero 3 cannot shard --tuner {recipe.tuner}: its base weights are quantized (bitsandbytes 4-bit/8-bit "
                        "blocks with per-block scales), which ZeRO-3 cannot partition or gather. Use --zero 2 (the frozen "
                        "quantized base stays whole on each rank; adapters and optimizer states are partitioned) or --tuner lora")
    if recipe.zero == 3 and member(tuner, "tuner", "zero3_compatible") is False:
        problems.append(f"--tuner {recipe.tuner} declares that it cannot run under ZeRO-3; use --zero 1 or 2")
    return problems


class DeepSpeedStrategy:
    """DeepSpeed ZeRO-1/2/3 data parallelism with optional CPU offload (``--zero N``)."""

    name: ClassVar[str] = "deepspeed"
    Config: ClassVar[type] = DeepSpeedOptions

    def __init__(self, config: DeepSpeedOptions | None = None):
        self.config = config or DeepSpeedOptions()

    def validate(self, recipe: Any, world_size: int) -> list[str]:
        problems = layout_problems(recipe, self.config, world_size)
        if recipe.zero not in (1, 2, 3):
            problems.append(f"--strategy deepspeed needs --zero 1, 2 or 3 (got --zero {recipe.zero}); "
                            "for plain data parallelism use --strategy local")
        try:
            _, conflicts = merge_config(recipe, self.config, world_size, read_user_config(self.config.config))
            problems += conflicts
        except ConfigError as exc:
            problems += exc.problems
        problems += tuner_problems(recipe, self._tuner(recipe))
        return problems

    @staticmethod
    def _tuner(recipe: Any) -> Any:
        from toolkit.plugins import get_plugin_manager
        from toolkit.recipe import thing_options

        cls = get_plugin_manager().get("tuner", recipe.tuner)
        return cls(thing_options(recipe, cls))

    def ds_config(self, recipe: Any, world_size: int) -> dict[str, Any]:
        config, problems = merge_config(recipe, self.config, world_size)
        if problems:
            raise ConfigError(problems, source="--strategy deepspeed")
        return config

    def build(self, source: Any, tuner: Any, loss: Any, recipe: Any) -> Any:
        from toolkit.train.distributed import init_world
        from toolkit_deepspeed.engine import ZeroEngine

        world_size = init_world().world_size
        problems = tuner_problems(recipe, tuner)
        if problems:
            raise ConfigError(problems, source="--strategy deepspeed")
        return ZeroEngine(source, tuner, loss, recipe, self.config, self.ds_config(recipe, world_size))

    def checkpoint_tensors(self, checkpoint: Path, source: Any, tuner: Any, recipe: Any) -> Iterator[tuple[str, Any]]:
        from toolkit_deepspeed.engine import CHECKPOINT_TAG
        from toolkit_deepspeed.export import checkpoint_tensors
        from toolkit_deepspeed.runtime import import_deepspeed

        import_deepspeed()
        yield from checkpoint_tensors(Path(checkpoint), source, tuner, recipe, CHECKPOINT_TAG)
