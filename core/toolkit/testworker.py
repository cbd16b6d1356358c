"""A pytest-xdist worker forked from the test fork server (:mod:`toolkit.forkserver`), not started fresh.

pytest-xdist starts each worker as ``python -u -c BOOTSTRAP`` and speaks to it over its stdin and stdout
(execnet). A fresh worker imports torch, transformers and megatron-core again when it collects the tests: 4 to 8
CPU-seconds per worker, two workers per suite, every suite of a test session. With ``--tx
N*popen//python="PYTHON -m toolkit.testworker"`` (the noxfile's test sessions) execnet starts this module instead,
which has the fork server (the session's shared one, ``TOOLKIT_TEST_FORK_DIR``) fork ``python -c BOOTSTRAP`` with
this process's standard streams, so the worker starts with those libraries imported. This process stays as the
worker's stand-in for execnet: it passes SIGINT and SIGTERM on, and exits with the worker's status.

Where the environment does not allow a fork (:func:`toolkit.forkserver.forkable`), the worker is started as
execnet would have started it. Nothing here is imported by the worker: it needs only the standard library and
:mod:`toolkit.forkserver`, so this process costs a few hundredths of a second.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from toolkit import forkserver


def main(argv: list[str]) -> int:
    """``argv``: what execnet appends to the interpreter (``-u -c BOOTSTRAP``, maybe ``-B``)."""
    env = forkserver.flags_as_env(dict(os.environ), argv[:argv.index("-c")])
    code = argv[argv.index("-c") + 1]
    command = [sys.executable, "-c", code]
    if not forkserver.forkable(command, env):
        return subprocess.call([sys.executable, *argv])
    worker = forkserver.popen(command, env=env, stdin=0, stdout=1, stderr=2)
    return forkserver.stand_in(worker, (signal.SIGINT, signal.SIGTERM))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
