"""Python processes for tests, forked from one interpreter that has imported torch and transformers already.

A two-step ``toolkit sft`` on a tiny model costs about 5 s of CPU, 4 of them importing torch, transformers and
megatron-core; the test suites start several hundred such processes (CLI runs, torch.distributed ranks), which
made their import time most of CI's. :func:`popen` and :func:`run` start ``python -m ...``, ``python -c ...`` or
``python script.py`` as :mod:`subprocess` does, but by forking a server that imported those libraries once
(per test process): the child gets the request's argv, environment, working directory and standard streams and
runs the module, code or script as ``__main__``, in a session of its own, as a fresh interpreter would.

Nothing of the project is imported by the server (plugins, entry points and ``TOOLKIT_*`` settings are read fresh
by every child); only third-party libraries, and only where the child's environment agrees with the server's on
every variable such a library reads at import (``HF_*``, ``TORCH*``, ``PYTHONHASHSEED``, ...): otherwise, for
pipes, or with ``TOOLKIT_TEST_FORK=0``, the process is started by :mod:`subprocess` instead. The standard library's
``multiprocessing.forkserver`` does this for ``multiprocessing`` workers only (a function, a pickled payload);
these are command lines with their own streams and exit codes, hence this module.

One server per test process by default. With ``TOOLKIT_TEST_FORK_DIR`` set to a directory (the noxfile sets one
per session), the servers are shared: every test process (pytest-xdist workers, one suite after another) that agrees
on the interpreter, the preloaded modules and every import-time variable uses the one server of that agreement,
started by the first that needs it, under a lock, in that directory. A shared server ends when idle for
``SHARED_IDLE_S`` seconds or at :func:`stop_shared`. Each server costs about 11 CPU-seconds of imports; a session
started two per suite (one per worker), 20 and more in all.

Run as a script, this file is the server: ``python forkserver.py SOCKET MODULE,MODULE,... [IDLE_SECONDS]``.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

PRELOAD = ("numpy", "torch", "torch.distributed", "safetensors.torch", "transformers", "transformers.modeling_utils",
           "transformers.models.llama.modeling_llama", "transformers.models.qwen2.modeling_qwen2",
           "transformers.models.qwen3.modeling_qwen3", "transformers.models.qwen3_moe.modeling_qwen3_moe",
           "transformers.models.mixtral.modeling_mixtral", "datasets", "peft", "megatron.core",
           "megatron.core.models.gpt")
"""Imported by the server before it forks; a module that is not installed is skipped."""

# environment variables that a preloaded library may read at import: a child whose value differs is not forked
# (TOKENIZERS_PARALLELISM is read when a batch is encoded, not at import)
_IMPORT_SENSITIVE = ("PYTHON", "HF_", "HUGGINGFACE", "TRANSFORMERS", "TORCH", "PYTORCH", "CUDA", "NVIDIA", "OMP_",
                     "MKL", "KMP_", "OPENBLAS", "DATASETS", "LD_", "MALLOC", "NVTE", "MEGATRON", "XDG_",
                     "HOME", "TMPDIR", "PEFT")
# ... of which the child applies these itself
_APPLIED = {"PYTHONPATH", "PYTHONUNBUFFERED", "PYTHONWARNINGS", "OMP_NUM_THREADS", "PYTHONFAULTHANDLER"}
# ... and these are read when used, not at import; libraries also set the last two in the test process itself
# (torch's inductor when it first compiles, ``import deepspeed``), which would stop every later child from forking
_READ_WHEN_USED = {"TORCH_EXTENSIONS_DIR", "TORCHINDUCTOR_CACHE_DIR", "PYTORCH_NVML_BASED_CUDA_CHECK",
                   "TORCH_NCCL_ASYNC_ERROR_HANDLING"}
_READ_WHEN_USED_PREFIXES = ("TORCHELASTIC_",)  # what torchrun gives its workers, read by torch.distributed.elastic
# ... and these prefixes only where the library that reads them is installed: megatron-core sets NVTE_*_ATTN in the
# test process whenever it builds a model, for Transformer Engine
_ONLY_WITH = {"NVTE": "transformer_engine"}
_BASE_ENV = dict(os.environ)  # the environment the server starts with: before any test changed os.environ
SHARED_DIR_VARIABLE = "TOOLKIT_TEST_FORK_DIR"
SHARED_IDLE_S = float(os.environ.get("TOOLKIT_TEST_FORK_IDLE", "90"))
"""A shared server with no job and no request for this long exits (the next request starts another)."""

_server: _Server | None = None
forked_cpu_seconds = 0.0
"""CPU seconds of the finished forked processes (with what they waited for): :class:`toolkit.testing.CpuReport`
adds them, as the kernel does not count them as this process's children."""


# ----------------------------------------------------------------------------- client


class ForkedProcess:
    """A :class:`subprocess.Popen`-like handle of a process the fork server started (``pid``, ``poll``, ``wait``,
    ``kill``, ``terminate``, ``send_signal``, ``returncode``)."""

    def __init__(self, args: list[str], connection: socket.socket, pid: int):
        self.args, self.pid, self.returncode = args, pid, None
        self._connection = connection
        self._buffer = b""

    def _read_status(self, timeout: float | None) -> bool:
        self._connection.settimeout(timeout)
        try:
            while b"\n" not in self._buffer:
                chunk = self._connection.recv(4096)
                if not chunk:  # the server died: the process is gone with it
                    self._finish({"code": -signal.SIGKILL, "cpu": 0.0})
                    return True
                self._buffer += chunk
        except (TimeoutError, BlockingIOError):
            return False
        self._finish(json.loads(self._buffer.split(b"\n", 1)[0]))
        return True

    def _finish(self, status: dict[str, Any]) -> None:
        global forked_cpu_seconds
        self.returncode = status["code"]
        forked_cpu_seconds += status["cpu"]
        self._connection.close()

    def poll(self) -> int | None:
        if self.returncode is None:
            self._read_status(0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None and not self._read_status(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def __enter__(self) -> ForkedProcess:
        return self

    def __exit__(self, *_: Any) -> None:
        self.wait()


class _Server:
    """The server of this (test) process: its own, started on first use and stopped at exit, or the shared one of
    ``TOOLKIT_TEST_FORK_DIR`` for this process's interpreter, preload list and import-time environment."""

    def __init__(self) -> None:
        self.preload = os.environ.get("TOOLKIT_TEST_PRELOAD", ",".join(PRELOAD))
        shared = os.environ.get(SHARED_DIR_VARIABLE)
        self.process: subprocess.Popen | None = None
        if shared:
            self.directory = os.path.join(shared, _shared_key(self.preload))
            os.makedirs(self.directory, exist_ok=True)
        else:
            self.directory = tempfile.mkdtemp(prefix="toolkit-fork-")
            atexit.register(self.stop)
        self.address = os.path.join(self.directory, "socket")
        if shared and len(os.fsencode(self.address)) > 100:  # AF_UNIX paths end at 107 bytes
            raise RuntimeError(f"{SHARED_DIR_VARIABLE}={shared} is too long a path for the fork server's socket "
                               f"({self.address}); use a shorter directory (tempfile.mkdtemp() under /tmp)")
        if not shared:
            self.process = self._start(idle=None)

    def _start(self, idle: float | None) -> subprocess.Popen | None:
        """Start this process's own server (``idle`` None: a child, stopped at exit), or a shared one, detached: its
        parent is init, not this process, which it outlives, and which therefore never reaps it. Reaped here, its CPU
        (its imports, and every job it forked, each already in :data:`forked_cpu_seconds`) would land in whichever
        test next started a subprocess (:class:`toolkit.testing.CpuReport`: 40 s on a test that used 0.3 s)."""
        argv = [sys.executable, __file__, self.address, self.preload, *([str(idle)] if idle else [])]
        with open(os.path.join(self.directory, "server.log"), "wb") as log:
            if idle is None:
                return subprocess.Popen(argv, env=_BASE_ENV, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                        start_new_session=True)
            subprocess.run([sys.executable, "-S", "-c", _DETACH, *argv], env=_BASE_ENV, stdin=subprocess.DEVNULL,
                           stdout=log, stderr=log, check=True)
        return None

    def alive(self) -> bool:
        """Own server: whether it runs. Shared: always (:meth:`connect` starts one if it has ended)."""
        return self.process is None or self.process.poll() is None

    def connect(self, timeout: float = 300.0) -> socket.socket:
        if self.process is not None:
            return self._connect(timeout)
        try:
            return self._connect(0.0)
        except RuntimeError:
            pass
        import fcntl

        with open(self.directory + ".lock", "w") as lock:  # one starter; the others wait for its server
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                return self._connect(0.0)
            except RuntimeError:
                if os.path.exists(self.address):  # a server that ended (idle, killed) left its socket
                    os.unlink(self.address)
                pid_file = os.path.join(self.directory, "pid")
                if os.path.exists(pid_file):
                    os.unlink(pid_file)
                self._start(idle=SHARED_IDLE_S)  # it writes its pid there first (stop_shared, and _connect's check)
                return self._connect(timeout, pid_file)

    def _connect(self, timeout: float, pid_file: str | None = None) -> socket.socket:
        """Connect to the server; wait up to ``timeout`` for one starting: this process's own (``self.process``) or a
        detached one that wrote ``pid_file``, either of which ending first is an error with its log."""
        deadline = time.monotonic() + timeout
        while True:
            connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                connection.connect(self.address)
                return connection
            except (FileNotFoundError, ConnectionRefusedError):
                connection.close()
                ended = self.process is not None and self.process.poll() is not None
                ended = ended or (pid_file is not None and not _running(pid_file))
                if ended or time.monotonic() >= deadline:
                    log = Path(self.directory, "server.log")
                    tail = log.read_text(errors="replace")[-4000:] if log.exists() else ""
                    code = self.process.returncode if self.process is not None else None
                    raise RuntimeError(f"the test fork server did not start ({code}):\n{tail}") from None
                time.sleep(0.05)

    def stop(self) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        for name in os.listdir(self.directory):
            os.unlink(os.path.join(self.directory, name))
        os.rmdir(self.directory)


_DETACH = "import os, sys\nif os.fork() == 0:\n    os.setsid()\n    os.execv(sys.argv[1], sys.argv[1:])\n"
"""``python -S -c _DETACH ARGV...``: runs ARGV as a grandchild that leads its own session, then exits at once."""


def _running(pid_file: str) -> bool:
    """Whether the process whose pid ``pid_file`` holds runs; True while the file is not yet written."""
    try:
        pid = int(Path(pid_file).read_text())
    except (FileNotFoundError, ValueError):
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _shared_key(preload: str) -> str:
    """What a shared server must agree on with a test process: interpreter, preload list, import-time variables."""
    import hashlib

    agreed = sorted((key, value) for key, value in _BASE_ENV.items() if _read_at_import(key) or key == "PYTHONPATH")
    blob = json.dumps([sys.executable, preload, agreed])
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def stop_shared(directory: str | os.PathLike) -> int:
    """End the shared servers under ``directory`` (their running jobs end with them) and remove it; how many ran."""
    import shutil

    stopped = 0
    for pid_file in Path(directory).glob("*/pid"):
        try:
            os.killpg(int(pid_file.read_text()), signal.SIGKILL)  # the server leads its session: jobs have their own
            stopped += 1
        except (ProcessLookupError, ValueError, PermissionError):
            pass
    shutil.rmtree(directory, ignore_errors=True)
    return stopped


def take_environment() -> None:
    """Start the server, when it starts, with ``os.environ`` as it is now: :mod:`toolkit.testing` calls this once
    the tests are collected, so that a default that conftest files and test modules put there (``HF_HUB_OFFLINE``
    when the shell has none) does not make every child that inherits it unforkable. A running server keeps its own."""
    global _BASE_ENV
    if _server is None:
        _BASE_ENV = dict(os.environ)


def forkable(args: Sequence[Any], env: dict[str, str] | None) -> bool:
    """Whether ``args`` (``[sys.executable, "-m" | "-c" | script, ...]``) can be forked from the server."""
    if os.environ.get("TOOLKIT_TEST_FORK", "1") == "0" or not hasattr(os, "fork") or len(args) < 2:
        return False
    if str(args[0]) != sys.executable or not (args[1] in ("-m", "-c") and len(args) > 2 or not str(args[1]).startswith("-")):
        return False
    env = os.environ if env is None else env
    sensitive = {key for key in {*env, *_BASE_ENV} if _read_at_import(key)}
    return all(env.get(key) == _BASE_ENV.get(key) for key in sensitive)


def _read_at_import(key: str) -> bool:
    if not key.startswith(_IMPORT_SENSITIVE) or key in _APPLIED or key in _READ_WHEN_USED or key.startswith(_READ_WHEN_USED_PREFIXES):
        return False
    owner = next((module for prefix, module in _ONLY_WITH.items() if key.startswith(prefix)), None)
    return owner is None or _installed(owner)


@functools.cache
def _installed(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def _stream(value: Any, default: int) -> tuple[int, bool]:
    """A file descriptor for a Popen-style stream argument, and whether it must be closed after sending."""
    if value is None:
        return default, False
    if value == subprocess.DEVNULL:
        return os.open(os.devnull, os.O_RDWR), True
    if isinstance(value, int):
        return value, False
    return value.fileno(), False


def popen(args: Sequence[Any], *, env: dict[str, str] | None = None, cwd: str | os.PathLike | None = None,
          stdin: Any = None, stdout: Any = None, stderr: Any = None) -> ForkedProcess | subprocess.Popen:
    """Start ``args`` like :class:`subprocess.Popen`; forked from the server where :func:`forkable` and the
    streams are ``None`` (inherited), ``DEVNULL``, a descriptor or a file (``PIPE`` goes to subprocess)."""
    global _server
    args = [str(a) for a in args]
    streams = (stdin, stdout, stderr)
    if not forkable(args, env) or any(s in (subprocess.PIPE, subprocess.STDOUT) for s in streams):
        return subprocess.Popen(args, env=env, cwd=cwd, stdin=stdin, stdout=stdout, stderr=stderr)
    if _server is None or not _server.alive():
        _server = _Server()
    return _request(_server.connect(), args, env, cwd, streams)


def attach(args: Sequence[Any], env: dict[str, str]) -> ForkedProcess | None:
    """Start ``args`` with this process's standard streams and working directory on the shared server of
    ``TOOLKIT_TEST_FORK_DIR`` that agrees with ``env``, if one runs (never a new one, whose imports would cost
    more than the one process it forks saves); None otherwise (see :mod:`toolkit._forksite.sitecustomize`)."""
    args = [str(a) for a in args]
    if not os.environ.get(SHARED_DIR_VARIABLE) or not forkable(args, env):
        return None
    server = _Server()
    if not _same_namespaces(os.path.join(server.directory, "pid")):
        return None
    try:
        connection = server._connect(0.0)
    except RuntimeError:
        return None
    return _request(connection, args, env, None, (0, 1, 2))


def _same_namespaces(pid_file: str) -> bool:
    """Whether the server whose pid ``pid_file`` holds sees the files, users, processes and network this process
    does: a CLI run in a mount namespace of its own (a test's small tmpfs) would not find that tmpfs in a job the
    server forked outside it."""
    try:
        pid = int(Path(pid_file).read_text())
        return all(os.readlink(f"/proc/{pid}/ns/{kind}") == os.readlink(f"/proc/self/ns/{kind}")
                   for kind in ("mnt", "user", "pid", "net", "ipc", "uts"))
    except (OSError, ValueError):
        return False


def flags_as_env(env: dict[str, str], flags: Sequence[str]) -> dict[str, str]:
    """``env`` with what the interpreter flags ``-u`` and ``-B`` among ``flags`` would have set, for a job the
    server runs in place of ``python FLAGS ...`` (the server's interpreter took no such flags)."""
    env = dict(env)
    if "-u" in flags:
        env["PYTHONUNBUFFERED"] = "1"
    if "-B" in flags:
        env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def stand_in(job: ForkedProcess, signals: Sequence[int]) -> int:
    """Be ``job``'s stand-in: pass ``signals`` on to it, wait for it, and return its status as this process's exit
    code (128 + N for a job that signal N ended), as :mod:`toolkit.testworker` and :mod:`toolkit._forksite` do."""
    for number in signals:
        signal.signal(number, lambda sig, _frame: job.send_signal(sig))
    status = job.wait()  # a signal passed on above interrupts no wait: Python retries the call (PEP 475)
    return status if status >= 0 else 128 - status


def warm() -> None:
    """Start this session's shared server now (``TOOLKIT_TEST_FORK_DIR``; nothing without it): a fixture that starts a
    long-lived ``python -m toolkit ...`` before any test forked (toolkit-webui's server, which then launches runs) has
    it handed over (:func:`attach`) only to a server that runs already."""
    if os.environ.get(SHARED_DIR_VARIABLE):
        run([sys.executable, "-c", "pass"], check=True)


def _request(connection: socket.socket, args: list[str], env: dict[str, str] | None, cwd: str | os.PathLike | None,
             streams: tuple[Any, Any, Any]) -> ForkedProcess:
    """Send the server one job (argv, environment, directory, the three streams) and take its pid."""
    request = json.dumps({"args": args, "env": dict(os.environ if env is None else env),
                          "cwd": os.path.abspath(cwd if cwd is not None else os.getcwd())}).encode()
    fds = [_stream(s, default) for s, default in zip(streams, (0, 1, 2), strict=True)]
    try:
        socket.send_fds(connection, [struct.pack("!Q", len(request)) + request], [fd for fd, _ in fds])
    finally:
        for fd, close in fds:
            if close:
                os.close(fd)
    line = b""
    while not line.endswith(b"\n"):
        chunk = connection.recv(1)
        if not chunk:
            raise RuntimeError(f"the test fork server could not start {args}")
        line += chunk
    return ForkedProcess(args, connection, int(line))


def run(args: Sequence[Any], *, env: dict[str, str] | None = None, cwd: str | os.PathLike | None = None,
        timeout: float | None = None, check: bool = False, capture_output: bool = False, text: bool = False,
        input: str | bytes | None = None, stdout: Any = None, stderr: Any = None) -> subprocess.CompletedProcess:
    """:func:`subprocess.run` for Python command lines, through :func:`popen` (output captured in files)."""
    args = [str(a) for a in args]
    with tempfile.TemporaryDirectory(prefix="toolkit-run-") as tmp:
        files = {}
        if capture_output:
            stdout, stderr = (files.setdefault(n, open(os.path.join(tmp, n), "w+b")) for n in ("out", "err"))  # noqa: SIM115
        stdin = None
        if input is not None:
            stdin = files["in"] = open(os.path.join(tmp, "in"), "w+b")  # noqa: SIM115
            stdin.write(input.encode() if isinstance(input, str) else input)
            stdin.seek(0)
        try:
            process = popen(args, env=env, cwd=cwd, stdin=stdin, stdout=stdout, stderr=stderr)
            try:
                code = process.wait(timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
                raise
            out = err = None
            if capture_output:
                out, err = (files[n].seek(0) or files[n].read() for n in ("out", "err"))
                if text:
                    out, err = out.decode(errors="replace"), err.decode(errors="replace")
        finally:
            for handle in files.values():
                handle.close()
    done = subprocess.CompletedProcess(args, code, out, err)
    if check:
        done.check_returncode()
    return done


# ----------------------------------------------------------------------------- server


def _serve(address: str, preload: list[str], idle: float | None = None) -> None:
    """Import ``preload``, then fork a monitored job per request on ``address``: until the test process that started
    it is gone, or (shared, ``idle`` given) until no job ran and no request came for ``idle`` seconds."""
    import importlib
    import select
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # import-time notices (megatron-core's TE/Apex ones) belong to no test
        for module in preload:
            try:
                importlib.import_module(module)
            except Exception as exc:  # noqa: BLE001 - not installed or broken here: the children import it themselves
                print(f"fork server: not preloaded: {module}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
    import gc

    gc.collect()
    gc.freeze()  # what the server holds stays shared with the children (no copy-on-write from refcount scans)
    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address + ".tmp")
    os.rename(address + ".tmp", address)  # clients connect only once every module is imported
    listener.listen(64)
    last_busy = time.monotonic()
    while idle is not None or os.getppid() == parent:  # an own server ends with its test process
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:  # reap the monitors of finished jobs
                pass
            last_busy = time.monotonic()  # a monitor still runs
        except ChildProcessError:
            pass
        if idle is not None and time.monotonic() - last_busy > idle:
            os.unlink(address)  # a client from now on starts a new server; one that connected before is served below
            while select.select([listener], [], [], 0)[0]:
                _accept(listener)
            break
        if select.select([listener], [], [], 1.0)[0]:
            _accept(listener)
            last_busy = time.monotonic()


def _accept(listener: socket.socket) -> None:
    """Take one request (argv, environment, directory and the three standard streams) and fork its monitor."""
    connection, _ = listener.accept()
    header, fds, _, _ = socket.recv_fds(connection, 8, 3)
    size, body = struct.unpack("!Q", header)[0], b""
    while len(body) < size:
        body += connection.recv(size - len(body))
    if os.fork() == 0:
        listener.close()
        _monitor(connection, json.loads(body), fds)
    connection.close()
    for fd in fds:
        os.close(fd)


def _monitor(connection: socket.socket, request: dict[str, Any], fds: list[int]) -> None:
    """The server's child for one job: forks it, reports its pid, then its exit status and CPU time; kills its
    process group when the client goes away first."""
    import select

    pid = os.fork()
    if pid == 0:
        connection.close()
        _job(request, fds)
    for fd in fds:
        os.close(fd)
    connection.sendall(f"{pid}\n".encode())
    while True:
        done, status, usage = os.wait4(pid, os.WNOHANG)
        if done:
            break
        if select.select([connection], [], [], 0.05)[0] and not connection.recv(1):
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            _, status, usage = os.wait4(pid, 0)
            break
    report = {"code": os.waitstatus_to_exitcode(status), "cpu": usage.ru_utime + usage.ru_stime}
    try:
        connection.sendall(json.dumps(report).encode() + b"\n")
    except OSError:
        pass
    os._exit(0)


def _job(request: dict[str, Any], fds: list[int]) -> None:
    """The forked process: becomes the requested interpreter run, then exits with its status."""
    import importlib
    import io
    import runpy
    import threading

    os.setsid()
    for sig in (signal.SIGTERM, signal.SIGCHLD, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    env, args = request["env"], request["args"]
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(env)
    unbuffered = bool(env.get("PYTHONUNBUFFERED"))
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8", errors="surrogateescape")
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False) if unbuffered else io.BufferedWriter(io.FileIO(1, "w", closefd=False)),
                                  encoding="utf-8", errors="surrogateescape", write_through=unbuffered)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding="utf-8", errors="backslashreplace",
                                  line_buffering=True, write_through=True)
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = sys.stdin, sys.stdout, sys.stderr
    mode, target, rest = (args[1], args[2], args[3:]) if args[1] in ("-m", "-c") else ("", args[1], args[2:])
    first = (os.path.dirname(os.path.realpath(target)) if not mode else os.getcwd() if mode == "-m" else "")
    old_extra = [p for p in _BASE_ENV.get("PYTHONPATH", "").split(os.pathsep) if p]
    extra = [os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [first, *extra, *(p for p in sys.path if p not in old_extra and p)]
    importlib.invalidate_caches()
    tempfile.tempdir = None
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()  # as a fresh interpreter's would be (random reseeds itself at fork)
    if "torch" in sys.modules and env.get("OMP_NUM_THREADS", "").isdigit():
        sys.modules["torch"].set_num_threads(int(env["OMP_NUM_THREADS"]))
    import warnings

    warnings.resetwarnings()
    options = [o for o in env.get("PYTHONWARNINGS", "").split(",") if o]
    if options:
        warnings._processoptions(options)  # what -W / PYTHONWARNINGS do at start-up
    if env.get("PYTHONFAULTHANDLER"):
        import faulthandler

        faulthandler.enable()
    code = 0
    try:
        if mode == "-m":
            sys.argv = [target, *rest]  # runpy puts the module's path in argv[0]
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        elif mode == "-c":
            import types

            sys.argv = ["-c", *rest]
            main = sys.modules["__main__"] = types.ModuleType("__main__")  # not the server's own __main__ (this file)
            main.__builtins__ = __builtins__
            exec(compile(target, "<string>", "exec"), main.__dict__)
        else:
            sys.argv = [target, *rest]
            runpy.run_path(target, run_name="__main__")
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        code = -signal.SIGINT
    except BaseException:  # noqa: BLE001 - what the interpreter does: print the traceback, exit 1
        import traceback

        traceback.print_exc()
        code = 1
    _exit_like_the_interpreter(code, threading)


def _exit_like_the_interpreter(code: int, threading: Any) -> None:
    """Wait for non-daemon threads, run atexit handlers, flush the streams, exit (as ``Py_FinalizeEx``)."""
    try:
        threading._shutdown()
    except Exception:  # noqa: BLE001
        pass
    import atexit as _atexit

    _atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed pipe: nothing left to say
            pass
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code & 0xFF)


if __name__ == "__main__":
    sys.path.pop(0)  # this file's directory (core/toolkit) must not shadow top-level modules
    if len(sys.argv) > 3:  # shared (detached): its pid, for stop_shared and for the client waiting on its start
        pid_file = os.path.join(os.path.dirname(sys.argv[1]), "pid")
        with open(pid_file + ".tmp", "w") as handle:
            handle.write(str(os.getpid()))
        os.replace(pid_file + ".tmp", pid_file)
    _serve(sys.argv[1], [m for m in sys.argv[2].split(",") if m], float(sys.argv[3]) if len(sys.argv) > 3 else None)
