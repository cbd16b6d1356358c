"""The ``hf-rm`` exporter: a reward model as a Hugging Face ``*ForSequenceClassification`` directory.

Use it on runs of the ``rm`` loss (``toolkit rm ... --export hf-rm`` or ``toolkit export RUN --to hf-rm``);
``AutoModelForSequenceClassification.from_pretrained`` loads the result.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any, ClassVar

from toolkit.contracts import ExportModel
from toolkit.errors import ToolkitError
from toolkit.hfdir import HFExportConfig, write_model_metadata, write_safetensors_shards


def classification_config(config: Any, tokenizer: Any) -> Any:
    """A copy of a causal-LM config that names the sequence-classification class, one label, a pad id."""
    config = copy.deepcopy(config)
    architectures = getattr(config, "architectures", None) or []
    if not architectures or "ForCausalLM" not in architectures[0]:
        raise ToolkitError(f"cannot tell the sequence-classification class of architectures {architectures!r}")
    config.architectures = [architectures[0].replace("ForCausalLM", "ForSequenceClassification")]
    config.num_labels = 1
    if getattr(config, "pad_token_id", None) is None:
        config.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return config


class RewardModelExporter:
    """A reward model (value head on the last token) as an HF sequence-classification model."""

    name: ClassVar[str] = "hf-rm"
    Config: ClassVar[type] = HFExportConfig

    def __init__(self, config: Any = None):
        self.config = config or self.Config()

    def export(self, model: ExportModel, output: Path, options: Any) -> Path:
        names: list[str] = []

        def tensors():
            for name, tensor in model.tensors():
                names.append(name)
                yield name, tensor

        write_safetensors_shards(tensors(), output, options.max_shard_size_mb * 2**20, options.dtype)
        if "score.weight" not in names:
            raise ToolkitError(f"{model.description} has no value head ('score.weight'): export a run trained with "
                               "the 'rm' loss, or use --to hf for language models")
        source = dataclasses.replace(model.source, config=classification_config(model.source.config, model.source.tokenizer))
        write_model_metadata(dataclasses.replace(model, source=source), output, options.dtype)
        return output
