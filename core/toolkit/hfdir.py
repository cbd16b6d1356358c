"""HF model directories: the one writer of each part and the checks of what was written.

- :func:`write_safetensors_shards` (safetensors shards + index), :func:`write_model_metadata` (config,
  tokenizer, generation config) and :class:`HFExportConfig`: the ``hf`` exporter's, ``hf-rm``'s (toolkit-dpo)
  and the mcore exporter's HF staging (toolkit-megatron).
- :func:`write_adapter`: PEFT's adapter layout, for ``--adapter-only`` exports, toolkit-peft's
  ``save_adapter`` and the ``vllm`` exporter's LoRA module.
- :func:`write_hf_directory` adds what serving engines read (architectures, both dtype keys, the chat's
  end-of-turn token among the EOS ids); :func:`check_hf_directory` names every file or field an HF loader
  would miss. The engine exporters (``vllm``, ``lmdeploy``) add their engine's checks on top.

Folders are written complete or not at all with :func:`toolkit.writes.staged_directory` (``toolkit export``
does that for every exporter).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Literal

from toolkit.config import option
from toolkit.contracts import ExportModel
from toolkit.errors import ToolkitError

INDEX_FILE = "model.safetensors.index.json"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
DTYPES = ("float32", "bfloat16", "float16")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


class ExportError(ToolkitError):
    """An export cannot be written, or what was written would not load in its target tool."""


def end_of_turn_token(tokenizer: Any) -> str | None:
    """The special token the chat template puts right after an assistant reply (``<|im_end|>``...).

    Found by rendering a two-turn conversation, so it works for any template without a list of
    known model families. ``None`` when the tokenizer has no chat template or no such token.
    """
    if not getattr(tokenizer, "chat_template", None):
        return None
    marker = "ANSWER_MARKER_7f3a"
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}, {"role": "assistant", "content": marker}], tokenize=False)
    except Exception:  # noqa: BLE001 - a template that cannot render has no end-of-turn to find
        return None
    tail = text.split(marker, 1)[-1] if marker in text else ""
    specials = sorted({str(t) for t in getattr(tokenizer, "all_special_tokens", [])}
                      | set(getattr(tokenizer, "get_added_vocab", dict)().keys()), key=len, reverse=True)
    stripped = tail.lstrip()
    for token in specials:
        if token and stripped.startswith(token):
            return token
    return None


def eos_token_ids(config: Any, tokenizer: Any) -> list[int]:
    """Every id that ends generation: the config's, the tokenizer's and the chat's end-of-turn."""
    ids: list[int] = []
    for value in (getattr(config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        for item in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(item, int) and item not in ids:
                ids.append(item)
    token = end_of_turn_token(tokenizer)
    if token is not None:
        token_id = tokenizer.convert_tokens_to_ids(token)
        if isinstance(token_id, int) and token_id not in ids:
            ids.append(token_id)
    return ids


def head_dim(config: dict[str, Any]) -> int | None:
    """Attention head size from a ``config.json`` mapping (``head_dim``, else hidden / heads)."""
    value = config.get("head_dim")
    if isinstance(value, int) and value > 0:
        return value
    hidden, heads = config.get("hidden_size"), config.get("num_attention_heads")
    return hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads else None


def causal_lm_architectures(config: Any) -> list[str]:
    """``config.architectures``, or the causal-LM class transformers maps its model_type to."""
    if getattr(config, "architectures", None):
        return list(config.architectures)
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(getattr(config, "model_type", ""))
    return [name] if name else []


def config_dict(config: Any) -> dict[str, Any]:
    """The config as ``config.json`` will hold it (architectures filled in)."""
    data = config.to_dict()
    data["architectures"] = causal_lm_architectures(config)
    return data


def _fix_metadata(config: Any, tokenizer: Any, directory: Path, dtype: str) -> None:
    """What engines need beyond the hf writer's metadata: architectures, both dtype keys, and
    the chat's end-of-turn token among the EOS ids of config.json and generation_config.json."""
    eos_ids = eos_token_ids(config, tokenizer)
    path = directory / "config.json"
    data = json.loads(path.read_text())
    data["architectures"] = causal_lm_architectures(config) or data.get("architectures")
    # transformers 5 writes "dtype"; older readers (LMDeploy, transformers 4) read "torch_dtype".
    data["dtype"] = data["torch_dtype"] = dtype
    generation_path = directory / "generation_config.json"
    generation = json.loads(generation_path.read_text()) if generation_path.is_file() else {}
    if eos_ids:
        data["eos_token_id"] = generation["eos_token_id"] = eos_ids[0] if len(eos_ids) == 1 else eos_ids
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    generation_path.write_text(json.dumps(generation, indent=2, sort_keys=True) + "\n")


def _has_chat_template(directory: Path) -> bool:
    if (directory / "chat_template.jinja").is_file() or (directory / "chat_template.json").is_file():
        return True
    config = directory / "tokenizer_config.json"
    return config.is_file() and bool(json.loads(config.read_text()).get("chat_template"))


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
    directory = Path(directory)
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
    if getattr(config, "num_nextn_predict_layers", 0):
        # no strategy builds DeepSeek's multi-token-prediction layers (toolkit.models.mtp_notice): the export holds
        # none, and its config says so, so no engine looks for them (vLLM's deepseek_mtp speculative decoding)
        config = copy.deepcopy(config)
        config.num_nextn_predict_layers = 0
    if not quantized and getattr(config, "quantization_config", None) is not None:
        config = copy.deepcopy(config)
        del config.quantization_config
    config.save_pretrained(directory)
    tokenizer = model.source.tokenizer
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = CHATML
    tokenizer.save_pretrained(directory)
    eos = eos_token_ids(config, tokenizer)
    generation = GenerationConfig(eos_token_id=eos if len(eos) > 1 else next(iter(eos), None),
                                  pad_token_id=tokenizer.pad_token_id, bos_token_id=getattr(config, "bos_token_id", None), do_sample=False)
    generation.save_pretrained(directory)


def tied_names(config: Any) -> set[str]:
    return {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()


def write_adapter(directory: Path, config: dict[str, Any], tensors: Any) -> None:
    """PEFT's adapter layout in ``directory``: ``adapter_config.json`` (``config``) and
    ``adapter_model.safetensors`` (the ``(name, tensor)`` pairs), what ``PeftModel.from_pretrained`` and
    vLLM's ``--lora-modules`` read. Names are written as given (PEFT's: ``base_model.model.<module>.lora_A.weight``)."""
    from safetensors.torch import save_file

    state = {name: tensor.detach().cpu().contiguous() for name, tensor in (tensors.items() if isinstance(tensors, dict) else tensors)}
    if not state:
        raise ExportError("the adapter to export has no tensors")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(state, str(directory / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (directory / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True, default=str) + "\n")


def checkpoint_dtype(config: Any) -> str:
    """The dtype name a config declares (``float32`` when it declares none)."""
    value = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    name = str(value).replace("torch.", "") if value is not None else "float32"
    return name if name in DTYPES else "float32"


def write_hf_directory(model: ExportModel, output: Path, *, dtype: str | None = None,
                       max_shard_size_mb: int = 2048) -> Path:
    """Write ``model`` as an HF directory into ``output`` with the core ``hf`` exporter's writer,
    then add what serving engines read (see :func:`_fix_metadata`). ``output`` must be empty;
    ``toolkit export`` hands exporters a fresh staging folder and renames it when done."""
    output = Path(output)
    if output.exists() and any(output.iterdir()):
        raise ExportError(f"output directory {output} is not empty; pass --overwrite or choose another --output")
    output.mkdir(parents=True, exist_ok=True)
    source = model.source
    dtype = dtype or checkpoint_dtype(source.config)
    write_safetensors_shards(model.tensors(), output, max_shard_size_mb * 2**20, dtype, skip=tied_names(source.config))
    config = source.config.__class__.from_dict(source.config.to_dict())  # the writer sets dtype on it
    write_model_metadata(ExportModel(source=_with_config(source, config), tensors=model.tensors), output, dtype)
    _fix_metadata(config, source.tokenizer, output, dtype)
    return output


def _with_config(source: Any, config: Any) -> Any:
    import dataclasses

    return dataclasses.replace(source, config=config)


def read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ExportError(f"{path} is missing") from None
    except json.JSONDecodeError as exc:
        raise ExportError(f"{path} is not valid JSON (line {exc.lineno}): {exc.msg}") from None


def check_hf_directory(directory: Path) -> list[str]:
    """Problems that keep any HF loader from loading ``directory`` as is (empty list: none)."""
    directory = Path(directory)
    problems: list[str] = []
    if not (directory / "config.json").is_file():
        return [f"{directory}/config.json is missing"]
    config = read_json(directory / "config.json")
    if not config.get("architectures"):
        problems.append(f"{directory}/config.json has no 'architectures' entry")
    problems += _check_weights(directory)
    if not any((directory / name).is_file() for name in TOKENIZER_FILES):
        problems.append(f"{directory} has no tokenizer file (one of {', '.join(TOKENIZER_FILES)})")
    if not (directory / "tokenizer_config.json").is_file():
        problems.append(f"{directory}/tokenizer_config.json is missing")
    elif not _has_chat_template(directory):
        problems.append(f"{directory} has no chat template (chat_template.jinja or tokenizer_config.json)")
    generation = directory / "generation_config.json"
    if not generation.is_file():
        problems.append(f"{directory}/generation_config.json is missing (engines read the EOS ids from it)")
    elif read_json(generation).get("eos_token_id") is None:
        problems.append(f"{generation} has no eos_token_id: generation would not stop")
    return problems


def _check_weights(directory: Path) -> list[str]:
    index = directory / INDEX_FILE
    if not index.is_file():
        if (directory / "model.safetensors").is_file():
            return []
        return [f"{directory} has neither model.safetensors nor {INDEX_FILE}"]
    weight_map = read_json(index).get("weight_map") or {}
    problems = [f"{INDEX_FILE} names {file}, which is missing"
                for file in sorted(set(weight_map.values())) if not (directory / file).is_file()]
    if not weight_map:
        problems.append(f"{index} has an empty weight_map")
    return problems
