"""``toolkit example focal-weights``: how much the focal loss keeps of each token's cross-entropy."""

from __future__ import annotations

import math

import click


@click.group("example")
def example_group() -> None:
    """Commands of the toolkit-example plugin."""


@example_group.command("focal-weights")
@click.option("--gamma", default=2.0, show_default=True, type=float, help="Focusing strength of the focal loss.")
@click.option("--prob", "probs", multiple=True, type=click.FloatRange(0.0, 1.0, min_open=True),
              default=(0.1, 0.5, 0.9, 0.99), show_default=True, help="Probability of the label token (repeatable).")
def focal_weights_command(gamma: float, probs: tuple[float, ...]) -> None:
    """Print, per label probability, cross-entropy, the focal loss and their ratio (1 - p)^gamma."""
    click.echo(f"{'p':>8} {'cross-entropy':>14} {'focal':>10} {'weight':>8}")
    for p in probs:
        ce = -math.log(p)
        weight = (1.0 - p) ** gamma
        click.echo(f"{p:>8.3g} {ce:>14.4f} {weight * ce:>10.4f} {weight:>8.4f}")
