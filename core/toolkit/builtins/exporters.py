"""Core built-in plugin: the ``hf`` exporter (sharded safetensors + config + tokenizer + generation config)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar, Literal

from toolkit import hookimpl
from toolkit.config import option
from toolkit.contracts import ExportModel


@dataclasses.dataclass(kw_only=True)
class HFExportConfig:
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = option("auto", help="Weight dtype on disk (auto keeps what training produced).")
    max_shard_size_mb: int = option(2048, help="Largest safetensors shard in MiB; more weight than this is split with an index.")


def write_safetensors_shards(tensors: Any, directory: Path, max_shard_bytes: int, dtype: str = "auto",
                             skip: set[str] | None = None) -> list[str]:
    """Stream ``(name, tensor)`` pairs into shards; write an index when there is more than one."""
    import torch
    from safetensors.torch import save_file

    target_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(dtype)
    shards: list[dict[str, Any]] = [{}]
    sizes = [0]
    paths: list[Path] = []

    def flush() -> None:
        path = directory / f".shard-{len(paths):05d}.safetensors"
        save_file(shards[-1], str(path), metadata={"format": "pt"})
        paths.append(path)

    names: dict[str, int] = {}
    for name, tensor in tensors:
        if skip and name in skip:
            continue
        tensor = tensor.detach().to("cpu")
        if target_dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(target_dtype)
        tensor = tensor.contiguous().clone()
        size = tensor.numel() * tensor.element_size()
        if shards[-1] and sizes[-1] + size > max_shard_bytes:
            flush()
            shards.append({})
            sizes.append(0)
        shards[-1][name] = tensor
        sizes[-1] += size
        names[name] = len(shards) - 1
    flush()
    total = len(paths)
    final = []
    for i, path in enumerate(paths):
        name = "model.safetensors" if total == 1 else f"model-{i + 1:05d}-of-{total:05d}.safetensors"
        path.rename(directory / name)
        final.append(name)
    if total > 1:
        index = {"metadata": {"total_size": sum(sizes)}, "weight_map": {n: final[i] for n, i in sorted(names.items())}}
        (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return final


def is_quantized_tensor(tensor: Any) -> bool:
    """Packed or low-bit storage (bitsandbytes uint8/int8, GPTQ int32, fp8): not a plain weight."""
    return not tensor.is_floating_point() or tensor.dtype.itemsize == 1


def write_model_metadata(model: ExportModel, directory: Path, dtype: str = "auto", quantized: bool = True) -> None:
    """config.json, tokenizer files (with a chat template) and generation_config.json.

    ``quantized=False``: the tensors written are plain floats, so a ``quantization_config`` the source
    carried (training on a quantized export: QLoRA merged by dequantising) is left out of config.json;
    transformers would otherwise read the float weights as packed ones."""
    import copy

    from transformers import GenerationConfig

    from toolkit.data.template import CHATML

    config = model.source.config
    if dtype != "auto":
        config.dtype = dtype
    if not quantized and getattr(config, "quantization_config", None) is not None:
        config = copy.deepcopy(config)
        del config.quantization_config
    config.save_pretrained(directory)
    tokenizer = model.source.tokenizer
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = CHATML
    tokenizer.save_pretrained(directory)
    from toolkit.hfdir import eos_token_ids

    eos = eos_token_ids(config, tokenizer)
    generation = GenerationConfig(eos_token_id=eos if len(eos) > 1 else next(iter(eos), None),
                                  pad_token_id=tokenizer.pad_token_id, bos_token_id=getattr(config, "bos_token_id", None), do_sample=False)
    generation.save_pretrained(directory)


def tied_names(config: Any) -> set[str]:
    return {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()


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
        from safetensors.torch import save_file

        config, tensors = model.adapter()
        (output / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
        save_file({k: v.detach().cpu().contiguous() for k, v in tensors}, str(output / "adapter_model.safetensors"),
                  metadata={"format": "pt"})
        model.source.tokenizer.save_pretrained(output)
        return output


@hookimpl
def toolkit_register_exporters(register):
    register(HFExporter)
