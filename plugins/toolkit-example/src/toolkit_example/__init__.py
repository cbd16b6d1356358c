"""toolkit-example: the template plugin. Registers the ``focal`` loss, the ``sentence`` reward, ``toolkit example``
and, where toolkit-megatron is installed, the ``iquestcoder`` family for the Megatron bridge.

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


@hookimpl
def toolkit_register_architectures(register):
    import importlib.util

    if importlib.util.find_spec("toolkit_megatron") is None:  # an optional integration: nothing to extend
        return
    from toolkit_example.megatron_family import IQuestCoderArchitecture

    register(IQuestCoderArchitecture)
