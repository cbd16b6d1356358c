"""``toolkit data inspect``: samples as the model sees them, trained tokens marked.

Its format flags are the training commands' (``--dataset-format``, ``--columns`` and every
registered format's ``--<format>-<field>`` options), so what it shows is what training reads.
"""

from __future__ import annotations

from typing import Any

import click


def build_data_group(manager: Any) -> click.Group:
    group = click.Group("data", help="Look at datasets the way training sees them.")
    group.add_command(_inspect_command(manager))
    return group


def _inspect_command(manager: Any) -> click.Command:
    from toolkit.commands.train import add_registered_options, collect_values, key_value_pairs

    params: list[click.Parameter] = [
        click.Argument(["dataset"]),
        click.Option(["--model"], default="tiny-llama", show_default=True, help="Model whose tokenizer and template to use."),
        click.Option(["--dataset-format", "--format", "dataset_format"], default="auto", show_default=True,
                     help="Record format, as in training: auto, alpaca, messages, sharegpt, text, or a plugin's."),
        click.Option(["--columns"], multiple=True, callback=key_value_pairs, metavar="OURS=THEIRS",
                     help="Column remapping, as in training (e.g. instruction=question; repeatable)."),
        click.Option(["--loss"], default="sft", show_default=True, help="Objective (decides which tokens train)."),
        click.Option(["--num", "-n"], default=3, show_default=True, type=int, help="Samples to show."),
        click.Option(["--seq-len"], default=512, show_default=True, type=int),
        click.Option(["--trust-remote-code"], is_flag=True, help="Run the model directory's own Python code (auto_map)."),
    ]
    sections = add_registered_options(params, manager, ("dataset_format",))

    def callback(dataset: str, model: str, dataset_format: str, columns: dict[str, str] | None, loss: str, num: int,
                 seq_len: int, trust_remote_code: bool, **format_options: Any) -> None:
        from toolkit.data.inspect import inspect_dataset

        options = collect_values(format_options, sections)
        inspect_dataset(dataset, model=model, dataset_format=dataset_format, loss=loss, num=num, seq_len=seq_len,
                        columns=columns or {}, options=options, trust_remote_code=trust_remote_code)

    return click.Command("inspect", params=params, callback=callback,
                         help="Show the first samples of DATASET with trained tokens in [[brackets]].")
