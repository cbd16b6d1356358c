"""A full disk, for real: each write (checkpoint files from safetensors and torch.save, recipe.yaml, an export)
on a small tmpfs ends in the documented one-line message and leaves nothing half-written.

Needs permission to mount a tmpfs (root, as in this project's CI containers); skipped where mount fails."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

FLAGS = ["sft", "--model", "tiny-llama", "--dataset", "demo", "--seq-len", "64", "--micro-batch-size", "2",
         "--max-steps", "2", "--save-every", "1"]


@pytest.fixture
def small_disk(tmp_path):
    """``small_disk(size)`` mounts a tmpfs of that size ("1m") and returns its folder; unmounted after the test."""
    mounted = []

    def mount(size: str) -> Path:
        folder = tmp_path / f"disk-{len(mounted)}"
        folder.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip() or done.returncode}): a real full disk needs it")
        mounted.append(folder)
        return folder

    yield mount
    for folder in mounted:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def fill(folder: Path) -> None:
    """Write until the disk is full."""
    with open(folder / "filler", "wb") as handle:
        try:
            while True:
                handle.write(b"\0" * 65536)
                handle.flush()
        except OSError:
            pass


def one_line_error(result, expected: str) -> None:
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output and result.exception is None, result.output
    assert expected in result.stderr, result.stderr


# model.safetensors (about 2 MB) is written first, by safetensors; then optimizer.pt (about 4 MB), by torch.save
@pytest.mark.parametrize("size,raised", [("1m", "SafetensorError"), ("3m", "RuntimeError")])
def test_a_checkpoint_on_a_full_disk_stops_with_the_message(small_disk, cli_runner, size, raised):
    run = small_disk(size) / "run"
    result = cli_runner.invoke(*FLAGS, "--output", run)
    one_line_error(result, "Error: the disk is full: checkpoint step-1 could not be written to")
    assert "there is no earlier checkpoint" in result.stderr and "--resume auto" in result.stderr
    assert f"({raised}: " in result.stderr
    assert not [p for p in (run / "checkpoints").iterdir()], "the unfinished checkpoint must be removed"


def test_a_full_disk_at_recipe_yaml_leaves_no_temporary_file(small_disk, cli_runner):
    disk = small_disk("256k")
    (disk / "run").mkdir()
    fill(disk)
    result = cli_runner.invoke(*FLAGS, "--output", disk / "run")
    one_line_error(result, f"Error: cannot write {disk / 'run' / 'recipe.yaml'} (the disk is full")
    assert list((disk / "run").iterdir()) == []


def test_an_export_to_a_full_disk_leaves_nothing_behind(small_disk, cli_runner):
    disk = small_disk("1m")
    result = cli_runner.invoke("export", "tiny-llama", "--to", "hf", "--output", disk / "out")
    one_line_error(result, f"Error: the export to {disk / 'out'} could not be written (the disk is full")
    assert [p.name for p in disk.iterdir()] == []
