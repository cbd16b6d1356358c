"""``toolkit data inspect``: samples as the model sees them, trained tokens marked."""

from __future__ import annotations

import click


@click.group("data")
def data_group() -> None:
    """Look at datasets the way training sees them."""


@data_group.command("inspect")
@click.argument("dataset")
@click.option("--model", default="tiny-llama", show_default=True, help="Model whose tokenizer and template to use.")
@click.option("--format", "dataset_format", default="auto", show_default=True)
@click.option("--loss", default="sft", show_default=True, help="Objective (decides which tokens train).")
@click.option("--num", "-n", default=3, show_default=True, type=int, help="Samples to show.")
@click.option("--seq-len", default=512, show_default=True, type=int)
def inspect_command(dataset: str, model: str, dataset_format: str, loss: str, num: int, seq_len: int) -> None:
    """Show the first samples of DATASET with trained tokens in [[brackets]]."""
    from toolkit.data.inspect import inspect_dataset

    inspect_dataset(dataset, model=model, dataset_format=dataset_format, loss=loss, num=num, seq_len=seq_len)
