"""toolkit-rl: GRPO-family reinforcement learning (GRPO, Dr. GRPO, DAPO, BNPO, GSPO), rollouts and rewards as plugins.

Registered through the core's hooks only; importing this module is cheap (no torch).
"""

from __future__ import annotations

from toolkit import hookimpl

__version__ = "0.1.0"


@hookimpl
def toolkit_register_losses(register):
    from toolkit_rl.losses import LOSSES

    for cls in LOSSES:
        register(cls)


@hookimpl
def toolkit_register_rewards(register):
    from toolkit_rl.rewards import REWARDS

    for cls in REWARDS:
        register(cls)


@hookimpl
def toolkit_register_commands(cli):
    from toolkit_rl.command import add_grpo_command

    add_grpo_command(cli)
