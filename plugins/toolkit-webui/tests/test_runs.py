"""Runs as subprocesses: curves from metrics.jsonl; stop and resume, also under torchrun with 2 processes.

The runs start through the test fork server (:mod:`toolkit.forkserver`: torch and transformers imported once);
the browser tests launch theirs from the page, as fresh interpreters.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from toolkit import forkserver
from toolkit.errors import EXIT_STOPPED
from toolkit_webui.runs import Runs, curves, read_metrics


def test_curves_read_complete_lines_and_every_reward(tmp_path):
    rows = [{"step": 1, "loss": 2.0, "lr": 1e-4, "tokens_per_s": 10.0, "reward_answer": 0.5},
            {"step": 2, "loss": 1.5, "eval/loss": 1.7, "lr": 9e-5, "tokens_per_s": 12.0, "reward_format": 1.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 3, "lo')
    metrics = read_metrics(tmp_path)
    assert [m["step"] for m in metrics] == [1, 2]  # the half-written line is not a point
    plots = curves(metrics)
    assert plots["loss"].values.tolist() == [[1, 2.0, "loss"], [2, 1.5, "loss"], [2, 1.7, "eval/loss"]]
    assert set(plots["reward"]["series"]) == {"reward_answer", "reward_format"}
    assert str(curves([])["loss"]["step"].dtype) == "int64"  # an empty plot keeps numeric axes


def test_a_long_run_is_drawn_thinned_to_its_newest_step():
    metrics = [{"step": s, "loss": 1.0 / s, "lr": 1e-4, "tokens_per_s": 10.0} for s in range(1, 25_001)]
    loss = curves(metrics)["loss"]
    assert len(loss) <= 1001 and loss["step"].iloc[0] == 1 and loss["step"].iloc[-1] == 25_000
    assert loss["step"].is_monotonic_increasing and (loss["value"] == 1.0 / loss["step"]).all()


def wait_for_step(run_dir, step, timeout=180):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        metrics = read_metrics(run_dir)
        if metrics and metrics[-1]["step"] >= step:
            return metrics[-1]["step"]
        time.sleep(0.3)
    raise AssertionError(f"{run_dir} never reached step {step}:\n{(run_dir / 'webui.log').read_text()}")


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_stop_saves_and_resume_continues(tmp_path, monkeypatch, nproc):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    runs = Runs(tmp_path, popen=forkserver.popen)
    run_dir = tmp_path / "r"
    args = ["sft", "--model", "tiny-llama", "--dataset", "demo", "--max-steps", "100000", "--output", str(run_dir)]
    runs.launch(args, run_dir, nproc)
    try:
        wait_for_step(run_dir, 3)
        runs.stop(run_dir)
        stopped_status = EXIT_STOPPED if nproc == 1 else 0  # torchrun reports any other status as a failure
        assert runs.wait(run_dir, 180) == stopped_status, (run_dir / "webui.log").read_text()  # stopped and saved
        status = runs.status(run_dir)
        assert status.state.startswith("stopped at step"), status
        stopped = status.step
        assert (run_dir / "checkpoints" / f"step-{stopped}").is_dir()
        runs.resume(run_dir)
        wait_for_step(run_dir, stopped + 2)
        log = (run_dir / "webui.log").read_text()
        assert f"resumed from {run_dir / 'checkpoints' / f'step-{stopped}'} at step {stopped}" in log
        assert [m["step"] for m in read_metrics(run_dir)][stopped] == stopped + 1
        runs.stop(run_dir)
        assert runs.wait(run_dir, 180) == stopped_status
    finally:
        runs.close()


def test_resume_of_a_cli_run_uses_its_losss_command(tmp_path, monkeypatch):
    """A run started from the CLI is resumed with the command of the loss its recipe.yaml names."""
    pytest.importorskip("toolkit_rl")
    runs = Runs(tmp_path)
    launched = []
    monkeypatch.setattr(runs, "launch", lambda args, run_dir, nproc=1: launched.append((args, nproc)))
    for name, loss in (("rl", "grpo"), ("plain", "sft")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "recipe.yaml").write_text(f"model: tiny-llama\nloss: {loss}\n")
        runs.resume(tmp_path / name)
    assert launched == [(["grpo", "--config", str(tmp_path / "rl" / "recipe.yaml"), "--resume", "auto"], 1),
                        (["sft", "--config", str(tmp_path / "plain" / "recipe.yaml"), "--resume", "auto"], 1)]


EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


@pytest.mark.slow
def test_reward_plot_of_a_grpo_run_launched_from_the_form(tmp_path, monkeypatch):
    """toolkit-rl's GRPO composed in the form and launched by the page: the reward plot holds the run's mean
    reward and each reward's, as metrics.jsonl has them, step by step."""
    pytest.importorskip("toolkit_rl")
    from toolkit_webui import forms
    from toolkit_webui.app import App
    from toolkit_webui.paths import Roots

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    app = App(Roots(tmp_path, [EXAMPLES]))
    app.runs.popen = forkserver.popen
    raw = {f.key: forms.widget_value(f, f.default) for f in app.fields}
    raw.update({"loss": "grpo", "dataset": str(EXAMPLES / "capitals-prompts.jsonl"), "output": "grpo", "max_steps": 3,
                "seq_len": 64, "grpo.rewards": "answer", "grpo.num_generations": 2, "grpo.prompts_per_rollout": 2,
                "grpo.max_new_tokens": 4})
    try:
        app.launch(raw, 1)
        run_dir = tmp_path / "grpo"
        assert app.runs.wait(run_dir, 300) == 0, (run_dir / "webui.log").read_text()
        _, _, *plots, _ = app.run_view(str(run_dir))
        reward = plots[-1]
        metrics = read_metrics(run_dir)
        assert [m["step"] for m in metrics] == [1, 2, 3]
        assert set(reward["series"]) == {"reward/mean", "reward/std", "rewards/answer/mean", "rewards/answer/std"}
        for series, points in reward.groupby("series"):
            assert points["value"].tolist() == [m[series] for m in metrics], series
    finally:
        app.runs.close()


def test_a_run_that_fails_is_listed_as_failed(tmp_path, monkeypatch):
    """A launch whose command exits with an error: the runs table says failed, with the exit status, and the
    log shows the CLI's one-line error."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    runs = Runs(tmp_path, popen=forkserver.popen)
    run_dir = tmp_path / "bad"
    runs.launch(["sft", "--model", "tiny-llama", "--dataset", str(tmp_path / "missing.jsonl"), "--output", str(run_dir)], run_dir)
    try:
        code = runs.wait(run_dir, 120)
        assert code not in (0, None)
        assert runs.status(run_dir).row()[:2] == ["bad", f"failed (exit {code})"]
        assert "missing.jsonl" in (run_dir / "webui.log").read_text()
    finally:
        runs.close()


def test_the_runs_tab_ticks_fast_only_while_a_run_trains(tmp_path):
    """A tick of the Runs tab costs the browser about half a CPU-second in this page: with no run training it looks
    every 5 s, and a run that trains (here one the page did not start: its metrics.jsonl is fresh) brings it back
    to every 2 s. The tick's own handler sets the interval, and only when it changes."""
    import gradio as gr

    from toolkit_webui import tabs
    from toolkit_webui.app import App, build
    from toolkit_webui.paths import Roots

    app = App(Roots(tmp_path))
    page = build(app)
    (timer,) = [block for block in page.blocks.values() if isinstance(block, gr.Timer)]
    (tick,) = [fn for fn in page.fns.values() if any(event == "tick" for _, event in fn.targets)]
    at, shown_at = tick.outputs.index(timer), 2

    def interval(result: list) -> float | None:
        update = result[at]
        return update.value if isinstance(update, gr.Timer) else None

    idle = tick.fn(None, {})
    assert interval(idle) == tabs.IDLE_REFRESH_SECONDS > tabs.REFRESH_SECONDS
    assert interval(tick.fn(None, idle[shown_at])) is None  # unchanged: not sent again
    run = tmp_path / "cli-run"
    run.mkdir()
    (run / "recipe.yaml").write_text("model: tiny-llama\n")
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n")
    live = tick.fn(None, idle[shown_at])
    assert live[0][0][:2] == ["cli-run", "running (not from this page)"]
    assert interval(live) == tabs.REFRESH_SECONDS
