"""A full disk, for real: each write (checkpoint files from safetensors and torch.save, recipe.yaml, an export)
on a small tmpfs ends in the documented one-line message and leaves nothing half-written.

The tmpfs is mounted in a mount namespace of its own (``unshare``), where the CLI then runs: as root, or, for
anybody else, as root of a user namespace (``unshare --user --map-root-user``), so the test needs no privilege
where unprivileged user namespaces are allowed (most Linux hosts); skipped with the reason where neither works."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

FLAGS = ["sft", "--model", "tiny-llama", "--dataset", "demo", "--seq-len", "64", "--micro-batch-size", "2",
         "--max-steps", "2", "--save-every", "1"]
NAMESPACES = (["unshare", "--mount"], ["unshare", "--user", "--map-root-user", "--mount"])

# Runs inside the namespace: mount the disk, prepare it, run toolkit, report what it printed and left on the disk.
DRIVER = r"""
import json, os, subprocess, sys
spec = json.loads(sys.argv[1])
disk = spec["disk"]
subprocess.run(["mount", "-t", "tmpfs", "-o", "size=" + spec["size"], "tmpfs", disk], check=True)
for folder in spec["folders"]:
    os.makedirs(os.path.join(disk, folder))
if spec["fill"]:
    with open(os.path.join(disk, "filler"), "wb") as handle:
        try:
            while True:
                handle.write(b"\0" * 65536)
                handle.flush()
        except OSError:
            pass
done = subprocess.run([sys.executable, "-m", "toolkit", *spec["args"]], capture_output=True, text=True)
left = sorted(os.path.relpath(os.path.join(root, name), disk) for root, folders, files in os.walk(disk)
              for name in folders + files)
print(json.dumps({"rc": done.returncode, "stdout": done.stdout, "stderr": done.stderr, "left": left}))
"""


@pytest.fixture(scope="module")
def namespace(tmp_path_factory) -> list[str]:
    """The ``unshare`` command line under which mounting a tmpfs works here."""
    target = tmp_path_factory.mktemp("probe")
    reasons = []
    for prefix in NAMESPACES:
        try:
            probe = subprocess.run([*prefix, "mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(target)],
                                   capture_output=True, text=True, timeout=60)
        except FileNotFoundError as exc:
            pytest.skip(f"a real full disk needs a tmpfs: {exc}")
        if probe.returncode == 0:
            return prefix
        reasons.append(f"{' '.join(prefix)}: {probe.stderr.strip() or probe.returncode}")
    pytest.skip(f"cannot mount a tmpfs here ({'; '.join(reasons)}): a real full disk needs it")


@pytest.fixture
def on_small_disk(namespace, tmp_path):
    """``on_small_disk(size, *args, fill=False, folders=())``: ``toolkit ARGS`` with a fresh tmpfs of ``size`` at
    the folder it returns as ``disk``; ``{disk}`` in an argument is replaced by that folder."""

    def run(size: str, *args: str, fill: bool = False, folders: tuple[str, ...] = ()) -> tuple[dict, Path]:
        disk = tmp_path / "disk"
        disk.mkdir()
        spec = {"disk": str(disk), "size": size, "fill": fill, "folders": list(folders),
                "args": [str(a).replace("{disk}", str(disk)) for a in args]}
        done = subprocess.run([*namespace, sys.executable, "-c", DRIVER, json.dumps(spec)], capture_output=True,
                              text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.splitlines()[-1]), disk

    return run


def one_line_error(result: dict, expected: str) -> None:
    assert result["rc"] == 1, result["stderr"][-3000:]
    assert "Traceback" not in result["stderr"] + result["stdout"], result["stderr"][-3000:]
    assert expected in result["stderr"], result["stderr"][-3000:]


# model.safetensors (about 2 MB) is written first, by safetensors; then optimizer.pt (about 4 MB), by torch.save
@pytest.mark.parametrize("size,raised", [("1m", "SafetensorError"), ("3m", "RuntimeError")])
def test_a_checkpoint_on_a_full_disk_stops_with_the_message(on_small_disk, size, raised):
    result, disk = on_small_disk(size, *FLAGS, "--output", "{disk}/run")
    one_line_error(result, f"Error: the disk is full: checkpoint step-1 could not be written to {disk / 'run' / 'checkpoints'}")
    assert "there is no earlier checkpoint" in result["stderr"] and "--resume auto" in result["stderr"]
    assert f"({raised}: " in result["stderr"]
    assert not [p for p in result["left"] if p.startswith("run/checkpoints/")], "the unfinished checkpoint must be removed"


def test_a_full_disk_at_recipe_yaml_leaves_no_temporary_file(on_small_disk):
    result, disk = on_small_disk("256k", *FLAGS, "--output", "{disk}/run", fill=True, folders=("run",))
    one_line_error(result, f"Error: cannot write {disk / 'run' / 'recipe.yaml'} (the disk is full")
    assert result["left"] == ["filler", "run"]


def test_an_export_to_a_full_disk_leaves_nothing_behind(on_small_disk):
    result, disk = on_small_disk("1m", "export", "tiny-llama", "--to", "hf", "--output", "{disk}/out")
    one_line_error(result, f"Error: the export to {disk / 'out'} could not be written (the disk is full")
    assert result["left"] == []
