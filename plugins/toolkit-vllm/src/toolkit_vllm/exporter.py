"""The ``vllm`` exporter: an HF directory vLLM loads as is, plus the LoRA directory
``--enable-lora`` reads, each checked against what vLLM requires before it is called done.

Layout::

    OUTPUT/                   config.json, generation_config.json (all EOS ids), sharded
                              safetensors + index, tokenizer files with the chat template
    OUTPUT/lora/NAME/         adapter_config.json + adapter_model.safetensors (when the run has one;
                              it applies to the base model the run trained from, not to OUTPUT)
    OUTPUT/toolkit_export.json what was written and the vLLM command that serves it
"""

from __future__ import annotations

import importlib.util
import json
import logging
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

from toolkit.config import option
from toolkit.contracts import ExportModel
from toolkit.hfdir import (
    ExportError,
    check_hf_directory,
    checkpoint_dtype,
    config_dict,
    read_json,
    write_hf_directory,
)
from toolkit.parallel import ModelShape, ParallelLayout
from toolkit_vllm.requirements import (
    Findings,
    check_adapter_config,
    check_model_config,
    check_tokenizer_files,
    max_lora_rank_for,
)

log = logging.getLogger(__name__)
MANIFEST = "toolkit_export.json"


def installed_registry() -> frozenset[str] | None:
    """The installed vLLM's architectures, or ``None`` when vLLM is not importable here."""
    if importlib.util.find_spec("vllm") is None:
        return None
    try:
        from vllm import ModelRegistry

        return frozenset(ModelRegistry.get_supported_archs())
    except Exception as exc:  # noqa: BLE001 - a broken vLLM install must not stop an export
        log.warning("could not read vLLM's model registry (%s); using the built-in list", exc)
        return None


def adapter_tensor_name(name: str) -> str:
    """PEFT's on-disk names: ``base_model.model.<module>.lora_A.weight`` (no adapter name)."""
    name = name.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B.")
    return name if name.startswith("base_model.model.") else f"base_model.model.{name}"


def adapter_parts(adapter: Any) -> tuple[dict[str, Any], Any]:
    """``ExportModel.adapter`` as ``(config, iterable of (name, tensor))``: it may be a callable
    returning that pair, or the pair itself with a callable for the tensors."""
    config, tensors = adapter() if callable(adapter) else adapter
    return dict(config), tensors() if callable(tensors) else tensors


def write_lora_adapter(adapter: Any, directory: Path, base_model: str | None = None) -> dict[str, Any]:
    """Write the adapter in PEFT's format (what vLLM's --lora-modules reads) with the core's adapter writer,
    after naming its tensors as vLLM expects and checking they are LoRA A/B weights; returns its config."""
    from toolkit.hfdir import write_adapter

    config, tensors = adapter_parts(adapter)
    config = {"peft_type": "LORA", "bias": "none", **config}
    if base_model:
        config["base_model_name_or_path"] = base_model
    if isinstance(config.get("target_modules"), (set, tuple)):
        config["target_modules"] = sorted(config["target_modules"])
    state = {adapter_tensor_name(name): tensor.detach().cpu().contiguous() for name, tensor in tensors}
    if not state:
        raise ExportError("the adapter to export has no tensors")
    bad = [name for name in state if not (".lora_A." in name or ".lora_B." in name)]
    if bad:
        raise ExportError(f"adapter tensors {bad[:3]} are not LoRA A/B weights: vLLM reads only lora_A/lora_B")
    write_adapter(directory, config, state)
    return config


class VLLMExporter:
    """Export a merged HF directory (and the LoRA adapter, when there is one) for vLLM."""

    name: ClassVar[str] = "vllm"

    @dataclass(kw_only=True)
    class Config:
        dtype: Literal["auto", "float32", "bfloat16", "float16"] = option(
            "auto", help="Weight dtype written; auto keeps the checkpoint's.")
        max_shard_size_mb: int = option(2048, help="Largest safetensors shard in MiB.")
        device: Literal["any", "cpu", "gpu"] = option(
            "any", help="vLLM build the export must run on: cpu makes CPU-only limits (head_dim) errors.")
        adapter_name: str = option("adapter", help="Name the LoRA adapter is served under (--lora-modules NAME=...).")
        check_with_engine: bool = option(True, help="Also check against the installed vLLM's model registry.")
        tp: int = option(1, help="GPUs the export is served on (vLLM tensor parallelism, `toolkit export --tp N`): "
                                 "checked against the model's heads and MLP widths, written into the serve command.")

    def __init__(self, config: Config | None = None):
        self.config = config or self.Config()

    def export(self, model: ExportModel, output: Path, options: Any = None) -> Path:
        """Write ``model`` (merged weights) to ``output``, plus ``lora/NAME`` for its adapter."""
        output = Path(output)
        dtype = checkpoint_dtype(model.source.config) if self.config.dtype == "auto" else self.config.dtype
        registry = installed_registry() if self.config.check_with_engine else None
        before = check_model_config(config_dict(model.source.config), device=self.config.device, dtype=dtype,
                                    registry=registry)
        _raise_if(before, "the model cannot be exported for vLLM")
        layout_problems = ParallelLayout(tensor=self.config.tp).serving_problems(ModelShape.of(model.source.config), "vLLM")
        if layout_problems:
            raise ExportError("the model cannot be served as asked: " + "; ".join(layout_problems))
        adapter = adapter_parts(model.adapter) if model.adapter is not None else None
        if adapter is not None:
            refused = check_adapter_config(adapter[0]).errors
            if refused:
                # The merged weights still serve; only the separate adapter cannot.
                before.warnings.append("the adapter is not written (vLLM would refuse it): " + "; ".join(refused))
                adapter = None
        write_hf_directory(model, output, dtype=dtype, max_shard_size_mb=self.config.max_shard_size_mb)
        manifest: dict[str, Any] = {"exporter": "vllm", "dtype": dtype, "device": self.config.device, "lora_modules": {},
                                    "tensor_parallel_size": self.config.tp}
        if adapter is not None:
            manifest.update(self._write_adapter(model, adapter, output))
        manifest["serve"] = serve_hint(Path(model.destination or output), manifest)  # not the staging folder
        (output / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        after = check_export(output, device=self.config.device, registry=registry)
        for warning in before.warnings + after.warnings:
            log.warning("vllm export: %s", warning)
        _raise_if(after, f"the export in {output} would not load in vLLM")
        return output

    def _write_adapter(self, model: ExportModel, adapter: tuple[dict[str, Any], Any], output: Path) -> dict[str, Any]:
        """Write ``lora/NAME`` and return the manifest entries that describe it."""
        # OUTPUT holds the merged weights; the adapter applies to the base the run trained from.
        base = Path(model.source.directory)
        base_model = str(base.resolve()) if (base / "config.json").is_file() else None
        if base_model is None:
            log.warning("vllm export: the base model of the adapter is not a local directory; "
                        "serve the adapter with --option lora_base=DIR")
        adapter_dir = output / "lora" / self.config.adapter_name
        config = write_lora_adapter(adapter, adapter_dir, base_model)
        ranks = [config.get("r", 0), *(config.get("rank_pattern") or {}).values()]
        return {"lora_modules": {self.config.adapter_name: str(adapter_dir.relative_to(output))},
                "lora_base": base_model, "max_lora_rank": max(max_lora_rank_for(r) or 0 for r in ranks)}

    def export_adapter(self, model: ExportModel, output: Path, options: Any = None) -> Path:
        """``--no-merge-lora`` / ``--adapter-only``: only the adapter, checked for vLLM's LoRA serving."""
        if model.adapter is None:
            raise ExportError(f"{model.description or 'the model'} has no adapter to export")
        adapter = adapter_parts(model.adapter)
        _raise_if(check_adapter_config(adapter[0]), "the adapter would not load in vLLM")
        base = Path(model.source.directory)
        write_lora_adapter(adapter, Path(output), str(base.resolve()) if (base / "config.json").is_file() else None)
        return Path(output)


def serve_hint(output: Path, manifest: dict[str, Any]) -> str:
    """The vLLM command for the merged model, and for base + adapter when there is one."""
    tp = manifest.get("tensor_parallel_size", 1)
    parallel = ["--tensor-parallel-size", str(tp)] if tp > 1 else []
    hint = shlex.join(["vllm", "serve", str(output), "--dtype", manifest["dtype"], *parallel])
    if manifest.get("lora_modules"):
        modules = [f"{name}={output / path}" for name, path in manifest["lora_modules"].items()]
        hint += " ; with the adapter: " + shlex.join(
            ["vllm", "serve", manifest.get("lora_base") or "BASE_MODEL_DIR", "--dtype", manifest["dtype"], *parallel,
             "--enable-lora", "--max-lora-rank", str(manifest["max_lora_rank"]), "--lora-modules", *modules])
    return hint


def check_export(directory: Path, *, device: str = "any", registry: frozenset[str] | None = None) -> Findings:
    """Check a written directory: HF completeness, vLLM's model limits, tokenizer, adapters."""
    directory = Path(directory)
    found = Findings(errors=check_hf_directory(directory))
    if (directory / "config.json").is_file():
        found.extend(check_model_config(read_json(directory / "config.json"), device=device, registry=registry))
    found.extend(check_tokenizer_files(directory))
    lora_root = directory / "lora"
    for adapter_dir in sorted(p for p in lora_root.iterdir() if p.is_dir()) if lora_root.is_dir() else []:
        config_path = adapter_dir / "adapter_config.json"
        if not config_path.is_file():
            found.errors.append(f"{config_path} is missing")
            continue
        adapter = check_adapter_config(read_json(config_path))
        found.errors += [f"{adapter_dir.name}: {e}" for e in adapter.errors]
        if not (adapter_dir / "adapter_model.safetensors").is_file():
            found.errors.append(f"{adapter_dir}/adapter_model.safetensors is missing")
    return found


def _raise_if(found: Findings, head: str) -> None:
    if found.errors:
        raise ExportError(head + ":\n" + "\n".join(f"  - {e}" for e in found.errors))
