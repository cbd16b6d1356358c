"""Run an inference engine's HTTP server as a child process: start it in its own process group,
wait until it answers, print the URL, and end the whole process tree on Ctrl-C or SIGTERM.

Shared by the serving backends (``vllm``, ``lmdeploy``); they only build the command line.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from toolkit.errors import ToolkitError


class ServeError(ToolkitError):
    """The server did not start, or stopped before it answered."""


@dataclass
class ServerCommand:
    """What a backend hands the runner: the argv, extra environment and where to knock."""

    argv: list[str]
    host: str
    port: int
    env: dict[str, str] = field(default_factory=dict)
    ready_paths: tuple[str, ...] = ("/health", "/v1/models")
    name: str = "server"

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}"

    def shell(self) -> str:
        """The command as one line a person can paste (environment first)."""
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items()))
        return (env + " " if env else "") + shlex.join(self.argv)


def answers(url: str, paths: Sequence[str], timeout: float = 2.0) -> bool:
    """True when any of ``paths`` under ``url`` returns HTTP 200."""
    for path in paths:
        try:
            with urllib.request.urlopen(url + path, timeout=timeout) as response:  # noqa: S310 - local URL
                if response.status == 200:
                    return True
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            continue
    return False


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def group_alive(pgid: int) -> bool:
    """True while a live (not zombie) process remains in process group ``pgid``."""
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            return True
    return False


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop_process_tree(process: subprocess.Popen, grace_s: float = 15.0) -> None:
    """SIGTERM the child's whole process group, wait, then SIGKILL whatever is left of it.

    The group is signalled even when the server itself already exited: engine workers can
    outlive it.
    """
    _signal_group(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    deadline = time.monotonic() + grace_s
    while group_alive(process.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if group_alive(process.pid):
        _signal_group(process.pid, signal.SIGKILL)
    if process.poll() is None:
        process.kill()
        process.wait()


class RunningServer:
    """A started server; use as a context manager so the tree always ends."""

    def __init__(self, command: ServerCommand, log_path: Path | None = None):
        self.command = command
        self.log_path = log_path or Path(tempfile.mkstemp(prefix=f"toolkit-{_slug(command.name)}-", suffix=".log")[1])
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        env = {**os.environ, **command.env}
        self.process = subprocess.Popen(command.argv, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, start_new_session=True)

    def wait_ready(self, timeout_s: float, poll_s: float = 0.5) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            code = self.process.poll()
            if code is not None:
                raise ServeError(f"{self.command.name} exited with code {code} before answering.\n"
                                 f"command: {self.command.shell()}\nlast lines of {self.log_path}:\n{_tail(self.log_path)}")
            if answers(self.command.url, self.command.ready_paths):
                return
            time.sleep(poll_s)
        self.stop()
        raise ServeError(f"{self.command.name} did not answer on {self.command.url} within {timeout_s:.0f} s "
                         f"(raise the backend's startup_timeout_s).\ncommand: {self.command.shell()}\n"
                         f"last lines of {self.log_path}:\n{_tail(self.log_path)}")

    def stop(self) -> None:
        stop_process_tree(self.process)
        self._log.close()

    def __enter__(self) -> RunningServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve_forever(command: ServerCommand, *, startup_timeout_s: float = 600.0,
                  echo: Callable[[str], None] | None = None) -> int:
    """Start the server, print its URL once it answers, block until it exits or we are told to stop.

    SIGTERM and Ctrl-C end the whole process tree. Returns the server's exit code (0 when we
    stopped it).
    """
    echo = echo or (lambda line: print(line, flush=True))
    echo(f"starting {command.name}: {command.shell()}")
    stopping = {"signal": None}

    def on_signal(signum: int, _frame: object) -> None:
        stopping["signal"] = signum
        raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    server = None
    try:
        server = RunningServer(command)
        echo(f"log: {server.log_path}")
        server.wait_ready(startup_timeout_s)
        echo(f"{command.name} is ready: {command.url}/v1 (OpenAI-compatible; Ctrl-C stops it)")
        code = server.process.wait()
        raise ServeError(f"{command.name} exited with code {code}.\nlast lines of {server.log_path}:\n{_tail(server.log_path)}")
    except KeyboardInterrupt:
        echo(f"stopping {command.name}")
        return 0
    finally:
        if server is not None:
            server.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        sys.stdout.flush()


def split_extra(config: object, extra: dict[str, str] | Sequence[str] | None) -> tuple[object, dict[str, str]]:
    """Apply ``KEY=VALUE`` options that name fields of ``config``; return the rest untouched.

    Backends pass the rest through to the engine as ``--key value`` flags, so every engine
    option stays reachable without a second list of flags here.
    """
    import dataclasses

    from toolkit.config import build_dataclass, to_dict

    items = dict(extra or {}) if not isinstance(extra, (list, tuple)) else parse_pairs(extra)
    names = {f.name for f in dataclasses.fields(config)}
    mine = {k.replace("-", "_"): v for k, v in items.items() if k.replace("-", "_") in names}
    rest = {k: v for k, v in items.items() if k.replace("-", "_") not in names}
    if not mine:
        return config, rest
    problems: list[str] = []
    updated = build_dataclass(type(config), {**to_dict(config), **mine}, "--option", problems)
    if problems:
        from toolkit.errors import ConfigError

        raise ConfigError(problems)
    return updated, rest


def parse_pairs(pairs: Sequence[str]) -> dict[str, str]:
    """``--option KEY=VALUE`` items as a dict; a malformed item is an error naming it."""
    from toolkit.config import parse_pairs as pairs_of

    try:
        return pairs_of(pairs, "--option max-model-len=2048")
    except ValueError as exc:
        raise ServeError(f"--option: {exc}") from None


def engine_flags(options: dict[str, str]) -> list[str]:
    """``{"max-model-len": "512", "enable-prefix-caching": "true"}`` -> engine command-line flags."""
    flags: list[str] = []
    for key, value in options.items():
        flag = "--" + key.lstrip("-").replace("_", "-")
        if str(value).lower() in ("true", ""):
            flags.append(flag)
        elif str(value).lower() == "false":
            continue
        else:
            flags += [flag, str(value)]
    return flags


def option_value(options: object, name: str, default: object) -> object:
    """Read a generation option from a dataclass, namespace or dict (``None`` -> ``default``)."""
    value = options.get(name) if isinstance(options, dict) else getattr(options, name, None)
    return default if value is None else value


def _slug(name: str) -> str:
    """``"vLLM server"`` -> ``"vllm-server"``: a file-name part with no spaces to quote."""
    import re

    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "server"
