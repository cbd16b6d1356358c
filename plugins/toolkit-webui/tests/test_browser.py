"""The page in a real headless chromium: forms from the registries, launch, live curves, stop, resume,
export and chat, each checked against the CLI doing the same thing."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from toolkit.testing import run_python

pytestmark = pytest.mark.browser
SHOTS = os.environ.get("TOOLKIT_WEBUI_SCREENSHOTS")  # a directory: also save a screenshot of each tab there


def choose(page, elem_id: str, option: str) -> None:
    page.locator(f"#{elem_id} input").click()
    page.get_by_role("option", name=option, exact=True).click()


def fill(page, elem_id: str, value: str) -> None:
    box = page.locator(f"#{elem_id} input, #{elem_id} textarea").first
    box.fill(value)
    box.press("Tab")


def text_of(page, elem_id: str) -> str:
    return page.locator(f"#{elem_id}").inner_text()


def wait_text(page, elem_id: str, pattern: str, timeout: float = 120) -> str:
    deadline = time.monotonic() + timeout
    text = ""
    while time.monotonic() < deadline:
        text = text_of(page, elem_id)
        if re.search(pattern, text):
            return text
        time.sleep(0.5)
    raise AssertionError(f"#{elem_id} never matched {pattern!r}; it shows:\n{text}")


def shot(page, name: str, full_page: bool = False) -> None:
    if SHOTS:
        page.wait_for_timeout(800)
        page.screenshot(path=str(Path(SHOTS) / f"webui-{name}.png"), full_page=full_page)


def toolkit(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    return run_python(["-m", "toolkit", *args], cwd=cwd, env=env, check=True)


def loss_line_points(page, at_least: int, timeout: float = 120, plot: str = "loss") -> int:
    """Vertices of the longest line vega drew in a plot, once there are ``at_least``."""
    deadline = time.monotonic() + timeout
    count = 0
    while time.monotonic() < deadline:
        paths = page.locator(f"#plot-{plot} .mark-line path[stroke]")  # drawn in a colour, not only in the DOM
        count = max([len(re.findall(r"[ML]", paths.nth(i).get_attribute("d") or "")) for i in range(paths.count())] or [0])
        if count >= at_least:
            return count
        time.sleep(0.5)
    raise AssertionError(f"the {plot} plot shows a line of {count} points, not {at_least}")


def last_step(run_dir: Path) -> int:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return json.loads(lines[-1])["step"] if lines else 0


def test_third_party_loss_gets_its_options_without_ui_code(page):
    """toolkit-example's focal loss: chosen by name, its Config fields appear and reach the YAML and
    the command line (test_forms checks that line parses back, through the CLI, to the same recipe)."""
    assert not page.locator("#section-focal").is_visible()
    choose(page, "field-recipe-loss", "focal")
    page.locator("#section-focal").wait_for(state="visible")
    fill(page, "field-focal-gamma", "0.5")
    page.locator("#field-focal-detach_weight input").check()
    command = wait_text(page, "recipe-command", r"--focal-gamma 0\.5 --focal-detach-weight")
    assert command.strip().splitlines()[-1].startswith("toolkit focal ")
    yaml_text = wait_text(page, "recipe-yaml", r"detach_weight: true")
    assert re.search(r"focal:\s*\n\s*gamma: 0\.5", yaml_text)
    shot(page, "recipe", full_page=True)
    choose(page, "field-recipe-loss", "sft")
    page.locator("#section-focal").wait_for(state="hidden")
    assert "focal" not in wait_text(page, "recipe-yaml", r"loss: sft")


def test_bad_value_is_named(page):
    fill(page, "field-recipe-lr", "-1")
    status = wait_text(page, "recipe-status", r"Fix first")
    assert "lr must be positive" in status
    fill(page, "field-recipe-dataset", "/etc/passwd")
    assert "outside the directories" in wait_text(page, "recipe-status", r"outside")


def test_save_and_load_recipe(page, server):
    fill(page, "field-recipe-max_steps", "7")
    wait_text(page, "recipe-yaml", r"max_steps: 7")
    fill(page, "recipe-path", "recipes/seven.yaml")
    page.locator("#save-recipe").click()
    wait_text(page, "recipe-message", r"Saved")
    assert "max_steps: 7" in (server.runs / "recipes" / "seven.yaml").read_text()
    fill(page, "field-recipe-max_steps", "9")
    wait_text(page, "recipe-yaml", r"max_steps: 9")
    page.locator("#load-recipe").click()
    wait_text(page, "recipe-yaml", r"max_steps: 7")
    assert page.locator("#field-recipe-max_steps input").input_value() == "7"
    fill(page, "recipe-path", "/etc/hostname")
    page.locator("#load-recipe").click()
    assert "outside the directories" in wait_text(page, "recipe-message", r"Error")


@pytest.mark.slow
def test_data_preview_matches_data_inspect(page, server):
    page.get_by_role("tab", name="Data").click()
    page.locator("#data-show").click()
    cli = toolkit("data", "inspect", "demo", "-n", "3", cwd=server.root).stdout  # while the page's server works
    wait_text(page, "data-summary", r"examples from")
    shown = [" ".join(t.split()) for t in page.locator("#data-samples .token.highlighted").all_inner_texts()]
    # the summary line explains the [[brackets]]; nothing but blank lines may come before it (one CI run's stdout,
    # under load, held a line before it that the assertion did not show: anything but a blank one is named here)
    before, _, body = cli.partition("trained tokens are shown in [[brackets]]\n")
    assert body and not before.strip("\n").count("\n"), cli[:2000]
    trained = [" ".join(t.split()) for t in re.findall(r"\[\[(.*?)\]\]", body, flags=re.S)]
    assert len(trained) >= 3 and shown == trained
    shot(page, "data")


@pytest.mark.slow
def test_plan_matches_cli(page, server):
    page.get_by_role("tab", name="Plan").click()
    fill(page, "plan-gpus", "2")
    page.locator("#plan-run").click()
    from toolkit.models import materialize_preset

    cli = toolkit("plan", "--model", str(materialize_preset("tiny-llama")), "--gpus", "2", "--gpu", "h100", "--seq-len", "4096",
                  "--tuner", "full", cwd=server.root).stdout
    lines = [line.strip() for line in cli.splitlines() if line.strip()]
    report = wait_text(page, "plan-report", re.escape(lines[0]))
    # the code view may draw its lines over several frames on a busy machine (one CI run read it mid-way):
    # read it again until every line is there or 30 s have passed
    deadline = time.monotonic() + 30
    while any(line not in report for line in lines) and time.monotonic() < deadline:
        time.sleep(0.5)
        report = text_of(page, "plan-report")
    missing = [line for line in lines if line not in report]
    assert not missing, (missing, report)
    shot(page, "plan")


@pytest.mark.slow
def test_launch_watch_stop_resume_export_chat(page, server):
    """The issue's path: a tiny-llama recipe on the demo data, launched; its loss curve grows;
    stop saves a checkpoint; resume continues from it; export; chat answers as `toolkit infer` does."""
    fill(page, "field-recipe-output", "e2e")
    fill(page, "field-recipe-max_steps", "100000")
    wait_text(page, "recipe-command", r"--max-steps 100000")
    page.locator("#launch").click()
    page.locator("#runs-table").wait_for(state="visible")
    run_dir = server.runs / "e2e"
    first = wait_text(page, "runs-table", r"e2e\s+running\s+([3-9]|\d\d+)")
    drawn = loss_line_points(page, at_least=3)
    assert loss_line_points(page, at_least=drawn + 3) > drawn  # the curve grows while the run trains
    page.locator("#stop-run").click()
    stopped = wait_text(page, "runs-table", r"e2e\s+stopped at step (\d+)")
    step = int(re.search(r"stopped at step (\d+)", stopped).group(1))
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["step"] == step and (run_dir / "checkpoints" / f"step-{step}").is_dir(), first
    page.locator("#resume-run").click()
    wait_text(page, "run-log", r"step=\d+ loss=")  # the page shows the log's tail...
    deadline = time.monotonic() + 120
    while f"step-{step} at step {step}" not in (run_dir / "webui.log").read_text() and time.monotonic() < deadline:
        time.sleep(0.5)  # ...which a fast run scrolls past the resume line within a second
    assert f"resumed from {run_dir / 'checkpoints' / f'step-{step}'} at step {step}" in (run_dir / "webui.log").read_text()
    wait_text(page, "runs-table", r"e2e\s+running")
    deadline = time.monotonic() + 120
    while last_step(run_dir) <= step + 3 and time.monotonic() < deadline:
        time.sleep(0.5)
    shot(page, "runs")
    page.locator("#stop-run").click()
    resumed = wait_text(page, "runs-table", r"e2e\s+stopped at step (\d+)")
    assert int(re.search(r"stopped at step (\d+)", resumed).group(1)) > step
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(steps) and steps[step] == step + 1  # the resumed run continued where it stopped

    page.get_by_role("tab", name="Export").click()
    page.locator("#export-refresh").click()
    choose(page, "export-source", "e2e")
    page.locator("#export-run").click()
    wait_text(page, "export-message", r"Exported to")
    assert (run_dir / "export" / "config.json").is_file()
    shot(page, "export")

    page.get_by_role("tab", name="Chat").click()
    fill(page, "chat-model", str(run_dir / "export"))
    question = "What is the capital of Lopehes?"
    fill(page, "chat-prompt", question)
    page.locator("#chat-send").click()
    expected = toolkit("infer", str(run_dir / "export"), "--prompt", question, cwd=server.root).stdout.strip().splitlines()[-1]
    answer = wait_text(page, "chat-box", re.escape(expected[:20]) if expected.strip() else r"\S", timeout=180)
    assert expected.strip() in answer
    shot(page, "chat")


@pytest.mark.slow
def test_grpo_from_the_page_draws_its_rewards(page, server):
    """toolkit-rl's grpo chosen in the form, its reward named, launched: the reward plot draws the run's
    reward series, one point per logged step."""
    pytest.importorskip("toolkit_rl")
    import shutil

    prompts = Path(__file__).resolve().parents[3] / "examples" / "capitals-prompts.jsonl"
    shutil.copy(prompts, server.data / prompts.name)
    choose(page, "field-recipe-loss", "grpo")
    page.locator("#section-grpo").wait_for(state="visible")
    fill(page, "field-recipe-dataset", str(server.data / prompts.name))
    fill(page, "field-recipe-output", "rl")
    fill(page, "field-recipe-max_steps", "4")
    fill(page, "field-grpo-rewards", "answer")
    page.locator("#section-answer").wait_for(state="visible")  # the named reward's options appear
    for name, value in (("num_generations", "2"), ("prompts_per_rollout", "2"), ("max_new_tokens", "4")):
        fill(page, f"field-grpo-{name}", value)
    command = wait_text(page, "recipe-command", r"--reward answer").strip().splitlines()[-1]
    assert command.startswith("toolkit grpo ")
    assert "--grpo-epsilon" not in command  # left empty: the default clip range, not a range of 0
    page.locator("#launch").click()
    wait_text(page, "runs-table", r"rl\s+finished", timeout=300)
    assert loss_line_points(page, at_least=4, plot="reward") == 4
    series = {json.dumps(k) for row in (server.runs / "rl" / "metrics.jsonl").read_text().splitlines()
              for k in json.loads(row) if "reward" in k}
    legend = page.locator("#plot-reward").inner_text()
    assert all(json.loads(name) in legend for name in series), (series, legend)
    shot(page, "runs-reward")
