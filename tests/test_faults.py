"""Faults that used to lose work or end in a traceback: damaged checkpoints, torn metrics, stops, broken pipes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from toolkit.recipe import resolve_recipe
from toolkit.train import checkpoint as ckpt
from toolkit.train.runner import run_training

RECIPE = {"model": "tiny-llama", "dataset": ["demo"], "lr": 1e-3, "seq_len": 64, "micro_batch_size": 2,
          "max_steps": 6, "save_every": 2, "keep_last": 3}


def train(output, **values):
    return run_training(resolve_recipe({**RECIPE, "output": str(output), **values}))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """An uninterrupted run with checkpoints at steps 2, 4 and 6; tests work on copies."""
    return train(tmp_path_factory.mktemp("faults") / "run")


@pytest.fixture
def copy(run, tmp_path):
    target = tmp_path / "run"
    shutil.copytree(run, target)
    return target


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def test_the_refusal_of_a_byte_flipped_checkpoint_does_not_list_it_as_whole(copy):
    flip_byte(copy / "checkpoints" / "step-6" / "model.safetensors")
    with pytest.raises(ckpt.CheckpointError) as error:
        ckpt.find_resume_checkpoint(copy, str(copy / "checkpoints" / "step-6"))
    message = str(error.value)
    assert "model.safetensors does not match its sha256" in message
    assert message.split("Whole checkpoints in ")[1].startswith(f"{copy / 'checkpoints'}: step-2, step-4.")


def test_when_every_checkpoint_is_damaged_resume_refuses_and_keeps_the_metrics(copy):
    for step in ckpt.step_dirs(copy):
        flip_byte(step / "optimizer.pt")
    metrics = (copy / "metrics.jsonl").read_text()
    with pytest.raises(ckpt.CheckpointError) as error:
        train(copy, resume="auto", max_steps=8)
    message = str(error.value)
    assert message.startswith(f"every checkpoint in {copy / 'checkpoints'} is damaged (step-6: optimizer.pt does not match")
    assert "step-2: optimizer.pt" in message and "--overwrite" in message
    assert (copy / "metrics.jsonl").read_text() == metrics


def test_a_torn_last_metrics_line_does_not_stop_resume(copy):
    with (copy / "metrics.jsonl").open("a") as handle:
        handle.write('{"step": 7, "loss": 1.2')  # a kill in the middle of a line's write
    shutil.rmtree(copy / "checkpoints" / "step-6")
    train(copy, resume="auto", max_steps=8)
    steps = [json.loads(line)["step"] for line in (copy / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 9))


def test_a_kill_during_the_metrics_rewrite_at_resume_loses_no_history(copy, monkeypatch):
    shutil.rmtree(copy / "checkpoints" / "step-6")
    before = (copy / "metrics.jsonl").read_text()
    real = Path.write_text

    def killed_half_way(self, text, *args, **kwargs):
        if self.name.endswith("metrics.jsonl") or self.name.endswith("metrics.jsonl.tmp"):
            real(self, text[: len(text) // 2], *args, **kwargs)
            raise KeyboardInterrupt("killed")
        return real(self, text, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", killed_half_way)
    with pytest.raises(KeyboardInterrupt):
        train(copy, resume="auto", max_steps=8)
    assert (copy / "metrics.jsonl").read_text() == before
