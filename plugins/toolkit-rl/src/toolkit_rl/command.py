"""``toolkit grpo``: the training command of loss ``grpo``, with the RL loop in place of the core's runner."""

from __future__ import annotations

from typing import Any

HELP = """RL from rewards: GRPO, Dr. GRPO, DAPO, BNPO or GSPO (--loss-type) on rollouts sampled from the policy.

For each prompt of --dataset, --num-generations completions are sampled (--rollout-backend hf|vllm),
scored by every --reward (NAME[:WEIGHT], module:function, file.py:function or a reward-model
directory), and trained on with group-normalised advantages. Example:

  toolkit grpo --model runs/demo/export --dataset prompts.jsonl --reward answer --num-generations 8
"""


def add_grpo_command(cli: Any) -> None:
    from toolkit.commands.train import make_training_command
    from toolkit.plugins import get_plugin_manager

    if "grpo" in cli.commands:
        return
    from toolkit_rl.loop import run_grpo

    cli.add_command(make_training_command("grpo", "grpo", HELP, get_plugin_manager(), run=run_grpo))
