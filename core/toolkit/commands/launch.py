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

    Ctrl-C or SIGTERM stops the workers cleanly (they save a checkpoint); the exit status is then 75
    (stopped, resumable with --resume auto), as for a single process.

    Several nodes: run the same command on every node with its own --node-rank, e.g.
    toolkit launch --nnodes 2 --node-rank 0 --master-addr node0 --nproc 8 sft --model ./qwen2-7b ...
    """
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
    raise SystemExit(run_torchrun(command))


def run_torchrun(command: list[str]) -> int:
    """Run torchrun and return the job's exit status: 75 when the training stopped early and saved.

    torchrun turns a signal into a traceback and exit status 1 even when its workers stop cleanly, so
    torchrun runs in a session of its own (a terminal's Ctrl-C does not reach it) and SIGINT/SIGTERM
    sent to this process go to the workers as SIGTERM: they finish their step, save and exit 0, and
    torchrun exits 0. Rank 0 writes ``stopped`` to ``$TOOLKIT_STATUS_FILE`` (exit codes other than 0
    cannot pass through torchrun)."""
    import os
    import signal
    import subprocess
    import tempfile

    from toolkit.errors import EXIT_STOPPED

    with tempfile.TemporaryDirectory(prefix="toolkit-launch-") as tmp:
        status = os.path.join(tmp, "status")
        process = subprocess.Popen(command, env={**os.environ, "TOOLKIT_STATUS_FILE": status}, start_new_session=True)

        def forward(signum: int, frame: object) -> None:
            workers = _children(process.pid)
            for pid in workers or [process.pid]:
                try:
                    os.kill(pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass

        previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            code = process.wait()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        if code == 0 and os.path.isfile(status) and open(status).read().strip() == "stopped":
            return EXIT_STOPPED
        return code


def _children(pid: int) -> list[int]:
    """The direct children of ``pid`` (torchrun's workers), from /proc; empty where /proc has no such list."""
    import glob

    found: list[int] = []
    for path in glob.glob(f"/proc/{pid}/task/*/children"):
        try:
            with open(path) as handle:
                found += [int(child) for child in handle.read().split()]
        except OSError:
            continue
    return found


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
