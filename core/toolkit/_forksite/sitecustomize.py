"""Tests only: a fresh ``python -m toolkit ...`` started during a test session runs forked from the session's fork
server instead of importing torch and transformers again.

:mod:`toolkit.testing` puts this directory on ``PYTHONPATH`` in test sessions that share fork servers
(``TOOLKIT_TEST_FORK_DIR``, which the noxfile sets), so every interpreter a test starts imports this module first.
Tests fork their own CLI runs already (:func:`toolkit.testing.run_python`), but not what those start: torchrun's
ranks, the runs ``toolkit webui`` launches, a CLI run inside another namespace. In CI on 2026-12-07 those were 92
fresh interpreters and 448 of the run's 2,429 CPU-seconds, most of each its imports.

Here such an interpreter hands its command line, environment, working directory and standard streams to a running
shared server that agrees with its environment (:func:`toolkit.forkserver.attach`), stays as the stand-in its
parent waits on and signals (SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1 and SIGUSR2 are passed on; if it is killed,
the server kills the job), and exits with the job's status. Anything else, or no such server, runs as usual. Only
``python [-u] [-B] -m toolkit ...``: a command that may hold other inherited descriptors (multiprocessing's) or
reads the interpreter's own state is never handed over. ``TOOLKIT_TEST_FORK=0`` turns it off; the CPU of a handed
over process is the server's, not its parent's (``--toolkit-cpu-report`` does not see it).
"""

import os
import sys


def _hand_over() -> None:
    if not os.environ.get("TOOLKIT_TEST_FORK_DIR") or os.environ.get("TOOLKIT_TEST_FORK", "1") == "0":
        return
    argv = list(getattr(sys, "orig_argv", ()))
    start = 1
    while start < len(argv) and argv[start] in ("-u", "-B"):
        start += 1
    if argv[start:start + 2] != ["-m", "toolkit"]:
        return
    import signal

    from toolkit import forkserver

    job = forkserver.attach([sys.executable, *argv[start:]], forkserver.flags_as_env(dict(os.environ), argv[1:start]))
    if job is not None:
        os._exit(forkserver.stand_in(job, (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
                                           signal.SIGUSR2)))


_hand_over()
