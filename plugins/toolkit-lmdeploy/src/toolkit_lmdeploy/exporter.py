"""The ``lmdeploy`` exporter: a float16/bfloat16 HF directory LMDeploy's TurboMind or PyTorch
engine loads as is, checked against LMDeploy's documented requirements, with a manifest that
records the engine it runs on and the command that serves it."""

from __future__ import annotations

import json
import logging
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

from toolkit.config import option
from toolkit.contracts import ExportModel
from toolkit.hfdir import ExportError, check_hf_directory, config_dict, read_json, write_hf_directory
from toolkit.parallel import ModelShape, ParallelLayout
from toolkit_lmdeploy.requirements import Findings, check_model_config

log = logging.getLogger(__name__)
MANIFEST = "toolkit_export.json"


class LMDeployExporter:
    """Export a merged HF directory for LMDeploy (``lmdeploy serve api_server DIR``)."""

    name: ClassVar[str] = "lmdeploy"

    @dataclass(kw_only=True)
    class Config:
        dtype: Literal["bfloat16", "float16"] = option("bfloat16", help="Weight dtype (LMDeploy runs 16-bit only).")
        engine: Literal["auto", "turbomind", "pytorch"] = option(
            "auto", help="Engine the export must run on; auto = TurboMind when it supports the model, else PyTorch.")
        max_shard_size_mb: int = option(2048, help="Largest safetensors shard in MiB.")
        tp: int = option(1, help="GPUs the export is served on (LMDeploy tensor parallelism, `toolkit export --tp N`): "
                                 "checked against the model's heads and MLP widths, written into the serve command.")

    def __init__(self, config: Config | None = None):
        self.config = config or self.Config()

    def export(self, model: ExportModel, output: Path, options: Any = None) -> Path:
        output = Path(output)
        before = check_model_config(config_dict(model.source.config), engine=self.config.engine, dtype=self.config.dtype)
        _raise_if(before, "the model cannot be exported for LMDeploy")
        layout_problems = ParallelLayout(tensor=self.config.tp).serving_problems(ModelShape.of(model.source.config), "LMDeploy")
        if layout_problems:
            raise ExportError("the model cannot be served as asked: " + "; ".join(layout_problems))
        write_hf_directory(model, output, dtype=self.config.dtype, max_shard_size_mb=self.config.max_shard_size_mb)
        parallel = ["--tp", str(self.config.tp)] if self.config.tp > 1 else []
        manifest = {"exporter": "lmdeploy", "dtype": self.config.dtype, "engine": before.engine, "tp": self.config.tp,
                    "serve": shlex.join(["lmdeploy", "serve", "api_server", str(model.destination or output), "--backend",
                                         str(before.engine), "--dtype", self.config.dtype, *parallel])}
        (output / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        after = check_export(output, engine=self.config.engine)
        for warning in before.warnings + after.warnings:
            log.warning("lmdeploy export: %s", warning)
        _raise_if(after, f"the export in {output} would not load in LMDeploy")
        return output


def check_export(directory: Path, *, engine: str = "auto") -> Findings:
    """Check a written directory: HF completeness plus LMDeploy's engine requirements."""
    directory = Path(directory)
    problems = check_hf_directory(directory)
    if not (directory / "config.json").is_file():
        return Findings(errors=problems)
    found = check_model_config(read_json(directory / "config.json"), engine=engine)
    found.errors = problems + found.errors
    if not any((directory / f).is_file() for f in ("tokenizer.json", "tokenizer.model")):
        found.errors.append(f"{directory} has neither tokenizer.json nor tokenizer.model, which LMDeploy's tokenizer loads")
    return found


def _raise_if(found: Findings, head: str) -> None:
    if found.errors:
        raise ExportError(head + ":\n" + "\n".join(f"  - {e}" for e in found.errors))
