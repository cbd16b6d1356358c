"""``toolkit infer`` and ``toolkit serve``: generate from or serve an exported model."""

from __future__ import annotations

import click


def sampling_options() -> list[click.Option]:
    """``--max-new-tokens``, ``--temperature``, ``--top-p``, ``--top-k`` from :class:`toolkit.inference.SamplingOptions`
    (their one definition; ``toolkit grpo`` gets the same flags from it). A flag left out is absent from the values
    (``None``), so the backend's ``Config`` keeps its default."""
    from toolkit.commands.train import dataclass_options
    from toolkit.inference import SamplingOptions

    return dataclass_options(SamplingOptions)


def given(values: dict) -> dict:
    """The flags the user set (click passes ``None`` for the others)."""
    return {name: value for name, value in values.items() if value is not None}


@click.command("infer")
@click.argument("model")
@click.option("--prompt", "prompts", multiple=True, required=True, help="Prompt text (repeatable).")
@click.option("--backend", default="hf", show_default=True, help="Inference backend: hf, vllm, lmdeploy.")
@click.option("--system", default="", help="System message placed before each prompt (chat template).")
@click.option("--no-chat-template", is_flag=True, help="Feed the prompt as raw text.")
@click.option("--dtype", default="float32", show_default=True, type=click.Choice(["float32", "bfloat16", "float16"]))
@click.option("--option", "extra", multiple=True, help="Backend option KEY=VALUE (repeatable), e.g. python=/venv/bin/python.")
@click.option("--trust-remote-code", is_flag=True, help="Run the model directory's own Python code (auto_map).")
def infer_command(model: str, prompts: tuple[str, ...], backend: str, system: str, no_chat_template: bool, dtype: str,
                  extra: tuple[str, ...], trust_remote_code: bool, **sampling: float | int | None) -> None:
    """Generate completions for --prompt from MODEL (a run, HF dir or preset); stdout holds only the completions."""
    from toolkit.inference import run_infer

    run_infer(model, list(prompts), backend, chat_template=not no_chat_template, dtype=dtype, system=system, extra=extra,
              trust_remote_code=trust_remote_code, **given(sampling))


infer_command.params[2:2] = sampling_options()


@click.command("serve")
@click.argument("model")
@click.option("--backend", default="vllm", show_default=True, help="Serving backend: vllm, lmdeploy.")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8000, show_default=True, type=int)
@click.option("--option", "extra", multiple=True, help="Backend option KEY=VALUE (repeatable).")
def serve_command(model: str, backend: str, host: str, port: int, extra: tuple[str, ...]) -> None:
    """Serve MODEL through an engine's OpenAI-compatible server; prints the URL once it answers."""
    from toolkit.inference import run_serve

    run_serve(model, backend, host=host, port=port, extra=extra)
