"""Run every test suite of the ``tests``-tagged nox sessions as a pool over a few lanes (``TOOLKIT_TEST_POOL=1 bash
scripts/test.sh``, for machines with more cores than CI's two).

    python scripts/test_pool.py [--lanes 2] [--nox .venv-nox/bin/nox] [-- PYTEST ARGS]

Each session's venv is filled once (``nox --install-only -s SESSION``); then each suite runs in its own
``nox -R -s SESSION`` with ``TOOLKIT_TEST_SUITES=SUITE`` (noxfile.py), whenever a lane is free and its session's
install has finished, the costliest first (``noxfile.test_jobs``: the plugins' ``cost`` in ``[tool.toolkit.nox]``).

Why not nox alone: nox runs sessions one after another, and a session's suites one after another; scripts/test.sh's
two fixed lanes (the shared session beside the plugins' own sessions) leave one idle for minutes (CI 2026-12-06: 23
against 17 minutes). A pool keeps every lane busy; on CI's 2 cores it was no faster in its trials of 2026-12-06 (it
runs the core and megatron suites together, both full of two-rank tests: megatron 19.5 minutes, about what the
fixed lanes took on the same machine that day), so CI keeps the fixed lanes. Each suite's output is
printed in one piece when it ends, then a table of every job's time and status; the exit status is 1 if any
install or suite failed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKERS = "2"
"""pytest-xdist workers per suite of the shared session (``TOOLKIT_TEST_WORKERS`` overrides it; the plugins' own
sessions run one process each, as their engines are heavy)."""


@dataclass
class Job:
    session: str
    suite: str | None  # None: the session's install
    cost: int
    after: Job | None = None  # the install this suite waits for
    status: str = "waiting"  # waiting, running, passed, failed
    seconds: float = 0.0
    log: Path = field(default=Path())

    @property
    def name(self) -> str:
        return f"{self.session} install" if self.suite is None else f"{self.session}: {self.suite}"


def plan(test_jobs: list[tuple[str, str, int]], sessions: list[str]) -> list[Job]:
    """An install job per session (its suites' total cost, so the busiest session is filled first) and a job per
    suite that waits for it; only ``sessions`` (the ones nox lists, i.e. not skipped on this machine)."""
    installs: dict[str, Job] = {}
    jobs: list[Job] = []
    for session, suite, cost in test_jobs:
        if session not in sessions:
            continue
        install = installs.setdefault(session, Job(session, None, 0))
        install.cost += cost
        jobs.append(Job(session, suite, cost, after=install))
    return [*installs.values(), *jobs]


def next_job(jobs: list[Job]) -> Job | None:
    """The costliest waiting job whose install has passed. An install costs what its suites cost together, so the
    shared session's comes first and a small session's (quantize: one short suite) waits behind the long suites."""
    ready = [j for j in jobs if j.status == "waiting" and (j.after is None or j.after.status == "passed")]
    return max(ready, key=lambda j: j.cost, default=None)


def run(jobs: list[Job], lanes: int, nox: list[str], posargs: list[str], logs: Path) -> None:
    lock = threading.Condition()

    def command(job: Job) -> list[str]:
        if job.suite is None:
            return [*nox, "--no-reuse-existing-virtualenvs", "--install-only", "-s", job.session]
        return [*nox, "-R", "-s", job.session, "--", *posargs]

    def lane() -> None:
        while True:
            with lock:
                job = next_job(jobs)
                while job is None and any(j.status in ("waiting", "running") for j in jobs):
                    if not any(j.status == "running" for j in jobs):  # what is left waits on a failed install
                        return
                    lock.wait()
                    job = next_job(jobs)
                if job is None:
                    return
                job.status = "running"
            job.log = logs / f"{job.session}-{job.suite or 'install'}.log"
            env = {**os.environ, "TOOLKIT_TEST_SUITES": job.suite or ""}
            if job.session == "tests":  # the shared venv's suites on two pytest-xdist workers each (see WORKERS)
                env.setdefault("TOOLKIT_TEST_WORKERS", WORKERS)
            started = time.monotonic()
            with job.log.open("w") as out:
                code = subprocess.call(command(job), stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
            with lock:
                job.seconds = time.monotonic() - started
                job.status = "passed" if code == 0 else "failed"
                print(f"\n{'=' * 20} {job.name}: {job.status} in {job.seconds / 60:.1f} min {'=' * 20}", flush=True)
                print(job.log.read_text(errors="replace"), end="", flush=True)
                lock.notify_all()

    threads = [threading.Thread(target=lane, daemon=True) for _ in range(lanes)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lanes", type=int, default=int(os.environ.get("TOOLKIT_TEST_LANES", "2")))
    parser.add_argument("--nox", default=str(ROOT / ".venv-nox" / "bin" / "nox"))
    parser.add_argument("posargs", nargs="*", help="arguments for pytest (after --)")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    import noxfile  # the sessions and suites (this interpreter has nox: scripts/test.sh runs it from .venv-nox)

    listing = subprocess.run([args.nox, "-l", "-t", "tests", "--json"], capture_output=True, text=True, check=True, cwd=ROOT)
    sessions = [s["session"] for s in json.loads(listing.stdout)]
    jobs = plan(noxfile.test_jobs(), sessions)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="toolkit-test-pool-") as logs:
        run(jobs, max(1, args.lanes), [args.nox], args.posargs, Path(logs))
    print(f"\n{'=' * 20} scripts/test_pool.py: {len(jobs)} jobs on {args.lanes} lanes in "
          f"{(time.monotonic() - started) / 60:.1f} min {'=' * 20}")
    for job in jobs:
        print(f"{job.name:40s} {job.status:8s} {job.seconds / 60:5.1f} min")
    failed = [job.name for job in jobs if job.status != "passed"]
    if failed:
        print(f"scripts/test_pool.py: failed or not run: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
