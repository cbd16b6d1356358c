"""``toolkit data inspect``: print samples as the model sees them, trained tokens in [[brackets]]."""

from __future__ import annotations

from typing import Any

import click

from toolkit.contracts import IGNORE_INDEX, member


def sample_segments(tokenizer, input_ids: list[int], labels: list[int]) -> list[tuple[str, bool]]:
    """Decoded runs of ``input_ids`` as ``(text, trained)``: trained tokens are those some label predicts.

    ``toolkit data inspect`` prints them with [[brackets]]; toolkit-webui highlights them.
    """
    trained = [False] + [label != IGNORE_INDEX for label in labels[:-1]]
    segments, run, state = [], [], False
    for token, is_trained in zip(input_ids, trained):
        if is_trained != state and run:
            segments.append((tokenizer.decode(run), state))
            run = []
        state = is_trained
        run.append(token)
    if run:
        segments.append((tokenizer.decode(run), state))
    return segments


def render_sample(tokenizer, input_ids: list[int], labels: list[int]) -> str:
    """Decode ids, wrapping runs of trained tokens (those some label predicts) in [[ ]]."""
    return "".join(f"[[{text}]]" if trained else text for text, trained in sample_segments(tokenizer, input_ids, labels))


def inspect_samples(dataset: str, *, model: str, dataset_format: str, loss: str, num: int, seq_len: int,
                    columns: dict[str, str] | None = None, options: dict[str, dict[str, Any]] | None = None,
                    trust_remote_code: bool = False) -> tuple[str, Any, list]:
    """The data summary, the tokenizer and the first ``num`` examples of ``dataset``, read exactly as
    training reads it (format, columns, format options from the ``--<format>-<field>`` flags)."""
    from toolkit.data.pipeline import load_examples
    from toolkit.models import resolve_model
    from toolkit.plugins import get_plugin_manager

    loss_cls = get_plugin_manager().get("loss", loss)
    source = resolve_model(model, trust_remote_code)
    examples, stats = load_examples([dataset], source.tokenizer, dataset_format=dataset_format, columns=columns,
                                    options=options, train_on=member(loss_cls, "loss", "train_on"), seq_len=seq_len,
                                    example_kinds=loss_cls.example_kinds)
    return stats.summary(), source.tokenizer, examples[:num]


def sample_title(index: int, seq) -> str:
    role = {0: "", 1: " (rejected)"}.get(seq.role, "")
    trained = sum(label != IGNORE_INDEX for label in seq.labels)
    return f"--- sample {index}{role}: {len(seq.input_ids)} tokens, {trained} trained"


def inspect_dataset(dataset: str, *, model: str, dataset_format: str, loss: str, num: int, seq_len: int,
                    columns: dict[str, str] | None = None, options: dict[str, dict[str, Any]] | None = None,
                    trust_remote_code: bool = False) -> None:
    """Print ``num`` samples of ``dataset`` as :func:`inspect_samples` reads them, trained tokens in [[brackets]]."""
    summary, tokenizer, examples = inspect_samples(dataset, model=model, dataset_format=dataset_format, loss=loss, num=num,
                                                   seq_len=seq_len, columns=columns, options=options,
                                                   trust_remote_code=trust_remote_code)
    click.echo(f"{summary}; trained tokens are shown in [[brackets]]")
    for index, example in enumerate(examples):
        for seq in example.sequences:
            click.echo(sample_title(index, seq))
            click.echo(render_sample(tokenizer, seq.input_ids, seq.labels))
