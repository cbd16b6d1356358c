"""A crafted Megatron-Core checkpoint runs no code: its ``.metadata`` and its pickled entries (extra states,
sharded objects), which torch would unpickle with ``weights_only=False``, are refused in one line at resume and
at export; real checkpoints pass (their resume is bit-checked in test_strategy.py)."""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess

import pytest

from toolkit.testing import CodePayload, plant_model_code, point_dcp_entry_at, reseal_checkpoint, run_python

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
TRAIN = ["sft", "--model", "tiny-llama", "--dataset", "demo", "--seq-len", "64", "--micro-batch-size", "2",
         "--strategy", "megatron"]


def toolkit(*args) -> subprocess.CompletedProcess:
    return run_python(["-m", "toolkit", *args], env=ENV, timeout=400)


@pytest.fixture(scope="module")
def megatron_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("megatron") / "run"
    done = toolkit(*TRAIN, "--max-steps", "2", "--output", run)
    assert done.returncode == 0, done.stderr[-3000:]
    return run


def pickled_entry(mcore) -> str:
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    metadata = pickle.loads((mcore / ".metadata").read_bytes())
    return next(k for k, v in metadata.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata))


def refused(done: subprocess.CompletedProcess, expected: str) -> None:
    assert done.returncode == 1, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and expected in done.stderr, done.stderr[-3000:]


@pytest.mark.parametrize("crafted", ["metadata", "entry", "common.pt"])
@pytest.mark.parametrize("command", ["resume", "export"])
def test_a_crafted_megatron_checkpoint_is_refused_in_one_line(megatron_run, tmp_path, crafted, command):
    run = tmp_path / "run"
    shutil.copytree(megatron_run, run)
    step = run / "checkpoints" / "step-2"
    mcore = step / "mcore"
    marker = tmp_path / "ran"
    if crafted == "metadata":
        (mcore / ".metadata").write_bytes(pickle.dumps(CodePayload(marker)))
        expected = f"{mcore / '.metadata'} is not torch.distributed.checkpoint metadata: loading it would call builtins.exec"
    elif crafted == "common.pt":  # read by megatron-core's own torch.load (weights-only by default)
        import torch

        torch.save({"x": CodePayload(marker)}, mcore / "common.pt")
        expected = f"{mcore}: a file holds objects a weights-only load refuses"
    else:
        key = pickled_entry(mcore)
        point_dcp_entry_at(mcore, key, CodePayload(marker))
        expected = f"{mcore}: entry {key!r} holds objects a weights-only load refuses"
    reseal_checkpoint(step)
    if command == "resume":
        done = toolkit(*TRAIN, "--max-steps", "3", "--resume", "auto", "--output", run)
    else:
        done = toolkit("export", run, "--output", tmp_path / "out")
    refused(done, expected)
    assert not marker.exists()


def test_exporting_an_mcore_directory_that_names_its_own_code_runs_none_of_it(megatron_run, tmp_path):
    mcore = tmp_path / "mcore"
    shutil.copytree(megatron_run / "checkpoints" / "step-2" / "mcore", mcore)
    marker = tmp_path / "ran"
    plant_model_code(mcore, "evil", marker)
    done = run_python(["-m", "toolkit", "export", mcore, "--to", "hf", "--output", tmp_path / "out"], input="y\n", env=ENV,
                      timeout=400)
    refused(done, f"{mcore / 'config.json'} asks to run the model's own Python code (configuration_evil); it was not run")
    assert not marker.exists()
