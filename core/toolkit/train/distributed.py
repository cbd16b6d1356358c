"""Process-group setup from torchrun's environment, a clean exit for gloo jobs, and the watchdog
that ends a job whose peer died or hung (naming the rank and the last collective)."""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class World:
    rank: int
    local_rank: int
    world_size: int
    device: object

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


_WORLD: World | None = None


def init_world(timeout: float | None = None) -> World:
    """Initialise torch.distributed when launched by torchrun (gloo on CPU, NCCL on GPU).

    ``timeout`` (seconds, ``--dist-timeout``) bounds how long a collective of a training step waits for the
    others (the watchdog sets it when it arms). Until then, and while a checkpoint is written, collectives
    wait up to :data:`STARTUP_TIMEOUT` at least: ranks that import, load or write at different speeds
    (a loaded machine, rank 0 materialising a preset the others wait for) are not a failure.
    """
    global _WORLD
    if _WORLD is not None:
        return _WORLD
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if world_size > 1 and not dist.is_initialized():
        if timeout:
            timeout = max(timeout, STARTUP_TIMEOUT) if _set_timeout_available() else timeout
        kwargs = {"timeout": timedelta(seconds=timeout)} if timeout else {}
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", **kwargs)
    _WORLD = World(rank=rank, local_rank=local_rank, world_size=world_size, device=device)
    return _WORLD


STARTUP_TIMEOUT = float(os.environ.get("TOOLKIT_DIST_STARTUP_TIMEOUT", "600"))
"""Seconds a collective outside a training step (start-up, checkpoint writes) may wait, when that is longer
than ``--dist-timeout``."""


def _set_timeout_available() -> bool:
    from torch.distributed import distributed_c10d

    return hasattr(distributed_c10d, "_set_pg_timeout")


def set_collective_timeout(seconds: float) -> None:
    """How long the default process group's collectives wait from now on (no-op on one process)."""
    from datetime import timedelta

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and _set_timeout_available():
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=seconds))


def one_process_group(device: Any = None) -> bool:
    """A process group of this process alone (an in-memory store, no port), where none exists yet.

    For engines that need one even on one process (FSDP2, Megatron-Core's parallel state) and the
    one-process exporters. NCCL when ``device`` is a GPU, since collectives on CUDA tensors need it
    (gloo's ``allreduce_coalesced`` refuses them), gloo otherwise. Returns whether it made the group
    (the caller then destroys it when done).
    """
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return False
    cuda = device is not None and torch.device(device).type == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    return True


def all_reduce_sum(values: list[float], device: object = None, name: str = "all_reduce_sum") -> list[float]:
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return list(values)
    note_collective(name)
    tensor = torch.tensor(values, dtype=torch.float64, device=device or "cpu")
    dist.all_reduce(tensor)
    return tensor.tolist()


def read_step_values(summed: list[Any], kept: list[Any], device: Any) -> list[float]:
    """``summed`` all-reduced over ranks, then ``kept`` as they are, read to the host in one synchronisation.

    Items are device tensors (0-dim) or Python numbers; engines call this once per step, after the
    step's work is queued, so the GPU never idles waiting for the host in the middle of a step.
    """
    import torch
    import torch.distributed as dist

    def on_device(values: list[Any]) -> Any:
        numbers = torch.tensor([0.0 if torch.is_tensor(v) else float(v) for v in values], dtype=torch.float64)
        if device is not None and torch.device(device).type == "cuda":
            numbers = numbers.pin_memory().to(device, non_blocking=True)
        tensors = [v.detach().reshape(()).to(device=numbers.device, dtype=torch.float64) if torch.is_tensor(v)
                   else numbers.new_zeros(()) for v in values]
        return (torch.stack(tensors) + numbers) if values else numbers

    reduced = on_device(summed)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 and summed:
        note_collective("read_step_values (the step's loss and metrics)")
        dist.all_reduce(reduced)
    return torch.cat([reduced, on_device(kept)]).tolist()


def barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        note_collective("barrier")
        dist.barrier()


def shutdown(exit_code: int | None = None) -> None:
    """Tear down the process group; under torchrun, exit hard so gloo threads cannot abort at exit."""
    import torch.distributed as dist

    global _WORLD
    distributed = dist.is_available() and dist.is_initialized()
    if distributed:
        try:
            dist.barrier()
        finally:
            dist.destroy_process_group()
    _WORLD = None
    if distributed and exit_code is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(exit_code)


# ----------------------------------------------------------------------------- watchdog

PROGRESS_KEY = "toolkit/progress/rank{}"


class Watchdog:
    """Ends this process when what it is doing (a training step and its collectives) makes no
    progress within ``timeout`` seconds, printing the rank, the last collective and what every
    other rank last reported through the process group's store.

    Gloo and NCCL raise on the rank that waits for a dead or hung peer; this covers the rank that
    hangs itself (outside a collective too), so the whole job ends without relying on the launcher.
    """

    def __init__(self, timeout: float, rank: int, world_size: int):
        self.timeout, self.rank, self.world_size = timeout, rank, world_size
        # A grace period past the collectives' own timeout: a rank waiting on a hung peer reports
        # its failed collective first; the hung rank ends itself a little later.
        self.limit = timeout + max(5.0, 0.1 * timeout)
        self.last_collective = "none yet"
        self.activity = "start-up"
        self._deadline: float | None = None
        self._thread: threading.Thread | None = None

    def arm(self, activity: str) -> None:
        if self._deadline is None:  # a step's collectives wait --dist-timeout; start-up's and a save's longer
            set_collective_timeout(self.timeout)
        self.activity = activity
        self._deadline = time.monotonic() + self.limit
        self.report()
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="toolkit-watchdog", daemon=True)
            self._thread.start()

    def disarm(self) -> None:
        if self._deadline is not None:
            set_collective_timeout(max(self.timeout, STARTUP_TIMEOUT))
        self._deadline = None

    def note(self, collective: str) -> None:
        self.last_collective = f"{collective} during {self.activity}"
        self.report()

    def report(self) -> None:
        """Publish this rank's progress (best effort: a store that is gone must not end the run)."""
        store = _store()
        if store is not None:
            try:
                store.set(PROGRESS_KEY.format(self.rank), json.dumps({"activity": self.activity, "collective": self.last_collective,
                                                                      "time": time.time()}))
            except Exception:
                pass

    def describe_failure(self, what: str) -> str:
        return (f"rank {self.rank}: {what} (--dist-timeout {self.timeout:g}s). Last collective on this rank: "
                f"{self.last_collective}.\n{peer_report(self.rank, self.world_size)}")

    def _watch(self) -> None:
        while True:
            time.sleep(min(1.0, self.limit / 20))
            deadline = self._deadline
            if deadline is not None and time.monotonic() > deadline:
                message = self.describe_failure(f"{self.activity} made no progress for {self.limit:g}s")
                print(f"toolkit: error: {message}\nEnding the job: a rank that is dead or hung would otherwise keep "
                      "every other rank waiting.", file=sys.stderr)
                sys.stderr.flush()
                os._exit(1)


_WATCHDOG: Watchdog | None = None


def start_watchdog(timeout: float) -> Watchdog | None:
    """The process-wide watchdog of a distributed run (None on one process)."""
    global _WATCHDOG
    world = init_world()
    if not world.distributed:
        return None
    if _WATCHDOG is None:
        _WATCHDOG = Watchdog(timeout, world.rank, world.world_size)
    return _WATCHDOG


def note_collective(name: str) -> None:
    if _WATCHDOG is not None:
        _WATCHDOG.note(name)


def _store() -> object | None:
    try:
        from torch.distributed import distributed_c10d

        return distributed_c10d._get_default_store()
    except Exception:
        return None


def peer_report(rank: int, world_size: int) -> str:
    """What each other rank last published, oldest first: the first lines name the rank that stopped."""
    store = _store()
    rows = []
    for other in range(world_size):
        if other == rank:
            continue
        key = PROGRESS_KEY.format(other)
        try:
            state = json.loads(store.get(key)) if store is not None and store.check([key]) else None
        except Exception:
            state = None
        if state is None:
            rows.append((0.0, f"  rank {other}: no report (dead before its first step, or the store is gone)"))
        else:
            age = time.time() - state["time"]
            rows.append((state["time"], f"  rank {other}: last seen {age:.0f}s ago in {state['activity']}; "
                                        f"last collective: {state['collective']}"))
    return "Other ranks:\n" + "\n".join(text for _, text in sorted(rows))


def end_if_peer_lost(exc: BaseException) -> None:
    """When ``exc`` is a collective that failed because a peer died or hung, print which rank and
    collective, and exit now: a teardown would wait on the lost peer. Otherwise return."""
    if _WATCHDOG is None or not is_collective_failure(exc):
        return
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    message = _WATCHDOG.describe_failure(f"a collective failed during {_WATCHDOG.activity}: {first}")
    print(f"toolkit: error: {message}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


def is_collective_failure(exc: BaseException) -> bool:
    """A peer closed the connection or a collective timed out (gloo/NCCL), rather than a bug here."""
    import torch.distributed as dist

    if isinstance(exc, dist.DistError):
        return True
    text = str(exc).lower()
    # Gloo words a peer's timeout differently depending on where it waited ("Timed out waiting ...",
    # "Application timeout caused pair closure", "Socket Timeout"), so match the words, not whole messages.
    return isinstance(exc, RuntimeError) and any(
        marker in text for marker in ("connection closed by peer", "connection reset by peer", "timed out", "timeout",
                                      "pair closure", "broken pipe", "nccl communicator was aborted"))


def _ephemeral_ports() -> range:
    """The kernel's range for outgoing connections' local ports (Linux; the usual default elsewhere)."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999
    return range(low, high + 1)


def free_port() -> int:
    """A free TCP port for a rendezvous, chosen at random below the ephemeral range.

    A port the kernel hands out (``bind(("", 0))``) is in the ephemeral range, where any process's
    next outgoing connection can take it between this call and the rendezvous binding it
    (EADDRINUSE in CI on a busy machine); a random port outside that range can only be taken by
    another caller that picks the same one.
    """
    import random

    ephemeral = _ephemeral_ports()
    for _ in range(200):
        port = random.randrange(20000, 32768)
        if port in ephemeral:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
