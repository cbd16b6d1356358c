"""``toolkit launch``: a thin torchrun wrapper, one node or several (static rendezvous)."""

from __future__ import annotations

import click


def torchrun_command(args: tuple[str, ...], nproc: int, nnodes: int = 1, node_rank: int = 0,
                     master_addr: str | None = None, master_port: int = 29500, script: str | None = None) -> list[str]:
    """The torchrun command line for these flags (through :func:`torchrun_main`)."""
    import sys

    command = [sys.executable, "-m", "toolkit.commands.launch", f"--nproc-per-node={nproc}", f"--master-port={master_port}"]
    if nnodes > 1 or master_addr:
        command += [f"--nnodes={nnodes}", f"--node-rank={node_rank}", f"--master-addr={master_addr or '127.0.0.1'}"]
    return command + ([script] if script else ["-m", "toolkit"]) + list(args)


@click.command("launch", context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("--nproc", default=2, show_default=True, type=int, help="Processes on this node (usually its GPU count).")
@click.option("--nnodes", default=1, show_default=True, type=int, help="Nodes in the job; run the same command on each.")
@click.option("--node-rank", default=0, show_default=True, type=int, help="This node's index, 0 .. nnodes-1.")
@click.option("--master-addr", default=None, help="Address of node 0 (needed with --nnodes > 1).")
@click.option("--master-port", default=29500, show_default=True, type=int, help="Free TCP port on node 0.")
@click.option("--script", default=None, type=click.Path(dir_okay=False), help="Run this Python script instead of 'toolkit ARGS'.")
@click.option("--dry-run", is_flag=True, help="Print the torchrun command and exit.")
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def launch_command(nproc: int, nnodes: int, node_rank: int, master_addr: str | None, master_port: int,
                   script: str | None, dry_run: bool, args: tuple[str, ...]) -> None:
    """Run 'toolkit ARGS...' on NPROC processes of this node, through torchrun.

    Several nodes: run the same command on every node with its own --node-rank, e.g.
    toolkit launch --nnodes 2 --node-rank 0 --master-addr node0 --nproc 8 sft --model ./qwen2-7b ...
    """
    import subprocess

    problems = []
    if nproc < 1:
        problems.append(f"--nproc must be at least 1, got {nproc}")
    if nnodes < 1 or not 0 <= node_rank < nnodes:
        problems.append(f"--node-rank must be in 0..{nnodes - 1} for --nnodes {nnodes}, got {node_rank}")
    if nnodes > 1 and not master_addr:
        problems.append("--nnodes > 1 needs --master-addr (the address of node 0, reachable from every node)")
    if not args and not script:
        problems.append("give the toolkit command to run, e.g. toolkit launch --nproc 2 sft --model tiny-llama")
    if problems:
        raise click.UsageError("; ".join(problems))
    command = torchrun_command(args, nproc, nnodes, node_rank, master_addr, master_port, script)
    click.echo("launching: " + " ".join(command), err=True)
    if dry_run:
        click.echo(" ".join(command))
        return
    raise SystemExit(subprocess.call(command))


def launch_advice(processes: int, argv: list[str] | None = None) -> str:
    """How to run this same command on ``processes`` processes (for a one-process run that needs more)."""
    import sys

    args = " ".join(sys.argv[1:] if argv is None else argv) or "sft ..."
    return (f"launch {processes} processes: toolkit launch --nproc {processes} {args}  "
            f"(or: torchrun --nproc-per-node {processes} -m toolkit {args})")


def torchrun_main(argv: list[str]) -> None:
    """``torch.distributed.run`` without the agent's traceback when a worker fails: the worker
    already printed its error (once, from rank 0 for input errors), so one line names the ranks."""
    import logging
    import sys

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main

    # its "closing signal" / "failed (exitcode ...)" lines repeat what the line below says
    logging.getLogger("torch.distributed.elastic.multiprocessing").setLevel(logging.CRITICAL)
    try:
        main(argv)
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        print(f"toolkit launch: rank {rank} failed (exit code {failure.exitcode}) and the others were stopped; "
              "its error is printed above", file=sys.stderr)
        sys.exit(failure.exitcode if isinstance(failure.exitcode, int) and failure.exitcode > 0 else 1)


if __name__ == "__main__":
    import sys

    torchrun_main(sys.argv[1:])
