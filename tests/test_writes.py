"""toolkit.writes: a folder is replaced by a finished one whole, and a failed replacement keeps the old one."""

from __future__ import annotations

import os

import pytest

from toolkit.writes import replace_directory, staged_directory


def test_a_staged_folder_replaces_the_old_one_and_leaves_nothing_beside_it(tmp_path):
    output = tmp_path / "export"
    output.mkdir()
    (output / "old.txt").write_text("old")
    with staged_directory(output) as staging:
        (staging / "new.txt").write_text("new")
        assert not (output / "new.txt").exists()  # nothing reaches the output before the block ends
    assert sorted(p.name for p in output.iterdir()) == ["new.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["export"]


def test_an_error_in_the_block_keeps_the_old_folder(tmp_path):
    output = tmp_path / "export"
    output.mkdir()
    (output / "old.txt").write_text("old")
    with pytest.raises(RuntimeError), staged_directory(output) as staging:
        (staging / "half.txt").write_text("half")
        raise RuntimeError("killed half way")
    assert sorted(p.name for p in output.iterdir()) == ["old.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["export"]


def test_a_failed_rename_puts_the_old_folder_back(tmp_path, monkeypatch):
    output, staging = tmp_path / "step-4", tmp_path / ".tmp-step-4"
    for folder, name in ((output, "old.txt"), (staging, "new.txt")):
        folder.mkdir()
        (folder / name).write_text(name)
    real_replace = os.replace

    def replace(source, target):
        if str(source) == str(staging):
            raise OSError(28, "No space left on device")
        real_replace(source, target)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(OSError):
        replace_directory(staging, output, retired=tmp_path / ".del-step-4")
    assert sorted(p.name for p in output.iterdir()) == ["old.txt"]
    assert not (tmp_path / ".del-step-4").exists()
