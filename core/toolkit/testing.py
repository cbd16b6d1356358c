"""Pytest plugin shipped with the core (entry point ``pytest11: toolkit``): fixtures for plugin authors.

``pytest --toolkit-cpu-report N`` prints the CPU seconds of the suite and of its N costliest tests (the
subprocesses they waited for included; under pytest-xdist too): :class:`CpuReport`.

Installed with ``toolkit``, so every test session in that environment gets these fixtures:

- ``toolkit_manager(*plugins, installed=True)``: an isolated plugin manager with in-process plugins
- ``cli_runner``: runs ``toolkit ...`` in-process exactly as the console script does
- ``tiny_model_factory(family, **overrides)``: a tiny HF model of an embedded preset (no hub)
- ``run_distributed(target, nproc=2, args=())``: real ``torch.distributed`` (gloo) processes
- ``cpu_flex_backward``: FlexAttention backward allowed on CPU (to compare packed-row gradients);
  ``flex_calls``: the attention calls that ran through FlexAttention

and helpers usable outside fixtures: :func:`run_distributed`, :func:`run_python` (a CLI run or a torchrun-style
job, forked from a server that imported torch and transformers once: :mod:`toolkit.forkserver`),
:func:`write_plugin_distribution`,
:func:`packed_batch`; for checkpoints someone crafted: :class:`CodePayload`, :func:`reseal_checkpoint`,
:func:`point_dcp_entry_at`.
Importing this module is cheap (no torch), because pytest loads it in every session.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from toolkit import forkserver
from toolkit.train.distributed import free_port

# Marks a rank that finished its work; an abort at interpreter exit after it is harmless.
_DONE = "done"
_EXIT_ABORT = "terminate called without an active exception"
_KILLED_AT_TIMEOUT = "killed after a timeout"  # _wait_all's note on a rank it killed at the deadline


# ----------------------------------------------------------------------------- plugin manager


def _as_named(plugin: Any, index: int) -> tuple[str, object]:
    if isinstance(plugin, tuple):
        return plugin
    name = getattr(plugin, "__name__", None) or f"test-plugin-{index}"
    return name, plugin


@pytest.fixture
def toolkit_manager(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Any]]:
    """Factory for an isolated plugin manager that becomes the process-wide one for the test.

    ``toolkit_manager(my_plugin, ("name", obj), installed=True)`` loads the given in-process
    plugins (modules, classes or objects with ``@toolkit.hookimpl`` functions; a bare object is
    named after its ``__name__``) on top of the installed ones; ``installed=False`` keeps only
    the core's built-ins. The previous manager is restored after the test.
    """
    from toolkit.plugins import build_plugin_manager, set_plugin_manager

    previous = set_plugin_manager(None)

    def make(*plugins: Any, installed: bool = True) -> Any:
        if installed:
            monkeypatch.delenv("TOOLKIT_PLUGINS", raising=False)
        else:
            monkeypatch.setenv("TOOLKIT_PLUGINS", "")  # an empty allow-list: built-ins only
        manager = build_plugin_manager(extra_plugins=[_as_named(p, i) for i, p in enumerate(plugins)])
        set_plugin_manager(manager)
        return manager

    yield make
    set_plugin_manager(previous)


@dataclasses.dataclass
class CliResult:
    """What one ``toolkit`` invocation printed and returned."""

    exit_code: int
    stdout: str
    stderr: str
    output: str
    exception: BaseException | None

    def __repr__(self) -> str:
        return f"CliResult(exit_code={self.exit_code}, output={self.output[-2000:]!r})"


class CliRunner:
    """Runs ``toolkit ARGS`` in-process through :func:`toolkit.cli.main` (errors are printed
    the way users see them, not raised), against the current process-wide plugin manager."""

    def __init__(self, env: dict[str, str] | None = None):
        self.env = env or {}

    def invoke(self, *args: str, env: dict[str, str] | None = None, input: str | None = None) -> CliResult:
        from click.testing import CliRunner as ClickRunner

        from toolkit.cli import main

        class _Script:  # what click's runner needs from a command: a name and main()
            name = "toolkit"

            def main(self, args: Sequence[str] = (), prog_name: str | None = None, **_: Any) -> None:
                main(list(args))

        flat = [str(a) for a in (args[0] if len(args) == 1 and isinstance(args[0], (list, tuple)) else args)]
        environment = {"TOOLKIT_DEBUG": None, **self.env, **(env or {})}
        result = ClickRunner().invoke(_Script(), flat, env=environment, input=input, catch_exceptions=True)  # type: ignore[arg-type]
        exception = result.exception if not isinstance(result.exception, SystemExit) else None
        return CliResult(result.exit_code, result.stdout, result.stderr, result.output, exception)


@pytest.fixture
def cli_runner() -> CliRunner:
    """``cli_runner.invoke("plugins", "--json")`` -> :class:`CliResult` (exit_code, stdout, stderr)."""
    return CliRunner()


# ----------------------------------------------------------------------------- tiny models

def preset_name(family: str) -> str:
    """``llama`` / ``qwen2_moe`` (HF ``model_type``) or ``tiny-qwen2-moe`` -> the embedded preset name."""
    from toolkit.models import PRESETS

    name = family if family.startswith("tiny-") else "tiny-" + family.replace("_", "-")
    if name not in PRESETS:
        families = ", ".join(p.removeprefix("tiny-") for p in PRESETS)
        raise ValueError(f"no tiny model for {family!r}; families: {families}")
    return name


class TinyModels:
    """Tiny HF models of the embedded presets (``tiny-llama``, ``tiny-qwen2-moe``, ...), built
    from configs with fixed seeds: nothing is downloaded and every machine gets the same weights."""

    def __init__(self, root: Path):
        self.root = root

    def config(self, family: str = "llama", **overrides: Any) -> Any:
        """The ``transformers`` config (``overrides`` such as ``num_hidden_layers=1``)."""
        from toolkit.models import preset_config

        return preset_config(preset_name(family), **overrides)

    def __call__(self, family: str = "llama", seed: int = 0, **overrides: Any) -> Any:
        """A randomly initialised fp32 model in eval mode."""
        import torch
        from transformers import AutoModelForCausalLM

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(self.config(family, **overrides), dtype=torch.float32)
        return model.eval()

    def directory(self, family: str = "llama", seed: int = 0, **overrides: Any) -> Path:
        """The model written as an HF directory (config, safetensors, tokenizer) under the test's tmp dir."""
        import hashlib

        from toolkit.models import materialize_preset

        name = preset_name(family)
        digest = hashlib.sha256(repr(sorted(overrides.items())).encode()).hexdigest()[:10]
        return materialize_preset(name, self.root / f"{name}-{seed}-{digest}", seed=seed, **overrides)

    def tokenizer(self) -> Any:
        """The small tokenizer shipped with the core (what every preset uses)."""
        from transformers import AutoTokenizer

        from toolkit.models import TOKENIZER_DIR

        return AutoTokenizer.from_pretrained(TOKENIZER_DIR)


def pytest_configure(config: Any) -> None:
    """Each test session tokenizes into a cache of its own (:mod:`toolkit.data.cache`), never the user's."""
    os.environ.setdefault("TOOLKIT_CACHE", tempfile.mkdtemp(prefix="toolkit-test-cache-"))
    if os.environ.get(forkserver.SHARED_DIR_VARIABLE):  # fresh `python -m toolkit` of the tests forked too (_forksite)
        site = os.path.join(os.path.dirname(__file__), "_forksite")
        paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        if site not in paths:
            os.environ["PYTHONPATH"] = os.pathsep.join([site, *paths])
    config.pluginmanager.register(CpuReport(config.getoption("toolkit_cpu_report", 0)), "toolkit-cpu-report")


def pytest_collection_finish(session: Any) -> None:
    """Processes forked for the tests start from the environment the conftest files and test modules set up."""
    forkserver.take_environment()


def pytest_addoption(parser: Any) -> None:
    parser.addoption("--toolkit-cpu-report", type=int, default=0, metavar="N",
                     help="After the run, print the suite's CPU seconds and the N tests that used the most "
                          "(this process plus the subprocesses it waited for: torchrun ranks, CLI runs). Unlike "
                          "--durations it does not grow when the machine is busy.")


# ----------------------------------------------------------------------------- CPU time per test


def _cpu_seconds() -> float:
    import resource

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime + forkserver.forked_cpu_seconds


class CpuReport:
    """``--toolkit-cpu-report N``: CPU seconds of each test (setup, call, teardown; this process and the
    subprocesses it waited for), carried on the teardown report, so pytest-xdist's workers send them to the
    controller, which prints the total and the N largest."""

    PROPERTY = "toolkit_cpu_s"

    def __init__(self, count: int):
        self.count = count
        self.rows: list[tuple[float, str]] = []
        self.started: float | None = None

    def pytest_runtest_logstart(self, nodeid: str, location: Any) -> None:
        self.started = _cpu_seconds()

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item: Any, call: Any) -> Iterator[None]:
        outcome = yield
        if call.when == "teardown" and self.started is not None:
            outcome.get_result().user_properties.append((self.PROPERTY, round(_cpu_seconds() - self.started, 3)))

    def pytest_runtest_logreport(self, report: Any) -> None:
        if report.when == "teardown":
            self.rows += [(value, report.nodeid) for key, value in report.user_properties if key == self.PROPERTY]

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if not self.count or not self.rows:
            return
        rows = sorted(self.rows, reverse=True)
        terminalreporter.write_sep("=", f"CPU time: {sum(cpu for cpu, _ in rows):.0f} s over {len(rows)} tests; "
                                        f"the {min(self.count, len(rows))} that used the most")
        for cpu, nodeid in rows[:self.count]:
            terminalreporter.write_line(f"{cpu:8.1f}s  {nodeid}")


@pytest.fixture
def tiny_model_factory(tmp_path: Path) -> TinyModels:
    """``tiny_model_factory("qwen2", num_hidden_layers=1)`` -> a tiny HF model; also ``.config(...)``,
    ``.directory(...)`` (an HF dir on disk) and ``.tokenizer()``."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return TinyModels(tmp_path / "tiny-models")


def packed_batch(rows: list[list[int]], length: int, vocab: int, pad: int = 3, seed: int = 0) -> dict[str, Any]:
    """A micro-batch (the engine's contract) of random samples: ``rows[r]`` lists the sample lengths packed
    into row ``r`` (the rest is padding), e.g. ``[[7, 9, 5], [24], [15]]`` with ``length=24``: a packed row
    with padding, a plain row, a padded row. Labels are next tokens within each sample."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    shape = (len(rows), length)
    ids, labels = torch.full(shape, pad), torch.full(shape, -100)
    positions, sequence_ids = torch.zeros(shape, dtype=torch.long), torch.full(shape, -1)
    count = 0
    for r, lengths in enumerate(rows):
        offset = 0
        for n in lengths:
            sample = torch.randint(4, vocab, (n,), generator=generator)
            ids[r, offset:offset + n] = sample
            labels[r, offset:offset + n - 1] = sample[1:]
            positions[r, offset:offset + n] = torch.arange(n)
            sequence_ids[r, offset:offset + n] = count
            count, offset = count + 1, offset + n
    return {"input_ids": ids, "labels": labels, "position_ids": positions, "sequence_ids": sequence_ids,
            "sequence_meta": {"example_ids": torch.arange(count), "roles": torch.zeros(count, dtype=torch.long)},
            "num_sequences": count}


@pytest.fixture
def cpu_flex_backward(monkeypatch: pytest.MonkeyPatch) -> None:
    """Lift torch's refusal of FlexAttention backward on CPU (a device check in ``flex_attention``; the eager
    reference it runs is device-agnostic), so gradients through ``--local-packed-attention flex`` can be
    compared with masked SDPA on CPU. The engine refuses ``flex`` on CPU without it."""
    import torch.nn.attention.flex_attention as flex

    monkeypatch.setattr(flex, "_validate_device", lambda query, key, value: None)


@pytest.fixture
def flex_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """A list that grows by the device type at every attention call that runs through FlexAttention."""
    from toolkit.train import attention

    calls: list[str] = []
    kernel = attention._flex_kernel

    def counting(device_type: str) -> Any:
        calls.append(device_type)
        return kernel(device_type)

    monkeypatch.setattr(attention, "_flex_kernel", counting)
    return calls


# ----------------------------------------------------------------------------- distributed


@dataclasses.dataclass
class RankResult:
    """One process of a script run by :func:`run_distributed`."""

    rank: int
    returncode: int
    stdout: str
    stderr: str


class DistributedError(AssertionError):
    """A rank failed; the message holds every failing rank's exit code and output tail."""


def _rank_env(rank: int, nproc: int, port: int, base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"),
               HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    # The children must import what the parent imports (test modules that pytest put on sys.path).
    env["PYTHONPATH"] = os.pathsep.join([p for p in sys.path if p] + [env.get("PYTHONPATH", "")])
    return env


def _worker() -> None:
    """Body of one rank started by :func:`run_distributed` for a function target."""
    import importlib
    from datetime import timedelta

    import torch.distributed as dist

    job = Path(sys.argv[1])
    rank = int(os.environ["RANK"])
    module_name, qualname, args, kwargs = pickle.loads((job / "job.pkl").read_bytes())
    target: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        target = getattr(target, part)
    timeout = timedelta(seconds=float(os.environ.get("TOOLKIT_DIST_TIMEOUT", "300")))
    dist.init_process_group("gloo", rank=rank, world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)
    try:
        value = target(*args, **kwargs)
        (job / f"rank-{rank}.pkl").write_bytes(pickle.dumps(value))
        dist.barrier()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
    (job / f"rank-{rank}.{_DONE}").touch()
    # A gloo worker thread may free a collective during interpreter shutdown and abort the
    # process (notes/cpu-stack.md); skipping the shutdown after a clean teardown avoids it.
    os._exit(0)


def _start_ranks(argv: list[str], envs: list[dict[str, str]], directory: Path, cwd: str | Path | None,
                 stdin: Any = None) -> tuple[list[Any], list[tuple[Path, Path]]]:
    """One process per rank (``envs[rank]``), forked from :mod:`toolkit.forkserver`'s server, its output in
    ``directory/rank-N.out|err``: files, not pipes, so no rank blocks on a full buffer."""
    procs, logs = [], []
    for rank, rank_env in enumerate(envs):
        out, err = directory / f"rank-{rank}.out", directory / f"rank-{rank}.err"
        logs.append((out, err))
        with out.open("w") as stdout, err.open("w") as stderr:
            procs.append(forkserver.popen(argv, env=rank_env, stdin=stdin, stdout=stdout, stderr=stderr, cwd=cwd))
    return procs, logs


class RankProcesses:
    """A :class:`subprocess.Popen`-like handle (``pid``, ``pids``, ``poll``, ``wait``, ``kill``, ``returncode``) of
    the ranks of one job, ending as ``torchrun`` does: once a rank fails, the others get 5 seconds, then are
    killed (they would otherwise sit in a collective until gloo's own timeout); the status is the first
    failing rank's, 0 when every rank succeeded. ``finished(rank)``: a rank that failed after it reported
    being done does not count as failing (a known harmless abort at interpreter exit)."""

    GRACE = 5.0

    def __init__(self, procs: list[Any], finished: Callable[[int], bool] = lambda rank: False):
        self.procs, self.finished = procs, finished
        self.pids = [p.pid for p in procs]
        self.pid = self.pids[0]
        self.returncode: int | None = None
        self.killed_after_failure = False
        self._failed_at: float | None = None

    def poll(self) -> int | None:
        import time

        codes = [p.poll() for p in self.procs]  # a list, not any(): every process must be polled
        if self._failed_at is None and any(c not in (None, 0) and not self.finished(r) for r, c in enumerate(codes)):
            self._failed_at = time.monotonic()
        if None in codes and self._failed_at is not None and time.monotonic() - self._failed_at > self.GRACE:
            self.killed_after_failure = True
            self.kill()
            codes = [p.wait() for p in self.procs]
        if None not in codes:
            self.returncode = next((c for c in codes if c), 0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        import time

        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired([str(pid) for pid in self.pids], timeout)
            time.sleep(0.05)
        return self.returncode  # type: ignore[return-value]

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()


def popen_ranks(args: Sequence[Any], nproc: int, *, env: dict[str, str] | None = None, cwd: str | Path | None = None,
                stdout: Any = None, stderr: Any = None) -> RankProcesses:
    """Start ``python *args`` as ``torchrun --standalone --nproc-per-node nproc`` would (one process per rank with
    RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT), forked from :mod:`toolkit.forkserver`'s server; every rank
    writes to ``stdout``/``stderr`` (files). For a test that must signal a running job (scripts/kill_test.py
    --fork); :func:`run_python` waits for one."""
    argv, port = [sys.executable, *map(str, args)], free_port()
    return RankProcesses([forkserver.popen(argv, env=_rank_env(rank, nproc, port, env), stdin=subprocess.DEVNULL,
                                           stdout=stdout, stderr=stderr, cwd=cwd) for rank in range(nproc)])


def _wait_all(procs: list[Any], logs: list[tuple[Path, Path]], timeout: float,
              finished: Callable[[int], bool]) -> list[tuple[int, str, str]]:
    """Wait for every rank (:class:`RankProcesses`); at the deadline, kill them all."""
    job = RankProcesses(procs, finished)
    note = ""
    try:
        job.wait(timeout)
        if job.killed_after_failure:
            note = "\n[run_distributed: killed after another rank failed]"
    except subprocess.TimeoutExpired:
        note = f"\n[run_distributed: {_KILLED_AT_TIMEOUT} of {timeout:.0f}s]"
        job.kill()
        for proc in procs:
            proc.wait()
    results = []
    for proc, (out, err) in zip(procs, logs):
        killed = note if proc.returncode == -9 else ""
        results.append((proc.returncode, out.read_text(errors="replace"), err.read_text(errors="replace") + killed))
    return results


def _raise_failures(failures: list[tuple[int, int, str, str]]) -> None:
    if not failures:
        return
    parts = []
    for rank, code, out, err in failures:
        tail = "\n".join((out + err).strip().splitlines()[-40:])
        parts.append(f"--- rank {rank} exited with {code}:\n{tail}")
    raise DistributedError("distributed run failed\n" + "\n".join(parts))


def run_distributed(target: Callable[..., Any] | str | Path | Sequence[str], nproc: int = 2, args: Sequence[Any] = (),
                    kwargs: dict[str, Any] | None = None, timeout: float = 300.0, env: dict[str, str] | None = None,
                    cwd: str | Path | None = None, exit_codes: Sequence[int] = (0,)) -> list[Any]:
    """Run ``target`` on ``nproc`` processes joined by ``torch.distributed`` (gloo) on this machine.

    - a function (module-level, importable by a fresh interpreter): each rank runs
      ``init_process_group("gloo")``, ``target(*args, **kwargs)``, a barrier and a clean
      teardown; returns the per-rank return values (picklable), rank 0 first.
    - a script path (``"train.py"``) or an argv list (``["-m", "toolkit", "sft", ...]``): run
      with ``python`` and the torchrun environment (RANK, WORLD_SIZE, MASTER_ADDR/PORT,
      LOCAL_RANK); ``args`` are appended; returns a :class:`RankResult` per rank.

    ``env`` adds environment variables for every rank; ``cwd`` is their working directory.

    A rank that exits with a status outside ``exit_codes`` (default: 0; a ``--stop-after`` run of one process
    exits 75) raises :class:`DistributedError` with each failing rank's output,
    except the known harmless abort at interpreter exit after the rank reported it was done.
    A rendezvous port that another process took in the meantime (EADDRINUSE) is retried on a new one.
    """
    for _ in range(2):
        try:
            return _run_distributed_once(target, nproc, args, kwargs, timeout, env, cwd, free_port(), exit_codes)
        except DistributedError as exc:
            if "EADDRINUSE" not in str(exc):
                raise
    return _run_distributed_once(target, nproc, args, kwargs, timeout, env, cwd, free_port(), exit_codes)


def _run_distributed_once(target: Any, nproc: int, args: Sequence[Any], kwargs: dict[str, Any] | None, timeout: float,
                          env: dict[str, str] | None, cwd: str | Path | None, port: int,
                          exit_codes: Sequence[int] = (0,)) -> list[Any]:
    with tempfile.TemporaryDirectory(prefix="toolkit-dist-") as tmp:
        job = Path(tmp)
        if callable(target):
            module, qualname = target.__module__, target.__qualname__
            if module == "__main__" or "<locals>" in qualname:
                raise ValueError(f"run_distributed needs a module-level function another process can import, got {module}.{qualname}")
            job.joinpath("job.pkl").write_bytes(pickle.dumps((module, qualname, tuple(args), kwargs or {})))
            argv = ["-c", "from toolkit.testing import _worker; _worker()", str(job)]
        elif isinstance(target, (str, Path)):
            argv = [str(target), *map(str, args)]
        else:
            argv = [*map(str, target), *map(str, args)]
        envs = [{**_rank_env(rank, nproc, port), "TOOLKIT_DIST_TIMEOUT": str(timeout), **(env or {})} for rank in range(nproc)]
        procs, logs = _start_ranks([sys.executable, *argv], envs, job, cwd)

        def finished(rank: int) -> bool:
            """A function's rank wrote its result and tore down cleanly (scripts have no marker)."""
            return callable(target) and job.joinpath(f"rank-{rank}.{_DONE}").exists()

        outcomes = _wait_all(procs, logs, timeout, finished)
        failures = []
        for rank, (code, out, err) in enumerate(outcomes):
            harmless = code != 0 and finished(rank) and _EXIT_ABORT in err
            if (code not in exit_codes and not harmless) or (callable(target) and not finished(rank)):
                failures.append((rank, code, out, err))
        _raise_failures(failures)
        if callable(target):
            return [pickle.loads(job.joinpath(f"rank-{r}.pkl").read_bytes()) for r in range(nproc)]
        return [RankResult(rank, code, out, err) for rank, (code, out, err) in enumerate(outcomes)]


def run_python(args: Sequence[Any], *, nproc: int = 1, env: dict[str, str] | None = None, cwd: str | Path | None = None,
               timeout: float = 300.0, check: bool = False, input: str | None = None) -> subprocess.CompletedProcess:
    """``python *args`` with its output captured as text, like ``subprocess.run(..., capture_output=True,
    text=True)``, forked from :mod:`toolkit.forkserver`'s server (a second or more sooner per process).

    ``nproc > 1`` runs it as ``torchrun --standalone --nproc-per-node nproc`` would: one process per rank with
    RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT; once one rank fails the others get 5 seconds, then are killed.
    The result holds the ranks' output one after another (rank 0 first) and the first failing rank's exit
    code (0 when all succeed). ``timeout`` raises :class:`subprocess.TimeoutExpired`.
    """
    argv = [sys.executable, *map(str, args)]
    if nproc == 1:
        return forkserver.run(argv, env=env, cwd=cwd, timeout=timeout, check=check, capture_output=True, text=True, input=input)
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="toolkit-run-") as tmp:
        procs, logs = _start_ranks(argv, [_rank_env(rank, nproc, port, env) for rank in range(nproc)], Path(tmp), cwd,
                                   stdin=subprocess.DEVNULL)
        outcomes = _wait_all(procs, logs, timeout, lambda rank: False)
    if any(_KILLED_AT_TIMEOUT in err for _, _, err in outcomes):
        raise subprocess.TimeoutExpired(argv, timeout, "".join(o for _, o, _ in outcomes), "".join(e for _, _, e in outcomes))
    code = next((c for c, _, _ in outcomes if c), 0)
    done = subprocess.CompletedProcess(argv, code, "".join(o for _, o, _ in outcomes), "".join(e for _, _, e in outcomes))
    if check:
        done.check_returncode()
    return done


@pytest.fixture(name="run_distributed")
def _run_distributed_fixture() -> Callable[..., list[Any]]:
    """:func:`run_distributed` as a fixture: ``run_distributed(my_function, nproc=2, args=(...))``."""
    return run_distributed


# ----------------------------------------------------------------------------- throwaway plugins


def write_jsonl(path: Path, records: list[dict[str, Any]]) -> str:
    """Write ``records`` as a JSONL dataset file; returns the path as text (what ``--dataset`` takes)."""
    import json

    Path(path).write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def write_plugin_distribution(site: Path, name: str, source: str, *, version: str = "0.0.1",
                              entry_point: str | None = None, module: str | None = None) -> Path:
    """Write an installed-looking distribution ``name`` into ``site`` (a directory to put on
    ``sys.path``/``PYTHONPATH``): a module with ``source`` and a dist-info whose
    ``entry_points.txt`` lists it under the ``toolkit`` group. Returns the module file.

    Lets a test exercise real entry-point discovery (a broken plugin, a duplicate name)
    without pip; run the CLI in a subprocess with ``PYTHONPATH=site``.
    """
    module = module or name.replace("-", "_")
    site.mkdir(parents=True, exist_ok=True)
    module_file = site / f"{module}.py"
    module_file.write_text(textwrap.dedent(source))
    dist_info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    dist_info.mkdir(exist_ok=True)
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (dist_info / "entry_points.txt").write_text(f"[toolkit]\n{entry_point or name.removeprefix('toolkit-')} = {module}\n")
    (dist_info / "RECORD").write_text("")
    return module_file


# ----------------------------------------------------------------------------- crafted checkpoints


class CodePayload:
    """A pickle whose unpickling writes ``marker``: if the file exists afterwards, code from the pickle ran."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self) -> tuple[Any, ...]:
        return (exec, (f"open({self.marker!r}, 'w').write('ran')",))


def plant_model_code(directory: Path, model_type: str, marker: Path) -> None:
    """Make the HF ``config.json`` in ``directory`` name its own code (``auto_map``) for ``model_type``, a type
    transformers lacks, so transformers asks whether to run it; importing that code writes ``marker``."""
    import json

    directory = Path(directory)
    (directory / "configuration_evil.py").write_text(
        f"open({str(marker)!r}, 'w').write('ran')\nfrom transformers import LlamaConfig\n\n"
        f"class EvilConfig(LlamaConfig):\n    model_type = {model_type!r}\n")
    config = json.loads((directory / "config.json").read_text())
    config.update(model_type=model_type, auto_map={"AutoConfig": "configuration_evil.EvilConfig"})
    (directory / "config.json").write_text(json.dumps(config))


def reseal_checkpoint(checkpoint: Path) -> None:
    """Rewrite ``checkpoint``'s manifest.json after a test changed its files: whoever ships a checkpoint writes
    its manifest too, so the manifest is no defence against a crafted file."""
    from toolkit.train import checkpoint as ckpt

    (Path(checkpoint) / "manifest.json").unlink()
    ckpt.write_manifest(Path(checkpoint))
    assert ckpt.checkpoint_problem(Path(checkpoint), "sha256") is None


def point_dcp_entry_at(directory: Path, key: str, payload: Any) -> None:
    """Make ``key`` of the torch.distributed.checkpoint in ``directory`` a pickled (non-tensor) entry holding
    ``payload``. The ``.metadata`` keeps only torch's own classes; torch's DefaultLoadPlanner reads such entries
    with ``torch.load(weights_only=False)``."""
    import io

    import torch
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    directory = Path(directory)
    metadata = pickle.loads((directory / ".metadata").read_bytes())
    data = io.BytesIO()
    torch.save(payload, data)
    shard = sorted(directory.glob("*.distcp"))[0]
    offset = shard.stat().st_size
    with shard.open("ab") as handle:
        handle.write(data.getvalue())
    storage_info = type(next(iter(metadata.storage_data.values())))
    for index in [index for index in metadata.storage_data if index.fqn == key]:
        del metadata.storage_data[index]
    metadata.state_dict_metadata[key] = BytesStorageMetadata()
    metadata.storage_data[MetadataIndex(key)] = storage_info(shard.name, offset, len(data.getvalue()))
    (directory / ".metadata").write_bytes(pickle.dumps(metadata))
