"""Checkpoints: the manifest matches the bytes on disk, every kind of damage is detected and named, resume
falls back past a damaged checkpoint and reproduces it bit for bit, and a full disk leaves the previous one whole."""

from __future__ import annotations

import errno
import hashlib
import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file

from toolkit.train import checkpoint as ckpt


def weights(checkpoint):
    return load_file(str(checkpoint / "model.safetensors"))


def assert_same_weights(a, b):
    import torch

    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_manifest_lists_every_file_with_its_size_and_sha256(checkpointed_run):
    assert [p.name for p in ckpt.step_dirs(checkpointed_run)] == ["step-2", "step-4", "step-6"]
    for checkpoint in ckpt.step_dirs(checkpointed_run):
        manifest = json.loads((checkpoint / "manifest.json").read_text())
        on_disk = {p.relative_to(checkpoint).as_posix() for p in checkpoint.rglob("*") if p.is_file()} - {"manifest.json"}
        assert set(manifest["files"]) == on_disk and "model.safetensors" in on_disk and "trainer_state.json" in on_disk
        for name, entry in manifest["files"].items():
            data = (checkpoint / name).read_bytes()
            assert entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        assert ckpt.read_state(checkpoint)["checkpoint_format"] == ckpt.CHECKPOINT_FORMAT
    assert not [p for p in (checkpointed_run / "checkpoints").iterdir() if p.name.startswith(".")]


def _flip_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


DAMAGE = {
    "flipped byte": (lambda c: _flip_byte(c / "model.safetensors"), "model.safetensors does not match its sha256"),
    "truncated": (lambda c: (c / "optimizer.pt").write_bytes((c / "optimizer.pt").read_bytes()[:100]),
                  "optimizer.pt is 100 bytes, manifest.json says"),
    "file missing": (lambda c: (c / "scheduler.pt").unlink(), "scheduler.pt is missing"),
    "manifest missing": (lambda c: (c / "manifest.json").unlink(), "manifest.json is missing"),
    "manifest garbage": (lambda c: (c / "manifest.json").write_text('{"files": '), "manifest.json is unreadable"),
    "state missing": (lambda c: (c / "trainer_state.json").unlink(), "trainer_state.json is missing"),
    "emptied folder": (lambda c: [p.unlink() for p in c.iterdir()], "incomplete: neither manifest.json nor trainer_state.json"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_each_kind_of_damage_is_detected_and_named(run_copy, damage):
    checkpoint = run_copy / "checkpoints" / "step-4"
    assert ckpt.checkpoint_problem(checkpoint) is None
    apply, expected = DAMAGE[damage]
    apply(checkpoint)
    assert expected in ckpt.checkpoint_problem(checkpoint, "sha256")
    if damage == "flipped byte":  # the opt-out trades this case for speed
        assert ckpt.checkpoint_problem(checkpoint, "size") is None
    else:
        assert expected in ckpt.checkpoint_problem(checkpoint, "size")
    assert [p.name for p in ckpt.list_checkpoints(run_copy, "sha256")] == ["step-2", "step-6"]


def test_resume_auto_skips_a_damaged_checkpoint_and_reproduces_it(checkpointed_run, run_copy, capsys, train_tiny):
    _flip_byte(run_copy / "checkpoints/step-6/optimizer.pt")
    capsys.readouterr()
    train_tiny(run_copy, resume="auto")
    err = capsys.readouterr().err
    skipped = [line for line in err.splitlines() if "skipping damaged checkpoint" in line]
    assert skipped == [f"toolkit: skipping damaged checkpoint {run_copy / 'checkpoints/step-6'}: optimizer.pt does not match "
                       "its sha256 in manifest.json (corrupted); falling back to the one before it"]
    assert f"resumed from {run_copy / 'checkpoints/step-4'} at step 4" in err
    assert ckpt.checkpoint_problem(run_copy / "checkpoints/step-6") is None  # written again, whole
    assert_same_weights(weights(run_copy / "checkpoints/step-6"), weights(checkpointed_run / "checkpoints/step-6"))
    assert [json.loads(line)["step"] for line in (run_copy / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4, 5, 6]


def test_explicit_resume_of_a_damaged_checkpoint_is_an_error(run_copy, train_tiny):
    damaged = run_copy / "checkpoints/step-4"
    (damaged / "model.safetensors").write_bytes(b"")
    with pytest.raises(ckpt.CheckpointError) as error:
        train_tiny(run_copy, resume=str(damaged))
    message = str(error.value)
    assert f"checkpoint {damaged} is damaged: model.safetensors is 0 bytes" in message
    assert "Whole checkpoints in" in message and "step-2, step-6" in message


def test_a_checkpoint_from_before_manifests_is_accepted_unverified(run_copy):
    legacy = run_copy / "checkpoints/step-6"
    (legacy / "manifest.json").unlink()
    state = ckpt.read_state(legacy)
    del state["checkpoint_format"]
    (legacy / "trainer_state.json").write_text(json.dumps(state))
    lines = []
    assert ckpt.find_resume_checkpoint(run_copy, "auto", report=lines.append) == legacy
    assert lines == [f"toolkit: checkpoint {legacy} has no manifest.json (written before manifests); resuming without verifying it"]


def test_leftovers_of_killed_writes_are_ignored_then_cleaned(checkpointed_run, run_copy, capsys, train_tiny):
    root = run_copy / "checkpoints"
    (root / ".tmp-step-8").mkdir()
    (root / ".tmp-step-8" / "model.safetensors").write_bytes(b"half")
    shutil.copytree(root / "step-2", root / ".del-step-2")
    (root / "step-8").mkdir()  # as a file system might leave it
    train_tiny(run_copy, resume="auto", max_steps=8, keep_last=2)
    err = capsys.readouterr().err
    assert f"skipping damaged checkpoint {root / 'step-8'}: incomplete" in err and "at step 6" in err
    assert sorted(p.name for p in root.iterdir()) == ["step-6", "step-8"]


def _fail_on_call(monkeypatch, target, attribute, number, error, partial=False, name=None):
    """Make the ``number``-th call of ``target.attribute`` (writing a file called ``name``, when given) raise,
    after writing half its file with ``partial``."""
    original = getattr(target, attribute)
    calls = []

    def failing(*args, **kwargs):
        calls.append(name is None or Path(args[0]).name == name)
        if calls[-1] and sum(calls) == number:
            if partial:  # save_file(tensors, path): leave a partial file behind, as a full disk does
                original(*args, **kwargs)
                with open(args[1], "r+b") as handle:
                    handle.truncate(handle.seek(0, 2) // 2)
            raise error
        return original(*args, **kwargs)

    monkeypatch.setattr(target, attribute, failing)


@pytest.mark.parametrize("where", ["engine write", "manifest write"])
def test_disk_full_during_a_save_keeps_the_previous_checkpoint(checkpointed_run, tmp_path, monkeypatch, where, train_tiny):
    import safetensors.torch

    full = OSError(errno.ENOSPC, "No space left on device")
    if where == "engine write":  # the 2nd checkpoint's model.safetensors
        _fail_on_call(monkeypatch, safetensors.torch, "save_file", 2, full, partial=True)
    else:
        _fail_on_call(monkeypatch, ckpt, "_write_synced", 2, full, name="manifest.json")
    output = tmp_path / "full"
    with pytest.raises(ckpt.CheckpointError) as error:
        train_tiny(output, keep_last=1)
    message = str(error.value)
    assert message.startswith(f"the disk is full: checkpoint step-4 could not be written to {output / 'checkpoints'}")
    assert f"{output / 'checkpoints/step-2'} is still whole: `--resume auto` continues from it (step 2)" in message
    assert "Free space there" in message and "training stopped" in message
    assert sorted(p.name for p in (output / "checkpoints").iterdir()) == ["step-2"]  # staging removed, step-2 kept
    assert ckpt.checkpoint_problem(output / "checkpoints/step-2") is None
    monkeypatch.undo()
    train_tiny(output, keep_last=1, resume="auto")
    assert_same_weights(weights(output / "checkpoints/step-6"), weights(checkpointed_run / "checkpoints/step-6"))


def test_another_write_error_names_itself_and_the_checkpoint_kept(tmp_path, monkeypatch, train_tiny):
    import safetensors.torch

    from toolkit.builtins.loaders import materialize_preset

    materialize_preset("tiny-llama")  # in a fresh cache the preset's own write would be the first save_file
    _fail_on_call(monkeypatch, safetensors.torch, "save_file", 1, PermissionError(errno.EACCES, "Permission denied"))
    output = tmp_path / "denied"
    with pytest.raises(ckpt.CheckpointError) as error:
        train_tiny(output)
    assert "checkpoint step-2 could not be written" in str(error.value) and "Permission denied" in str(error.value)
    assert "there is no earlier checkpoint: the run would restart from step 0" in str(error.value)
    assert list((output / "checkpoints").iterdir()) == []


def test_export_of_a_run_skips_a_damaged_checkpoint_and_refuses_one_asked_for(run_copy, capsys):
    from toolkit.export import resolve_export_source

    damaged = run_copy / "checkpoints/step-6"
    _flip_byte(damaged / "model.safetensors")
    capsys.readouterr()
    assert resolve_export_source(str(run_copy)).description == f"checkpoint {run_copy / 'checkpoints/step-4'}"
    assert f"skipping damaged checkpoint {damaged}: model.safetensors does not match" in capsys.readouterr().err
    with pytest.raises(ckpt.CheckpointError, match="is damaged: model.safetensors does not match"):
        resolve_export_source(str(damaged))


def test_ranks_share_the_hashing_and_rank_0_merges_the_same_manifest(run_copy):
    checkpoint = run_copy / "checkpoints/step-2"
    expected = json.loads((checkpoint / "manifest.json").read_text())
    (checkpoint / "manifest.json").unlink()
    for rank in range(3):
        ckpt.hash_share(checkpoint, rank, 3)
    shares = [json.loads(p.read_text()) for p in sorted(checkpoint.glob(".manifest-share-rank*.json"))]
    assert len(shares) == 3 and sum(len(s) for s in shares) == len(expected["files"])  # disjoint, and together all
    assert ckpt.write_manifest(checkpoint) == expected
    assert not list(checkpoint.glob(".manifest-share-*")) and ckpt.checkpoint_problem(checkpoint) is None
