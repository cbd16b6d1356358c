"""Core built-in plugin: model loaders for local HF directories and the embedded ``tiny-*`` presets
(the machinery is :mod:`toolkit.models`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import ClassVar

from toolkit import hookimpl
from toolkit.contracts import ModelSource
from toolkit.models import PRESETS, load_hf_directory, materialize_preset


@dataclasses.dataclass(kw_only=True)
class NoOptions:
    """This loader has no options."""


class PresetLoader:
    """Embedded tiny models (``tiny-llama``, ``tiny-qwen2``, ...) built from configs, for demos and tests."""

    name: ClassVar[str] = "preset"
    Config: ClassVar[type] = NoOptions

    def __init__(self, config: NoOptions | None = None):
        self.config = config

    def accepts(self, reference: str) -> bool:
        return reference in PRESETS

    def load(self, reference: str, *, trust_remote_code: bool = False) -> ModelSource:
        return load_hf_directory(reference, materialize_preset(reference))


class DirectoryLoader:
    """A local Hugging Face model directory: config.json, safetensors shards, tokenizer files."""

    name: ClassVar[str] = "hf-dir"
    Config: ClassVar[type] = NoOptions

    def __init__(self, config: NoOptions | None = None):
        self.config = config

    def accepts(self, reference: str) -> bool:
        return Path(reference).is_dir()

    def load(self, reference: str, *, trust_remote_code: bool = False) -> ModelSource:
        # absolute: the directory ends up in files (adapter_config.json) read from other directories
        return load_hf_directory(reference, Path(reference).expanduser().resolve(), trust_remote_code)


@hookimpl
def toolkit_register_model_loaders(register):
    register(PresetLoader)
    register(DirectoryLoader)
