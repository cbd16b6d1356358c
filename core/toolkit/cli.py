"""The ``toolkit`` click group, assembled from registered commands (the core's own included)."""

from __future__ import annotations

import os
import sys

import click

from toolkit import __version__
from toolkit.errors import ConfigError, DataError, LayoutError, ModelError, RegistryError, RunStopped, ToolkitError

# Errors in the user's input: every rank of a torchrun job hits the same one, so only rank 0 prints it.
INPUT_ERRORS = (ConfigError, DataError, LayoutError, ModelError, RegistryError, click.UsageError)


class ToolkitGroup(click.Group):
    """A click group that turns usage errors and ToolkitErrors into one paragraph, no traceback."""

    def resolve_command(self, ctx: click.Context, args: list[str]):
        try:
            return super().resolve_command(ctx, args)
        except click.UsageError as exc:
            import difflib

            name = args[0] if args else ""
            close = difflib.get_close_matches(name, self.list_commands(ctx), n=1)
            hint = f" Did you mean '{close[0]}'?" if close else ""
            raise click.UsageError(
                f"unknown command '{name}'.{hint} Commands: {', '.join(self.list_commands(ctx))}. "
                "A plugin may provide it: see 'toolkit plugins'."
            ) from exc


@click.group(cls=ToolkitGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="toolkit")
@click.option("--debug", is_flag=True, help="Show tracebacks for errors (also accepted after the subcommand).")
def cli(debug: bool) -> None:
    """Train, align, export and serve large language models; features come from plugins.

    Training: toolkit sft|pt --model tiny-llama --dataset demo. Installed plugins: toolkit plugins.

    Exit status: 0 done; 1 error; 75 stopped early with a whole checkpoint (a signal or --stop-after;
    continue with --resume auto); 130 aborted (a second Ctrl-C).
    """
    if debug:
        os.environ["TOOLKIT_DEBUG"] = "1"


def build_cli() -> click.Group:
    """A fresh ``toolkit`` group holding every command the process-wide plugin manager
    registers (a new group per call, so tests with different managers stay apart)."""
    from toolkit.plugins import get_plugin_manager

    group = ToolkitGroup(name="toolkit", callback=cli.callback, params=list(cli.params), help=cli.help,
                         context_settings=dict(cli.context_settings))
    get_plugin_manager().register_commands(group)
    return group


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``toolkit`` script and ``python -m toolkit``."""
    from toolkit.streams import guard_standard_streams

    guard_standard_streams()  # a reader that went away must not end a training run at its next print
    args = list(sys.argv[1:] if argv is None else argv)
    if "--debug" in args:
        # Accepted anywhere (``toolkit sft ... --debug``), not only before the subcommand.
        args = ["--debug", *[a for a in args if a != "--debug"]]
        os.environ["TOOLKIT_DEBUG"] = "1"
    try:
        group = build_cli()
        group.main(args=args, prog_name="toolkit", standalone_mode=False)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except click.Abort:
        click.echo("Aborted.", err=True)
        sys.exit(130)
    except click.UsageError as exc:  # one paragraph instead of click's usage block
        ctx = exc.ctx
        hint = f" See '{ctx.command_path} --help'." if ctx is not None else ""
        _print_error(exc, f"Error: {exc.format_message()}{hint}")
        sys.exit(exc.exit_code)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except RunStopped as exc:  # stopped and saved, resumable: a status of its own, not an error
        click.echo(f"toolkit: {exc}", err=True)
        sys.exit(exc.exit_code)
    except ToolkitError as exc:
        if os.environ.get("TOOLKIT_DEBUG"):
            raise
        _print_error(exc, f"Error: {exc}\n(run with --debug for the traceback)")
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)


def _print_error(exc: Exception, text: str) -> None:
    """Print once per job: an input error on rank 0 only; any other error on its rank, so marked."""
    rank = int(os.environ.get("RANK", "0") or 0)
    if rank == 0:
        click.echo(text, err=True)
    elif not isinstance(exc, INPUT_ERRORS):
        click.echo(f"[rank {rank}] {text}", err=True)
    else:
        import time

        time.sleep(3)  # torchrun stops every rank once one exits: give rank 0 the time to print it
