"""``toolkit launch``: a thin torchrun wrapper for one node."""

from __future__ import annotations

import click


@click.command("launch", context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("--nproc", default=2, show_default=True, type=int, help="Processes on this node.")
@click.option("--master-port", default=29500, show_default=True, type=int)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def launch_command(nproc: int, master_port: int, args: tuple[str, ...]) -> None:
    """Run 'toolkit ARGS...' on NPROC processes of this node (torchrun --standalone)."""
    import subprocess
    import sys

    if not args:
        raise click.UsageError("give the toolkit command to run, e.g. toolkit launch --nproc 2 sft --model tiny-llama")
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", f"--master-port={master_port}",
               "-m", "toolkit", *args]
    click.echo("launching: " + " ".join(command), err=True)
    raise SystemExit(subprocess.call(command))
