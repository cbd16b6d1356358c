#!/usr/bin/env python
"""Kill test: SIGKILL a training run at random moments (many aimed inside checkpoint writes), resume it with
``--resume auto`` until it finishes, and check that its final weights and per-step losses are bit-identical
to an uninterrupted run of the same command.

    python scripts/kill_test.py --mode local --kills 20 --seed 0
    python scripts/kill_test.py --mode megatron-tp2 --kills 10 --seed 0     # needs toolkit-megatron

``--corrupt-every K`` flips one byte in the newest checkpoint after every K-th kill: the next resume must
name it and fall back to the one before. ``--disk-full-round R`` makes round R's second checkpoint write fail
with ENOSPC on the last rank: the run must stop with "the disk is full" and leave the previous checkpoint
whole. Prints a summary; ``--json FILE`` (or $OUT/kill_test.json) also writes it as JSON. Exit status 0
only when every check held. The script is also its own child (``--child``): it installs the injection
hooks (slow checkpoint writes so kills can land inside them, ENOSPC) and runs the toolkit CLI.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

SCRIPT = Path(__file__).resolve()
MOMENTS = ("startup", "training", "write")
MOMENT_WEIGHTS = (1, 3, 6)


# ---------------------------------------------------------------------------------------------- child side
def child_main(argv: list[str]) -> None:
    """Run the toolkit CLI with the hooks the parent asked for through the environment."""
    import toolkit.train.checkpoint as checkpoint

    slow = float(os.environ.get("KILL_TEST_SLOW_SAVE", "0"))
    disk_full_at = int(os.environ.get("KILL_TEST_DISK_FULL", "0"))  # this process's N-th checkpoint write fails
    hold_at = os.environ.get("KILL_TEST_HOLD_AT", "")  # a killed round never finishes: it waits in this write for its kill
    saves = []
    write_rank_files, write_manifest = checkpoint.write_rank_files, checkpoint.write_manifest

    def slowed_rank_files(staging, engine):
        time.sleep(slow)
        while staging.name == hold_at:
            time.sleep(1)
        write_rank_files(staging, engine)
        time.sleep(slow)
        saves.append(staging.name)
        rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
        if len(saves) == disk_full_at and rank == world - 1:  # the files are written; the disk "fills up" on the last
            import errno

            raise OSError(errno.ENOSPC, "No space left on device (injected by kill_test.py)")

    def slowed_manifest(directory):
        time.sleep(slow)
        manifest = write_manifest(directory)
        time.sleep(slow)
        return manifest

    checkpoint.write_rank_files, checkpoint.write_manifest = slowed_rank_files, slowed_manifest
    from toolkit.cli import main

    main(argv)


# ---------------------------------------------------------------------------------------------- parent side
def command(mode: str, run_dir: Path, args: argparse.Namespace) -> tuple[list[str], int]:
    """The child's arguments (after ``python``) and its number of ranks."""
    flags = ["sft", "--model", "tiny-llama", "--dataset", "demo", "--seq-len", "64", "--lr", "1e-3",
             "--max-steps", str(args.steps), "--save-every", str(args.save_every), "--keep-last", "2",
             "--micro-batch-size", "2", "--global-batch-size", "4", "--log-every", "1", "--export", "hf",
             "--output", str(run_dir), "--resume", "auto"]
    if mode == "local":
        return [str(SCRIPT), "--child", *flags], 1
    return [str(SCRIPT), "--child", *flags, "--strategy", "megatron", "--tp", "2"], 2


def start(child: tuple[list[str], int], log: Path, env: dict[str, str], fork: bool) -> subprocess.Popen:
    """``python`` (under ``torchrun`` for several ranks) with the child's arguments; with ``fork``, forked from
    toolkit.forkserver's server (torch imported once, not in every round; ranks started as torchrun would)."""
    args, nproc = child
    with log.open("w") as handle:
        if fork and nproc == 1:
            from toolkit import forkserver

            return forkserver.popen([sys.executable, *args], env=env, stdin=subprocess.DEVNULL, stdout=handle,
                                    stderr=handle)
        if fork:
            from toolkit.testing import popen_ranks

            return popen_ranks(args, nproc, env=env, stdout=handle, stderr=handle)
        launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"] if nproc > 1 else []
        return subprocess.Popen([sys.executable, *launcher, *args], stdout=handle, stderr=subprocess.STDOUT, env=env)


def kill_tree(process: subprocess.Popen) -> None:
    """SIGKILL the launcher and every descendant at once, as a scheduler killing a job's cgroup does.

    torchrun starts its workers in sessions of their own, so killing its process group would leave them
    running: stop the whole tree first (nothing can move on while we look), then kill all of it."""
    roots = set(getattr(process, "pids", [process.pid]))  # popen_ranks: every rank's process
    stopped: set[int] = set()
    while True:
        tree = set().union(roots, *map(_descendants, roots))
        fresh = tree - stopped
        if not fresh:
            break
        for pid in fresh:
            _signal(pid, signal.SIGSTOP)
        stopped |= fresh
    for pid in stopped:
        _signal(pid, signal.SIGKILL)
    process.wait()
    deadline = time.monotonic() + 30
    while any(_alive(pid) for pid in stopped) and time.monotonic() < deadline:
        time.sleep(0.02)


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def _alive(pid: int) -> bool:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry.name))
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def wait_for(predicate, process: subprocess.Popen, timeout: float, poll: float = 0.005) -> bool:
    """True once ``predicate()`` holds; False when the process ended first or the time ran out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        if process.poll() is not None:
            return False
        time.sleep(poll)
    return False


def training_started(run_dir: Path, since: float):
    metrics = run_dir / "metrics.jsonl"
    return lambda: metrics.is_file() and metrics.stat().st_mtime > since and metrics.stat().st_size > 0


def staging_created(run_dir: Path, since: float, count: int):
    """True once this round's process has made ``count`` ``.tmp-step-N`` folders (one left by a killed round is older)."""
    root = run_dir / "checkpoints"
    seen: set[str] = set()

    def present() -> bool:
        try:
            seen.update(p.name for p in root.iterdir() if p.name.startswith(".tmp-step-") and p.stat().st_ctime > since)
        except OSError:  # renamed or removed while we looked
            pass
        return len(seen) >= count

    return present


def resumed_step(log: Path) -> int:
    match = re.search(r"resumed from \S+ at step (\d+)", log.read_text())
    return int(match.group(1)) if match else 0


def sleep_while_alive(process: subprocess.Popen, seconds: float) -> bool:
    wait_for(lambda: False, process, seconds)
    return process.poll() is None


def leftovers(run_dir: Path, since: float = 0.0) -> list[str]:
    """Dot-folders in checkpoints/ (changed after ``since``): what a killed or failed save left behind."""
    root = run_dir / "checkpoints"
    return sorted(p.name for p in root.iterdir() if p.name.startswith(".") and p.stat().st_ctime > since) if root.is_dir() else []


def whole_checkpoints(run_dir: Path) -> int:
    from toolkit.train.checkpoint import list_checkpoints

    try:
        return len(list_checkpoints(run_dir))
    except OSError:  # a folder renamed or pruned while it was listed
        return 0


def corrupt_newest(run_dir: Path, rng: random.Random) -> Path | None:
    """Flip one byte in the biggest file of the newest whole checkpoint (the size stays the same)."""
    from toolkit.train.checkpoint import list_checkpoints

    found = list_checkpoints(run_dir)
    if len(found) < 2:  # damaging the only whole checkpoint is refused at resume (nothing to fall back to)
        return None
    files = sorted((p for p in found[-1].rglob("*") if p.is_file() and p.name != "manifest.json"), key=lambda p: p.stat().st_size)
    target = files[-1]
    data = bytearray(target.read_bytes())
    data[rng.randrange(len(data))] ^= 0xFF
    target.write_bytes(bytes(data))
    return found[-1]


def compare(reference: Path, run_dir: Path) -> dict[str, object]:
    """Bit-for-bit: every exported tensor, and loss/grad_norm of every step."""
    import torch
    from safetensors.torch import load_file

    expected = load_file(str(reference / "export" / "model.safetensors"))
    got = load_file(str(run_dir / "export" / "model.safetensors"))
    same_keys = expected.keys() == got.keys()
    differing = [k for k in expected if k not in got or not torch.equal(expected[k], got[k])]
    lines = lambda path: [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    ref_metrics, run_metrics = lines(reference), lines(run_dir)
    same_steps = [m["step"] for m in ref_metrics] == [m["step"] for m in run_metrics]
    same_metrics = same_steps and all(a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"]
                                      for a, b in zip(ref_metrics, run_metrics))
    return {"tensors": len(expected), "tensors_differing": len(differing), "bit_identical": same_keys and not differing,
            "metrics_identical": same_metrics, "steps_logged": len(run_metrics)}


def run_kill_test(args: argparse.Namespace) -> dict[str, object]:
    rng = random.Random(args.seed)
    work = Path(args.workdir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "PYTHONWARNINGS": "ignore"}
    began = time.monotonic()
    reference, run_dir = work / "reference", work / "killed"
    started = time.monotonic()
    # slowed like the killed rounds (it changes no number), so its timing tells where kills can land
    process = start(command(args.mode, reference, args), work / "reference.log", {**env, "KILL_TEST_SLOW_SAVE": str(args.slow_save)},
                    args.fork)
    saw_training = wait_for(training_started(reference, time.time() - 1), process, args.timeout, poll=0.01)
    first_step_at = time.monotonic() - started
    if process.wait(timeout=args.timeout) != 0 or not saw_training:
        raise SystemExit(f"the uninterrupted run failed; see {work / 'reference.log'}")
    train_time = max(time.monotonic() - started - first_step_at, 1.0)

    summary: dict[str, object] = {"mode": args.mode, "seed": args.seed, "steps": args.steps, "save_every": args.save_every,
                                  "rounds": 0, "kills": 0, "kills_by_moment": dict.fromkeys(MOMENTS, 0),
                                  "kills_with_staging_left": 0, "kills_during_publish": 0, "corrupted": [],
                                  "damaged_detected": 0, "disk_full_rounds": 0, "disk_full_handled": 0, "failures": [], "events": []}
    failures: list[str] = summary["failures"]  # type: ignore[assignment]
    pending_damaged: Path | None = None
    finished = False
    kills, round_index = 0, 0
    while not finished and kills < args.kills:
        round_index += 1
        log = work / f"round-{round_index:03d}.log"
        disk_full = round_index == args.disk_full_round
        child_env = {**env, "KILL_TEST_SLOW_SAVE": str(args.slow_save), "KILL_TEST_DISK_FULL": "2" if disk_full else "0",
                     # a busy machine must not let a round run to its end before its kill lands (the count of
                     # kills would then depend on timing): the killed rounds wait inside the last checkpoint write
                     "KILL_TEST_HOLD_AT": "" if disk_full else f".tmp-step-{args.steps}"}
        since = time.time()
        process = start(command(args.mode, run_dir, args), log, child_env, args.fork)
        summary["rounds"] += 1  # type: ignore[operator]
        if disk_full:
            code = process.wait(timeout=args.timeout)
            text = log.read_text()
            if code == 0:  # fewer than two checkpoint writes were left in the run
                finished = True
                break
            summary["disk_full_rounds"] += 1  # type: ignore[operator]
            ok = code not in (0, -9) and "the disk is full" in text and not any(n.startswith(".tmp") for n in leftovers(run_dir))
            summary["disk_full_handled"] += int(ok)  # type: ignore[operator]
            if not ok:
                failures.append(f"round {round_index}: disk-full run exited {code} without the expected error; see {log}")
            pending_damaged = _check_damaged(text, pending_damaged, summary)
            continue
        moment = rng.choices(MOMENTS, weights=MOMENT_WEIGHTS)[0]
        # the kill after which a checkpoint is damaged waits for a second whole one (damaging the only one is
        # refused at resume), so how many are injected never depends on how fast this machine runs
        corrupt_due = bool(args.corrupt_every) and (kills + 1) % args.corrupt_every == 0 and pending_damaged is None
        if corrupt_due and moment == "startup":
            moment = "training"
        if moment == "startup":
            alive = sleep_while_alive(process, rng.uniform(0.2, first_step_at))
        else:
            alive = wait_for(training_started(run_dir, since), process, args.timeout, poll=0.01)
            if corrupt_due:
                alive = alive and wait_for(lambda: whole_checkpoints(run_dir) >= 2, process, args.timeout, poll=0.05)
            # spread the kills over the run: on average each round gets 1/(kills left) of the way that remains
            remaining = (args.steps - resumed_step(log)) / args.steps
            share = min(0.9, 2 * remaining / (args.kills - kills))
            if alive and moment == "training":
                alive = sleep_while_alive(process, rng.uniform(0, share * train_time))
            elif alive:  # the k-th checkpoint write of this round; its staging folder lives about 4 x --slow-save
                writes_left = max(1, round(remaining * args.steps / args.save_every))
                writes = min(writes_left, 1 + round(share * args.steps / args.save_every))
                alive = wait_for(staging_created(run_dir, since, rng.randint(1, writes)), process, args.timeout) and \
                    sleep_while_alive(process, rng.uniform(0, 4.4 * args.slow_save))
        if not alive:
            code = process.wait(timeout=args.timeout)
            text = log.read_text()
            pending_damaged = _check_damaged(text, pending_damaged, summary)
            if code != 0:
                failures.append(f"round {round_index}: exited {code} on its own; see {log}")
                break
            finished = True
            break
        kill_tree(process)
        kills += 1
        summary["kills"] = kills
        summary["kills_by_moment"][moment] += 1  # type: ignore[index]
        left = leftovers(run_dir, since)  # made by this round: an older one is a previous round's
        summary["kills_with_staging_left"] += int(any(n.startswith(".tmp-") for n in left))  # type: ignore[operator]
        summary["kills_during_publish"] += int(any(n.startswith(".del-") for n in left))  # type: ignore[operator]
        pending_damaged = _check_damaged(log.read_text(), pending_damaged, summary)
        summary["events"].append({"round": round_index, "moment": moment, "left": left,  # type: ignore[union-attr]
                                  "checkpoints": [p.name for p in (run_dir / "checkpoints").glob("step-*")] if (run_dir / "checkpoints").is_dir() else []})
        if args.corrupt_every and kills % args.corrupt_every == 0 and pending_damaged is None:
            pending_damaged = corrupt_newest(run_dir, rng)
            if pending_damaged is not None:
                summary["corrupted"].append(pending_damaged.name)  # type: ignore[union-attr]
    if not failures and not finished:  # the last round runs to the end, untouched
        log = work / "final.log"
        process = start(command(args.mode, run_dir, args), log, env, args.fork)
        code = process.wait(timeout=args.timeout)
        summary["rounds"] += 1  # type: ignore[operator]
        pending_damaged = _check_damaged(log.read_text(), pending_damaged, summary)
        if code != 0:
            failures.append(f"the final run exited {code}; see {log}")
    if pending_damaged is not None:
        failures.append(f"the damaged checkpoint {pending_damaged} was never reported by a resume")
    if not failures:
        summary.update(compare(reference, run_dir))
        if not (summary["bit_identical"] and summary["metrics_identical"]):
            failures.append("the resumed run differs from the uninterrupted one")
    summary["seconds"] = round(time.monotonic() - began, 1)
    summary["passed"] = not failures
    return summary


def _check_damaged(text: str, pending: Path | None, summary: dict[str, object]) -> Path | None:
    if pending is not None and f"skipping damaged checkpoint {pending}:" in text:
        summary["damaged_detected"] += 1  # type: ignore[operator]
        return None
    return pending


def print_summary(summary: dict[str, object]) -> None:
    moments = summary["kills_by_moment"]
    print(f"kill test ({summary['mode']}, seed {summary['seed']}, {summary['steps']} steps, a checkpoint every "
          f"{summary['save_every']}): {summary['rounds']} rounds, {summary['kills']} kills "
          f"({', '.join(f'{k} {v}' for k, v in moments.items())}), {summary['kills_with_staging_left']} left a "  # type: ignore[union-attr]
          f"staging folder (killed during a checkpoint write), {summary['kills_during_publish']} during rename/prune")
    print(f"damaged checkpoints injected {len(summary['corrupted'])}, detected and skipped {summary['damaged_detected']}; "  # type: ignore[arg-type]
          f"disk-full rounds {summary['disk_full_rounds']}, handled {summary['disk_full_handled']}")
    if "bit_identical" in summary:
        print(f"final weights bit-identical to the uninterrupted run: {'yes' if summary['bit_identical'] else 'NO'} "
              f"({summary['tensors']} tensors, {summary['tensors_differing']} differ); per-step loss and grad_norm "
              f"identical: {'yes' if summary['metrics_identical'] else 'NO'} ({summary['steps_logged']} steps)")
    for failure in summary["failures"]:  # type: ignore[union-attr]
        print(f"FAILED: {failure}")
    print(f"{'PASSED' if summary['passed'] else 'FAILED'} in {summary['seconds']} s")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child_main(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=("local", "megatron-tp2"), default="local")
    parser.add_argument("--kills", type=int, default=10, help="SIGKILLs before the run is let finish")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--save-every", type=int, default=2)
    parser.add_argument("--slow-save", type=float, default=0.1,
                        help="seconds each slowed phase of a checkpoint write sleeps, so kills can land inside it")
    parser.add_argument("--corrupt-every", type=int, default=0, help="flip a byte in the newest checkpoint after every K-th kill")
    parser.add_argument("--disk-full-round", type=int, default=0, help="round whose second checkpoint write fails with ENOSPC (on the last rank)")
    parser.add_argument("--fork", action="store_true",
                        help="fork every run from one process that imported torch once (toolkit.forkserver; the tests), "
                             "ranks started as torchrun would, instead of a fresh python/torchrun per round")
    parser.add_argument("--workdir", default="kill-test")
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--json", default=os.path.join(os.environ["OUT"], "kill_test.json") if os.environ.get("OUT") else None)
    args = parser.parse_args()
    summary = run_kill_test(args)
    print_summary(summary)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
    sys.exit(0 if summary["passed"] else 1)


if __name__ == "__main__":
    main()
