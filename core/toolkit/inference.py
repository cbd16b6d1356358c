"""``toolkit infer`` / ``toolkit serve``: resolve MODEL to an HF directory and hand it to a backend."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from toolkit.config import option
from toolkit.contracts import member
from toolkit.errors import ModelError, ToolkitError


@dataclasses.dataclass(kw_only=True)
class SamplingOptions:
    """How completions are drawn: one definition with one set of flags (``--max-new-tokens``, ``--temperature``,
    ``--top-p``, ``--top-k``) for ``toolkit infer``, ``toolkit eval`` and toolkit-rl's rollouts (``toolkit grpo``,
    whose config inherits it with its own defaults), so a flag means the same to every command and backend."""

    max_new_tokens: int = option(64, flag="--max-new-tokens", help="Most tokens to generate per prompt.")
    temperature: float = option(0.0, flag="--temperature", help="Sampling temperature; 0 is greedy.")
    top_p: float = option(1.0, flag="--top-p", help="Nucleus sampling: draw from the smallest set of tokens whose "
                                                    "probability reaches this (1: every token).")
    top_k: int = option(0, flag="--top-k", help="Draw from the k most likely tokens (0: no limit).")

    def check(self) -> list[str]:
        problems = []
        if self.max_new_tokens < 1:
            problems.append(f"max_new_tokens must be at least 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            problems.append(f"temperature must be 0 (greedy) or positive, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            problems.append(f"top_p must lie in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            problems.append(f"top_k must be 0 (no limit) or positive, got {self.top_k}")
        return problems

    def transformers_sampling(self) -> dict[str, Any]:
        """The sampling arguments of transformers' ``generate`` (greedy at temperature 0). ``top_k=0`` is passed, not
        left out, so a model's ``generation_config.json`` (Qwen3 ships ``top_k: 20``) never limits what was asked."""
        if self.temperature <= 0:
            return {"do_sample": False}
        return {"do_sample": True, "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k}


@dataclasses.dataclass(kw_only=True)
class GenerationOptions(SamplingOptions):
    """The options every inference backend's ``Config`` starts with (``toolkit infer`` and ``toolkit eval``
    take them as ``--option`` or flags): one definition, so they mean the same on hf, vllm and lmdeploy."""

    chat_template: bool = option(True, help="Wrap each prompt as a user turn of the model's chat template.")
    system: str = option("", help="System message placed before each prompt.")


def format_prompt(tokenizer: Any, prompt: str, chat_template: bool, system: str = "") -> str:
    """The text a backend feeds the model: the prompt as a user turn of the chat template, or raw."""
    if not chat_template:
        return prompt
    from toolkit.data.template import ChatTemplate

    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    return ChatTemplate(tokenizer).render(messages, add_generation_prompt=True)


NO_REMOTE_CODE = ("This command never runs a model's own code: use an export of an architecture transformers has, "
                  "or try the model with `toolkit infer --trust-remote-code`")


def model_directory(reference: str, workdir: Path, trust_remote_code: bool = False,
                    refusal: str | None = None) -> Path:
    """An HF directory for a run (its export, else its newest checkpoint exported), an HF dir or a preset;
    checked before a backend reads it: safetensors weights, and no model code unless ``trust_remote_code``.
    ``refusal`` ends the message for model code where the command has no ``--trust-remote-code`` to allow it."""
    from toolkit.export import export_model, resolve_export_source
    from toolkit.models import PRESETS, check_remote_code, materialize_preset

    path = Path(reference)
    if reference in PRESETS and not path.exists():
        return materialize_preset(reference)
    exports = [path / "export", *sorted(path.glob("export-*"))] if (path / "recipe.yaml").is_file() else []
    directory = next((e for e in [*exports, path] if (e / "config.json").is_file()), None)
    if directory is None:
        if not path.exists():
            raise ToolkitError(f"cannot find model {reference!r}: give a run directory, an HF model directory or a "
                               f"preset ({', '.join(PRESETS)})")
        source = resolve_export_source(reference, trust_remote_code=trust_remote_code)
        return export_model(source, "hf", workdir / "model", overwrite=True)
    check_remote_code(directory, trust_remote_code, *([refusal] if refusal else []))
    if not list(directory.glob("*.safetensors")):
        hint = " (.bin weights are pickles and are not read: convert them to safetensors)" if list(directory.glob("*.bin")) else ""
        raise ModelError(f"model directory {directory} has no *.safetensors weights{hint}")
    return directory


def backend_instance(name: str, values: dict[str, Any]) -> Any:
    from toolkit.config import build_dataclass
    from toolkit.errors import ConfigError
    from toolkit.plugins import get_plugin_manager

    cls = get_plugin_manager().get("inference_backend", name)
    fields = {f.name for f in dataclasses.fields(cls.Config)}
    problems: list[str] = []
    config = build_dataclass(cls.Config, {k: v for k, v in values.items() if k in fields}, f"--backend {name}", problems)
    if problems:  # e.g. --top-p 0 (SamplingOptions.check), before any model loads
        raise ConfigError(problems, source=f"--backend {name}")
    return cls(config)


def run_infer(reference: str, prompts: list[str], backend: str, extra: tuple[str, ...] = (), **options: Any) -> list[str]:
    """Print the completions, and only them, on stdout (engines' own output goes to stderr)."""
    instance = backend_instance(backend, options)
    if extra:  # --option KEY=VALUE: fields of the backend's Config (generation reads no engine flags)
        import dataclasses

        from toolkit.serving import split_extra

        instance.config, rest = split_extra(instance.config, extra)
        if rest:
            names = ", ".join(f.name for f in dataclasses.fields(instance.config))
            raise ToolkitError(f"--option {', '.join(rest)}: not an option of backend {backend!r} for toolkit infer; "
                               f"its options: {names}")
    with tempfile.TemporaryDirectory(prefix="toolkit-infer-") as workdir, stdout_to_stderr():
        directory = model_directory(reference, Path(workdir), options.get("trust_remote_code", False))
        completions = instance.generate(directory, prompts, instance.config)
    for prompt, completion in zip(prompts, completions):
        if len(prompts) > 1:
            print(f"### {prompt}")
        print(completion.strip())
    return completions


@contextlib.contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """Send what engines print (vLLM logs its warnings to stdout, C++ code writes to fd 1) to stderr meanwhile."""
    sys.stdout.flush()
    try:
        saved = os.dup(1)
    except OSError:  # no file descriptor 1 (an embedding host): Python-level redirection only
        saved = None
    if saved is not None:
        os.dup2(2, 1)
    previous, sys.stdout = sys.stdout, sys.stderr
    try:
        yield
    finally:
        sys.stdout = previous
        if saved is not None:
            os.dup2(saved, 1)
            os.close(saved)


def run_serve(reference: str, backend: str, *, host: str, port: int, extra: tuple[str, ...] = ()) -> None:
    instance = backend_instance(backend, {})
    if member(instance, "inference_backend", "serve") is None:
        raise ToolkitError(f"inference backend {backend!r} cannot serve; try --backend vllm or lmdeploy")
    from toolkit.serving import parse_pairs

    options = parse_pairs(extra)
    with tempfile.TemporaryDirectory(prefix="toolkit-serve-") as workdir:
        directory = model_directory(reference, Path(workdir), refusal=NO_REMOTE_CODE)
        instance.serve(directory, host, port, options)
