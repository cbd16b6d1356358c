"""toolkit-webui: ``toolkit webui``, a Gradio page whose forms come from the registries.

Imported on every ``toolkit`` invocation (the entry point names it): no Gradio or torch here.
"""

from __future__ import annotations

from toolkit import hookimpl

__version__ = "0.1.0"


@hookimpl
def toolkit_register_commands(cli):
    from toolkit_webui.command import webui_command

    cli.add_command(webui_command)
