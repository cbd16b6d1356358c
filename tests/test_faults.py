"""Faults that used to lose work or end in a traceback: damaged checkpoints, torn metrics, stops, broken pipes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from toolkit.train import checkpoint as ckpt


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def test_the_refusal_of_a_byte_flipped_checkpoint_does_not_list_it_as_whole(run_copy):
    flip_byte(run_copy / "checkpoints" / "step-6" / "model.safetensors")
    with pytest.raises(ckpt.CheckpointError) as error:
        ckpt.find_resume_checkpoint(run_copy, str(run_copy / "checkpoints" / "step-6"))
    message = str(error.value)
    assert "model.safetensors does not match its sha256" in message
    assert message.split("Whole checkpoints in ")[1].startswith(f"{run_copy / 'checkpoints'}: step-2, step-4.")


def test_when_every_checkpoint_is_damaged_resume_refuses_and_keeps_the_metrics(run_copy, train_tiny):
    for step in ckpt.step_dirs(run_copy):
        flip_byte(step / "optimizer.pt")
    metrics = (run_copy / "metrics.jsonl").read_text()
    with pytest.raises(ckpt.CheckpointError) as error:
        train_tiny(run_copy, resume="auto", max_steps=8)
    message = str(error.value)
    assert message.startswith(f"every checkpoint in {run_copy / 'checkpoints'} is damaged (step-6: optimizer.pt does not match")
    assert "step-2: optimizer.pt" in message and "--overwrite" in message
    assert (run_copy / "metrics.jsonl").read_text() == metrics


def test_a_torn_last_metrics_line_does_not_stop_resume(run_copy, train_tiny):
    with (run_copy / "metrics.jsonl").open("a") as handle:
        handle.write('{"step": 7, "loss": 1.2')  # a kill in the middle of a line's write
    shutil.rmtree(run_copy / "checkpoints" / "step-6")
    train_tiny(run_copy, resume="auto", max_steps=8)
    steps = [json.loads(line)["step"] for line in (run_copy / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 9))


def test_a_kill_during_the_metrics_rewrite_at_resume_loses_no_history(run_copy, monkeypatch, train_tiny):
    shutil.rmtree(run_copy / "checkpoints" / "step-6")
    before = (run_copy / "metrics.jsonl").read_text()
    real = Path.write_text

    def killed_half_way(self, text, *args, **kwargs):
        if self.name.endswith("metrics.jsonl") or self.name.endswith("metrics.jsonl.tmp"):
            real(self, text[: len(text) // 2], *args, **kwargs)
            raise KeyboardInterrupt("killed")
        return real(self, text, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", killed_half_way)
    with pytest.raises(KeyboardInterrupt):
        train_tiny(run_copy, resume="auto", max_steps=8)
    assert (run_copy / "metrics.jsonl").read_text() == before


# ----------------------------------------------------------------------------------------------- exit codes, pipes
ENV = {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
FLAGS = ["sft", "--model", "tiny-llama", "--dataset", "demo", "--seq-len", "64", "--micro-batch-size", "2", "--lr", "1e-3"]


def start(*args, **streams):
    """``toolkit sft ...`` forked from the test fork server (no import of torch and transformers of its own)."""
    import os
    import sys

    from toolkit import forkserver

    return forkserver.popen([sys.executable, "-m", "toolkit", *FLAGS, *map(str, args)], env={**os.environ, **ENV}, **streams)


def test_a_dead_log_reader_then_ctrl_c_still_saves_and_exits_stopped(tmp_path):
    import os
    import signal
    import time

    from toolkit.errors import EXIT_STOPPED

    run = tmp_path / "run"
    # `toolkit sft ... 2>&1 | tee log`, then Ctrl-C: tee dies first, the run's next prints hit a closed pipe
    read_end, write_end = os.pipe()
    process = start("--max-steps", "100000", "--log-every", "1", "--output", run, stdout=write_end, stderr=write_end)
    os.close(write_end)
    reader = os.fdopen(read_end, "rb")
    assert reader.readline()  # the run is talking
    deadline = time.time() + 120
    while time.time() < deadline and not ((run / "metrics.jsonl").is_file() and (run / "metrics.jsonl").read_text().count("\n") >= 2):
        time.sleep(0.1)
    reader.close()
    time.sleep(1.0)  # a few step lines are written to the closed pipe
    process.send_signal(signal.SIGINT)
    assert process.wait(timeout=300) == EXIT_STOPPED
    (checkpoint,) = ckpt.list_checkpoints(run, "sha256")
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert ckpt.read_state(checkpoint)["step"] == steps[-1] >= 2

    # the same run resumed to its end with nobody reading at all: finished, exported, status 0
    read_end, write_end = os.pipe()
    os.close(read_end)
    last = steps[-1] + 2
    done = start("--max-steps", last, "--resume", "auto", "--output", run, "--export", "hf", stdout=write_end, stderr=write_end)
    os.close(write_end)
    assert done.wait(timeout=300) == 0  # three steps and an export; a loaded CI machine took over 120 s
    assert (run / "export" / "model.safetensors").is_file() and ckpt.read_state(ckpt.step_dirs(run)[-1])["step"] == last


def test_stop_after_exits_75_and_a_stop_on_the_last_step_still_exports(tmp_path, cli_runner):
    from toolkit.errors import EXIT_STOPPED

    run = tmp_path / "run"
    stopped = cli_runner.invoke(*FLAGS, "--max-steps", "4", "--stop-after", "2", "--export", "hf", "--output", run)
    assert stopped.exit_code == EXIT_STOPPED, stopped.output
    assert "toolkit: stopped at step 2 of 4; checkpoint" in stopped.stderr and "--resume auto" in stopped.stderr
    assert "Error" not in stopped.stderr and not (run / "export").exists()


def test_a_signal_during_the_last_step_finishes_the_run_and_exports(tmp_path, monkeypatch):
    import signal

    from toolkit.builtins.strategies import LocalEngine

    real, calls = LocalEngine.train_step, []

    def signalled_on_step_4(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 4:
            signal.raise_signal(signal.SIGTERM)  # the handler asks for a stop after this step
        return real(self, *args, **kwargs)

    monkeypatch.setattr(LocalEngine, "train_step", signalled_on_step_4)
    from conftest import CHECKPOINTED_RECIPE
    from toolkit.recipe import resolve_recipe
    from toolkit.train.runner import run_training

    recipe = resolve_recipe({**CHECKPOINTED_RECIPE, "max_steps": 4, "export": "hf", "output": str(tmp_path / "run")})
    run = run_training(recipe, raise_if_stopped=True)  # no RunStopped: the run is finished
    assert len(calls) == 4 and (run / "export" / "model.safetensors").is_file()


@pytest.mark.slow
def test_ctrl_c_under_toolkit_launch_stops_every_rank_cleanly_with_status_75(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    from toolkit import forkserver
    from toolkit.testing import free_port

    run = tmp_path / "run"
    command = [sys.executable, "-m", "toolkit", "launch", "--nproc", "2", "--master-port", str(free_port()), *FLAGS,
               "--max-steps", "100000", "--output", str(run)]
    # the launcher forked from the test fork server (no import of torch of its own); its ranks are torchrun's
    with (tmp_path / "err").open("w+") as log:
        process = forkserver.popen(command, env={**os.environ, **ENV}, stdout=subprocess.DEVNULL, stderr=log)
        deadline = time.time() + 180
        while time.time() < deadline and not ((run / "metrics.jsonl").is_file() and (run / "metrics.jsonl").read_text().count("\n") >= 2):
            time.sleep(0.2)
        process.send_signal(signal.SIGINT)  # what a terminal's Ctrl-C sends
        process.wait(timeout=180)
        log.seek(0)
        err = log.read()
    assert process.returncode == 75, err[-3000:]
    assert "Traceback" not in err and "SignalException" not in err and "stopped at step" in err
    (checkpoint,) = ckpt.list_checkpoints(run, "sha256")
    assert ckpt.read_state(checkpoint)["world_size"] == 2


# ----------------------------------------------------------------------------------------------- exports
def test_export_overwrite_refuses_a_folder_that_is_not_a_previous_export(tmp_path, cli_runner):
    target = tmp_path / "home"
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    refused = cli_runner.invoke("export", "tiny-llama", "--output", target, "--overwrite")
    assert refused.exit_code == 1 and "Traceback" not in refused.output
    assert f"--overwrite refuses to replace {target}: it is not a previous toolkit export" in refused.stderr
    assert (target / "notes.txt").read_text() == "mine"
    fresh = tmp_path / "export"
    assert cli_runner.invoke("export", "tiny-llama", "--output", fresh).exit_code == 0
    again = cli_runner.invoke("export", "tiny-llama", "--output", fresh, "--overwrite")
    assert again.exit_code == 0, again.output
    assert (fresh / "model.safetensors").is_file()


def test_exports_follow_the_umask(tmp_path, cli_runner):
    import os
    import stat

    previous = os.umask(0o022)
    try:
        assert cli_runner.invoke("export", "tiny-llama", "--output", tmp_path / "out").exit_code == 0
    finally:
        os.umask(previous)
    out = tmp_path / "out"
    assert stat.S_IMODE(out.stat().st_mode) == 0o755
    assert {stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()} == {0o644}


def test_sigterm_during_an_export_leaves_no_staging_folder_and_the_next_export_sweeps_dead_ones(tmp_path):
    import subprocess
    import sys

    out = tmp_path / "out"
    code = ("import signal, sys; from pathlib import Path; from toolkit.export import atomic_dir\n"
            f"atomic_dir(Path({str(out)!r}), lambda tmp: ((tmp / 'part').write_text('x'), signal.raise_signal(signal.SIGTERM)))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 143, done.stderr
    assert list(tmp_path.iterdir()) == []

    from toolkit.export import atomic_dir

    dead = tmp_path / ".out-999999999-x1"  # a staging folder of an export killed with SIGKILL (no such process now)
    dead.mkdir()
    atomic_dir(out, lambda tmp: (tmp / "weights").write_text("w"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"] and (out / "weights").is_file()


# ----------------------------------------------------------------------------------------------- resume with other settings
def test_resuming_with_other_training_settings_names_them_and_needs_resume_changed(run_copy, train_tiny):
    from toolkit.errors import ConfigError

    recipe = (run_copy / "recipe.yaml").read_text()
    with pytest.raises(ConfigError) as error:
        train_tiny(run_copy, resume="auto", max_steps=8, lr=3e-4, seed=7, dataset=["demo", "demo"])
    message = str(error.value)
    assert "this command trains differently from its" in message and "--resume-changed" in message
    assert "lr: 0.001 -> 0.0003" in message and "seed: 42 -> 7" in message and "dataset: ['demo'] -> ['demo', 'demo']" in message
    assert "max_steps" not in message  # a longer run is a resume, not a different one
    assert (run_copy / "recipe.yaml").read_text() == recipe
    train_tiny(run_copy, resume="auto", max_steps=8, lr=3e-4, resume_changed=True)
    assert "lr: 0.0003" in (run_copy / "recipe.yaml").read_text()


def test_a_run_from_an_older_toolkit_resumes_when_the_new_settings_are_at_their_defaults(run_copy, train_tiny):
    """recipe.yaml without fields a newer version added (here: the evaluation ones) still resumes as it was,
    and a new field set away from its default is still a change."""
    import yaml

    from toolkit.errors import ConfigError

    path = run_copy / "recipe.yaml"
    saved = yaml.safe_load(path.read_text())
    older = {k: v for k, v in saved.items() if k not in ("early_stopping_patience", "eval_split", "best_mode")}
    assert len(older) == len(saved) - 3
    path.write_text(yaml.safe_dump(older))
    with pytest.raises(ConfigError, match="eval_split: None -> 0.1"):
        train_tiny(run_copy, resume="auto", max_steps=8, eval_split=0.1)
    train_tiny(run_copy, resume="auto", max_steps=8)
    steps = [json.loads(line)["step"] for line in (run_copy / "metrics.jsonl").read_text().splitlines()]
    assert steps[-1] == 8


def test_resuming_with_another_model_is_refused_before_the_model_loads(run_copy, monkeypatch, train_tiny):
    import toolkit.models as loaders
    from toolkit.errors import ConfigError

    monkeypatch.setattr(loaders, "resolve_model", lambda *a, **k: pytest.fail("the model was loaded"))
    with pytest.raises(ConfigError, match="model: 'tiny-llama' -> 'tiny-qwen2'"):
        train_tiny(run_copy, resume="auto", model="tiny-qwen2")
