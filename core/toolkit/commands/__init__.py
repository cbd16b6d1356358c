"""Core CLI commands, registered through ``toolkit_register_commands`` like any plugin's."""

from __future__ import annotations

from toolkit import hookimpl


@hookimpl
def toolkit_register_commands(cli):
    from toolkit.commands import data, evaluate, export, infer, launch, plugins, train
    from toolkit.plugins import get_plugin_manager

    cli.add_command(plugins.plugins_command)
    train.add_training_commands(cli)
    cli.add_command(export.export_command)
    cli.add_command(infer.infer_command)
    cli.add_command(infer.serve_command)
    cli.add_command(data.build_data_group(get_plugin_manager()))
    cli.add_command(launch.launch_command)
    cli.add_command(evaluate.build_eval_command(get_plugin_manager()))

    from toolkit.plan.command import plan_command

    cli.add_command(plan_command)
