"""Core built-in plugin: the ``hf`` exporter (sharded safetensors + config + tokenizer + generation config).

Registration only: the writers it uses (shards, metadata, adapters) are :mod:`toolkit.hfdir`'s, shared with
the plugins' exporters.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

from toolkit import hookimpl
from toolkit.contracts import ExportModel
from toolkit.hfdir import (
    HFExportConfig,
    is_quantized_tensor,
    tied_names,
    write_adapter,
    write_model_metadata,
    write_safetensors_shards,
)


class HFExporter:
    """A plain Hugging Face model directory that ``AutoModelForCausalLM.from_pretrained`` loads."""

    name: ClassVar[str] = "hf"
    Config: ClassVar[type] = HFExportConfig

    def __init__(self, config: HFExportConfig | None = None):
        self.config = config or HFExportConfig()

    def export(self, model: ExportModel, output: Path, options: HFExportConfig) -> Path:
        names: set[str] = set()
        quantized = []

        def tensors() -> Iterator[tuple[str, Any]]:
            for name, tensor in model.tensors():
                names.add(name)
                if is_quantized_tensor(tensor):
                    quantized.append(name)
                yield name, tensor

        write_safetensors_shards(tensors(), output, options.max_shard_size_mb * 2**20, options.dtype,
                                 skip=tied_names(model.source.config))
        if "score.weight" in names and "lm_head.weight" not in names:
            from toolkit.errors import ToolkitError
            from toolkit.plugins import install_hint

            raise ToolkitError(f"{model.description} is a reward model (a value head, no LM head): export it with "
                               f"--to hf-rm ({install_hint('toolkit-dpo')}), which writes a sequence-classification model")
        write_model_metadata(model, output, options.dtype, quantized=bool(quantized))
        return output

    def export_adapter(self, model: ExportModel, output: Path, options: HFExportConfig) -> Path:
        config, tensors = model.adapter()
        write_adapter(output, config, tensors)
        model.source.tokenizer.save_pretrained(output)
        return output


@hookimpl
def toolkit_register_exporters(register):
    register(HFExporter)
