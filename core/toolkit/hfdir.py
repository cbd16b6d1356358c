"""Write and check Hugging Face model directories: sharded safetensors with an index, config,
generation config with the chat's end-of-turn ids, tokenizer files with the chat template.

Shared by every exporter whose artefact is an HF directory (``hf``, ``vllm``, ``lmdeploy``):
the engine-specific exporters call :func:`write_hf_directory` and add their own checks on top
of :func:`check_hf_directory`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from toolkit.errors import ToolkitError

if TYPE_CHECKING:
    import torch

    from toolkit.contracts import ExportModel

INDEX_FILE = "model.safetensors.index.json"
DTYPES = ("float32", "bfloat16", "float16")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMG]i?B?|B)?\s*$", re.IGNORECASE)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


class ExportError(ToolkitError):
    """An export cannot be written, or what was written would not load in its target tool."""


def parse_size(text: str | int) -> int:
    """``"2GB"`` / ``"500MiB"`` / ``1000`` -> bytes."""
    if isinstance(text, int):
        return text
    match = _SIZE.match(str(text))
    if not match:
        raise ExportError(f"cannot read the size {text!r}: write it like 2GB, 500MB or 1000000")
    number, unit = float(match.group(1)), (match.group(2) or "B").upper()
    scale = {"B": 1, "K": 1e3, "KB": 1e3, "M": 1e6, "MB": 1e6, "G": 1e9, "GB": 1e9,
             "KI": 2**10, "KIB": 2**10, "MI": 2**20, "MIB": 2**20, "GI": 2**30, "GIB": 2**30}[unit]
    return int(number * scale)


def _torch_dtype(name: str) -> torch.dtype:
    import torch

    if name not in DTYPES:
        raise ExportError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPES)}")
    return getattr(torch, name)


def write_safetensors_shards(tensors: Iterable[tuple[str, torch.Tensor]], directory: Path, *,
                             max_shard_bytes: int, dtype: str | None = None,
                             skip: Iterable[str] = ()) -> dict[str, str]:
    """Stream ``(name, tensor)`` into ``model-0000i-of-0000n.safetensors`` plus the index.

    Floating tensors are cast to ``dtype`` when given. Returns the weight map (name -> file).
    """
    from safetensors.torch import save_file

    target = _torch_dtype(dtype) if dtype else None
    skipped = set(skip)
    shards: list[dict[str, Any]] = []
    current: dict[str, Any] = {}
    current_bytes = total = 0
    for name, tensor in tensors:
        if name in skipped:
            continue
        if any(name in shard for shard in shards) or name in current:
            raise ExportError(f"tensor {name!r} appears twice in the exported state")
        tensor = tensor.detach().cpu()
        if target is not None and tensor.is_floating_point():
            tensor = tensor.to(target)
        tensor = tensor.contiguous()
        size = tensor.numel() * tensor.element_size()
        if current and current_bytes + size > max_shard_bytes:
            shards.append(current)
            current, current_bytes = {}, 0
        current[name] = tensor
        current_bytes += size
        total += size
        if current_bytes >= max_shard_bytes:
            shards.append(current)
            current, current_bytes = {}, 0
    if current or not shards:
        shards.append(current)
    if not any(shards):
        raise ExportError("the model to export has no tensors")
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards, start=1):
        filename = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(directory / filename), metadata={"format": "pt"})
        weight_map.update({name: filename for name in shard})
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return weight_map


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


def _write_config(config: Any, directory: Path, dtype: str, eos_ids: list[int]) -> None:
    config = config.__class__.from_dict(config.to_dict())  # never mutate the caller's config
    config.save_pretrained(str(directory))
    path = directory / "config.json"
    data = json.loads(path.read_text())
    data["architectures"] = causal_lm_architectures(config) or data.get("architectures")
    # transformers 5 writes "dtype", older readers (LMDeploy, transformers 4) read "torch_dtype".
    data["dtype"] = data["torch_dtype"] = dtype
    if eos_ids:
        data["eos_token_id"] = eos_ids[0] if len(eos_ids) == 1 else eos_ids
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _write_generation_config(config: Any, tokenizer: Any, directory: Path, eos_ids: list[int]) -> None:
    data: dict[str, Any] = {"_from_model_config": False}
    bos = getattr(config, "bos_token_id", None)
    if bos is None:
        bos = getattr(tokenizer, "bos_token_id", None)
    if bos is not None:
        data["bos_token_id"] = bos
    if eos_ids:
        data["eos_token_id"] = eos_ids[0] if len(eos_ids) == 1 else eos_ids
    pad = getattr(tokenizer, "pad_token_id", None)
    if pad is None:
        pad = getattr(config, "pad_token_id", None)
    if pad is not None:
        data["pad_token_id"] = pad
    (directory / "generation_config.json").write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _write_tokenizer(tokenizer: Any, directory: Path) -> None:
    tokenizer.save_pretrained(str(directory))
    template = getattr(tokenizer, "chat_template", None)
    if template and isinstance(template, str) and not _has_chat_template(directory):
        # Older transformers keep the template only inside tokenizer_config.json; make it a file.
        (directory / "chat_template.jinja").write_text(template)


def _has_chat_template(directory: Path) -> bool:
    if (directory / "chat_template.jinja").is_file() or (directory / "chat_template.json").is_file():
        return True
    config = directory / "tokenizer_config.json"
    return config.is_file() and bool(json.loads(config.read_text()).get("chat_template"))


def checkpoint_dtype(config: Any) -> str:
    """The dtype name a config declares (``float32`` when it declares none)."""
    value = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    name = str(value).replace("torch.", "") if value is not None else "float32"
    return name if name in DTYPES else "float32"


def write_hf_directory(model: ExportModel, output: Path, *, dtype: str | None = None,
                       max_shard_size: str | int = "5GB", overwrite: bool = False) -> Path:
    """Write ``model`` as an HF directory at ``output`` (atomic: a temp dir renamed at the end)."""
    output = Path(output)
    if output.exists() and any(output.iterdir()) and not overwrite:
        raise ExportError(f"output directory {output} exists and is not empty; pass --overwrite or choose another")
    source = model.source
    dtype = dtype or checkpoint_dtype(source.config)
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{output.name}.", dir=output.parent))
    try:
        tied = bool(getattr(source.config, "tie_word_embeddings", False))
        eos_ids = eos_token_ids(source.config, source.tokenizer)
        write_safetensors_shards(model.tensors(), staging, max_shard_bytes=parse_size(max_shard_size), dtype=dtype,
                                 skip=["lm_head.weight"] if tied else [])
        _write_config(source.config, staging, dtype, eos_ids)
        _write_generation_config(source.config, source.tokenizer, staging, eos_ids)
        _write_tokenizer(source.tokenizer, staging)
        if output.exists():
            shutil.rmtree(output)
        os.replace(staging, output)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return output


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


def iter_directory_tensors(directory: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of an HF directory's safetensors files, one file open at a time."""
    from safetensors import safe_open

    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise ExportError(f"{directory} has no .safetensors files")
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, handle.get_tensor(name)
