"""``toolkit data inspect``: print samples as the model sees them, trained tokens in [[brackets]]."""

from __future__ import annotations

from typing import Any

import click

from toolkit.contracts import IGNORE_INDEX


def render_sample(tokenizer, input_ids: list[int], labels: list[int]) -> str:
    """Decode ids, wrapping runs of trained tokens (those some label predicts) in [[ ]]."""
    trained = [False] + [label != IGNORE_INDEX for label in labels[:-1]]
    out, run, state = [], [], False
    for token, is_trained in zip(input_ids, trained):
        if is_trained != state and run:
            text = tokenizer.decode(run)
            out.append(f"[[{text}]]" if state else text)
            run = []
        state = is_trained
        run.append(token)
    if run:
        text = tokenizer.decode(run)
        out.append(f"[[{text}]]" if state else text)
    return "".join(out)


def inspect_dataset(dataset: str, *, model: str, dataset_format: str, loss: str, num: int, seq_len: int,
                    columns: dict[str, str] | None = None, options: dict[str, dict[str, Any]] | None = None) -> None:
    """Print ``num`` samples of ``dataset`` read exactly as training reads it (format, columns,
    format options from the ``--<format>-<field>`` flags)."""
    from toolkit.builtins.loaders import resolve_model
    from toolkit.data.pipeline import load_examples
    from toolkit.plugins import get_plugin_manager

    loss_cls = get_plugin_manager().get("loss", loss)
    source = resolve_model(model)
    examples, stats = load_examples([dataset], source.tokenizer, dataset_format=dataset_format, columns=columns,
                                    options=options, train_on=getattr(loss_cls, "train_on", "assistant"), seq_len=seq_len,
                                    example_kinds=loss_cls.example_kinds)
    click.echo(f"{stats.summary()}; trained tokens are shown in [[brackets]]")
    for index, example in enumerate(examples[:num]):
        for seq in example.sequences:
            role = {0: "", 1: " (rejected)"}.get(seq.role, "")
            trained = sum(label != IGNORE_INDEX for label in seq.labels)
            click.echo(f"--- sample {index}{role}: {len(seq.input_ids)} tokens, {trained} trained")
            click.echo(render_sample(source.tokenizer, seq.input_ids, seq.labels))
