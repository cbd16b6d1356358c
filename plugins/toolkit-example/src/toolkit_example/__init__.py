"""toolkit-example: the template plugin. Registers the ``focal`` loss, the ``sentence`` reward and ``toolkit example``.

This module is what the ``toolkit`` entry point names, so it is imported on every ``toolkit``
invocation: keep it cheap (no torch here) and import the real code inside the hooks.
"""

from __future__ import annotations

from toolkit import hookimpl

__version__ = "0.1.0"


@hookimpl
def toolkit_register_losses(register):
    from toolkit_example.losses import FocalLoss

    register(FocalLoss)


@hookimpl
def toolkit_register_rewards(register):
    from toolkit_example.rewards import SentenceReward

    register(SentenceReward)


@hookimpl
def toolkit_register_commands(cli):
    from toolkit_example.commands import example_group

    cli.add_command(example_group)
