"""The ``lmdeploy`` inference backend: batch generation through ``lmdeploy.pipeline`` and the
OpenAI-compatible ``lmdeploy serve api_server``. LMDeploy needs a CUDA (or Ascend) device."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

from toolkit.config import option
from toolkit.errors import ToolkitError
from toolkit.hfdir import read_json
from toolkit.inference import GenerationOptions, format_prompt
from toolkit.serving import ServerCommand, engine_flags, option_value, serve_forever, split_extra
from toolkit_lmdeploy.requirements import check_model_config

INSTALL_HINT = ("LMDeploy is not installed{where}. It runs on CUDA GPUs: pip install lmdeploy "
                "(serve can also use another environment's LMDeploy: --option python=/path/to/bin/python "
                "or TOOLKIT_LMDEPLOY_PYTHON). There is no CPU engine: on a CPU-only machine use --backend vllm or hf.")


class EngineMissingError(ToolkitError):
    """LMDeploy is not importable where the backend needs it."""


class LMDeployBackend:
    """Generate or serve with LMDeploy's TurboMind or PyTorch engine."""

    name: ClassVar[str] = "lmdeploy"

    @dataclass(kw_only=True)
    class Config(GenerationOptions):
        python: str = option(os.environ.get("TOOLKIT_LMDEPLOY_PYTHON", ""),
                             help="Interpreter of the environment with LMDeploy (default: $TOOLKIT_LMDEPLOY_PYTHON, else this one).")
        engine: Literal["auto", "turbomind", "pytorch"] = option(
            "auto", help="auto = the export's engine, else TurboMind when it supports the model, else PyTorch.")
        dtype: Literal["auto", "float16", "bfloat16"] = option("auto", help="Compute dtype (auto = the checkpoint's).")
        tp: int = option(1, help="GPUs per model (tensor parallelism).")
        session_len: int | None = option(None, help="Longest session in tokens; default: the model's.")
        cache_max_entry_count: float = option(0.8, help="Share of free GPU memory for the KV cache.")
        model_name: str = option("", help="Model name the server answers to (default: the path).")
        adapters: str = option("", help="LoRA adapters NAME=DIR[,NAME=DIR] (PyTorch engine only).")
        startup_timeout_s: float = option(900.0, help="How long serve waits for the server to answer.")

    def __init__(self, config: Config | None = None):
        self.config = config or self.Config()

    def engine(self, model_dir: Path) -> str:
        """The engine to run ``model_dir`` on (``auto`` resolved from the manifest or the checks)."""
        if self.config.engine != "auto":
            return self.config.engine
        manifest = Path(model_dir) / "toolkit_export.json"
        if manifest.is_file() and read_json(manifest).get("engine") in ("turbomind", "pytorch"):
            return read_json(manifest)["engine"]
        found = check_model_config(read_json(Path(model_dir) / "config.json"), dtype="bfloat16")
        if found.errors:
            raise ToolkitError(f"{model_dir} cannot run on LMDeploy:\n" + "\n".join(f"  - {e}" for e in found.errors))
        return found.engine or "pytorch"

    def _adapters(self) -> dict[str, str]:
        """``adapters=NAME=DIR,NAME=DIR`` as ``{NAME: DIR}``, read by the core's one KEY=VALUE parser."""
        from toolkit.config import parse_pairs

        try:
            return parse_pairs([p for p in self.config.adapters.split(",") if p.strip()],
                               "adapters=sft=./run/export/lora/adapter")
        except ValueError as exc:
            raise ToolkitError(f"lmdeploy adapters option: {exc}") from None

    def _require_engine(self) -> None:
        if self.config.python:
            try:
                probe = subprocess.run([self.config.python, "-c", "import lmdeploy"], capture_output=True, text=True)
            except OSError as exc:
                raise EngineMissingError(INSTALL_HINT.format(where=f" for {self.config.python} ({exc.strerror})")) from None
            if probe.returncode != 0:
                raise EngineMissingError(INSTALL_HINT.format(where=f" for {self.config.python}"))
        elif importlib.util.find_spec("lmdeploy") is None:
            raise EngineMissingError(INSTALL_HINT.format(where=f" in {sys.executable}"))

    # ------------------------------------------------------------------ generate

    def generate(self, model_dir: Path, prompts: list[str], options: Any = None) -> list[str]:
        """Completions through ``lmdeploy.pipeline`` in this interpreter (greedy unless
        ``options.temperature`` > 0); the ``python`` option applies to ``serve`` only."""
        if importlib.util.find_spec("lmdeploy") is None:
            raise EngineMissingError(INSTALL_HINT.format(where=f" in {sys.executable}, where generation runs"))
        from lmdeploy import GenerationConfig, PytorchEngineConfig, TurbomindEngineConfig, pipeline

        engine = self.engine(model_dir)
        common: dict[str, Any] = {"tp": self.config.tp, "dtype": self.config.dtype,
                                  "cache_max_entry_count": self.config.cache_max_entry_count}
        if self.config.session_len:
            common["session_len"] = self.config.session_len
        if engine == "turbomind":
            backend_config: Any = TurbomindEngineConfig(**common)
        else:
            adapters = self._adapters()
            backend_config = PytorchEngineConfig(**common, adapters=adapters or None)
        options = self.config if options is None else options
        temperature = float(option_value(options, "temperature", 0.0))
        gen = GenerationConfig(max_new_tokens=int(option_value(options, "max_new_tokens", 64)),
                               do_sample=temperature > 0, temperature=temperature or 1.0,
                               top_p=float(option_value(options, "top_p", 1.0)) if temperature else 1.0,
                               top_k=int(option_value(options, "top_k", 0)) if temperature else 1)
        # The prompt text is built like the hf backend's (the model's own chat template), so LMDeploy's
        # name-matched built-in templates never change what the model sees.
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        inputs = [format_prompt(tokenizer, p, bool(option_value(options, "chat_template", True)),
                                str(option_value(options, "system", ""))) for p in prompts]
        pipe = pipeline(str(model_dir), backend_config=backend_config)
        try:
            responses = pipe(inputs, gen_config=gen, do_preprocess=False)
        finally:
            close = getattr(pipe, "close", None)
            if callable(close):
                close()
        return [response.text for response in responses]

    # ------------------------------------------------------------------ serve

    def serve_command(self, model_dir: Path, host: str, port: int, extra: dict[str, str] | None = None) -> ServerCommand:
        """``lmdeploy serve api_server`` with the engine, dtype and parallelism this model needs."""
        config, passthrough = split_extra(self.config, extra)
        backend = LMDeployBackend(config)
        engine = backend.engine(model_dir)
        argv = [config.python or sys.executable, "-m", "lmdeploy", "serve", "api_server", str(model_dir),
                "--server-name", host, "--server-port", str(port), "--backend", engine, "--dtype", config.dtype,
                "--tp", str(config.tp), "--cache-max-entry-count", str(config.cache_max_entry_count)]
        if config.session_len:
            argv += ["--session-len", str(config.session_len)]
        if config.model_name:
            argv += ["--model-name", config.model_name]
        adapters = backend._adapters()
        if adapters:
            if engine != "pytorch":
                raise ToolkitError("LoRA adapters are served by LMDeploy's PyTorch engine only: add --option engine=pytorch")
            argv += ["--adapters", *(f"{name}={path}" for name, path in adapters.items())]
        argv += engine_flags(passthrough)
        return ServerCommand(argv=argv, host=host, port=port, name="LMDeploy api_server",
                             ready_paths=("/health", "/v1/models"))

    def serve(self, model_dir: Path, host: str = "127.0.0.1", port: int = 23333, extra: dict[str, str] | None = None) -> None:
        """Run LMDeploy's OpenAI-compatible server until Ctrl-C/SIGTERM; prints the URL once it answers."""
        config, _ = split_extra(self.config, extra)
        LMDeployBackend(config)._require_engine()
        command = self.serve_command(model_dir, host, port, extra)
        serve_forever(command, startup_timeout_s=config.startup_timeout_s)
