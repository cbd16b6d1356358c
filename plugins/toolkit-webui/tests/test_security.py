"""Localhost unless asked; no file outside the chosen directories readable through the page."""

from __future__ import annotations

import urllib.error
import urllib.request

import pytest

from toolkit.errors import ToolkitError
from toolkit_webui import command, tools
from toolkit_webui.paths import PathRefused, Roots


def test_paths_outside_the_roots_are_refused(tmp_path):
    runs, data, outside = tmp_path / "runs", tmp_path / "data", tmp_path / "secret"
    for d in (runs, data, outside):
        d.mkdir()
    (outside / "key.txt").write_text("secret")
    (runs / "link").symlink_to(outside)
    roots = Roots(runs, [data])
    assert roots.readable_path("x/recipe.yaml", "recipe") == runs / "x" / "recipe.yaml"
    assert roots.readable_path(str(data / "d.jsonl"), "dataset") == data / "d.jsonl"
    for sneaky in ("/etc/passwd", "../secret/key.txt", "link/key.txt", str(outside / "key.txt")):
        with pytest.raises(PathRefused, match="outside the directories"):
            roots.readable_path(sneaky, "dataset")
    with pytest.raises(PathRefused, match="--runs-dir"):
        roots.writable_path(str(data / "out"), "output")  # data directories are read-only


def test_tools_check_paths_before_reading(tmp_path):
    roots = Roots(tmp_path / "runs")
    with pytest.raises(PathRefused):
        tools.preview(roots, "/etc/passwd", "tiny-llama", "sft", "auto", 1, 64)
    with pytest.raises(PathRefused):
        tools.generate(roots, "/etc", "hf", {}, "hi")
    assert tools.dataset_reference(roots, "demo") == "demo"  # bundled names are not paths


def test_values_naming_files_outside_are_refused(tmp_path):
    """Options whose meaning the page cannot know (a reward's file.py:function, a DeepSpeed JSON, adapter
    lists): any piece that resolves outside the roots is refused; plain names, and paths inside, pass."""
    runs, data, outside = tmp_path / "runs", tmp_path / "data", tmp_path / "secret"
    for d in (runs, data, outside):
        d.mkdir()
    (runs / "escape").symlink_to(outside)
    roots = Roots(runs, [data])
    for fine in ("answer", "answer:0.5", "my_rewards:score", "rewards.py:score:2", "eval/loss", f"{data}/r.py:f",
                 ["q_proj", "v_proj"], {"instruction": "question"}, "https://example.com/x", "a=adapters/a,b=adapters/b", 3, None):
        roots.check_mentions(fine, "--option")
    for sneaky in ("/etc/passwd", f"{outside}/r.py:score", "answer,../secret/r.py:f", "escape/r.py:f", "~/.ssh/id_rsa",
                   "a=adapters/a,b=/etc", ["answer", "/tmp"], {"x": "/etc/shadow"}, "file:///etc/passwd", "bad\0path"):
        with pytest.raises(PathRefused, match="--option"):
            roots.check_mentions(sneaky, "--option")


def test_recipe_refuses_files_outside_in_any_field(tmp_path):
    """--eval-dataset (read by the run, shown in its log) and every other field: the recipe is not launchable."""
    from toolkit_webui import forms
    from toolkit_webui.app import App

    app = App(Roots(tmp_path / "runs"))
    raw = {f.key: forms.widget_value(f, f.default) for f in app.fields}
    for key, value, flag in (("eval_dataset", "/etc/passwd", "--eval-dataset"), ("columns", "instruction=/etc/hosts", "--columns")):
        values, problems = app.compose({**raw, key: value})
        assert any(p.startswith(f"{flag}: ") and "outside the directories" in p for p in problems), problems
        with pytest.raises(ToolkitError, match="outside the directories"):
            app.launch({**raw, key: value}, 1)
    values, problems = app.compose({**raw, "eval_dataset": "evals/held-out.jsonl"})
    assert problems == [] and values["eval_dataset"] == [str(tmp_path / "runs" / "evals" / "held-out.jsonl")]
    assert app.runs.processes == {}


def test_reward_file_outside_is_refused(tmp_path):
    """toolkit-rl's --reward takes file.py:function: a file outside the roots would be imported and run."""
    pytest.importorskip("toolkit_rl")
    from toolkit_webui import forms
    from toolkit_webui.app import App

    app = App(Roots(tmp_path / "runs"))
    raw = {**{f.key: forms.widget_value(f, f.default) for f in app.fields}, "loss": "grpo"}
    _, problems = app.compose({**raw, "grpo.rewards": "answer, /tmp/evil.py:score"})
    assert any(p.startswith("--reward: /tmp/evil.py:score is outside") for p in problems), problems
    _, problems = app.compose({**raw, "grpo.rewards": "answer, rewards.py:score:0.5"})
    assert problems == []


def test_resume_checks_a_cli_runs_recipe(tmp_path):
    """A run started outside the page is resumed from its recipe.yaml: the paths in it are checked first."""
    from toolkit_webui.app import App

    runs = tmp_path / "runs"
    (runs / "cli-run").mkdir(parents=True)
    (runs / "cli-run" / "recipe.yaml").write_text(f"model: tiny-llama\ndataset: [{tmp_path}/elsewhere.jsonl]\n")
    app = App(Roots(runs))
    with pytest.raises(PathRefused, match="elsewhere.jsonl is outside"):
        app.resume(runs / "cli-run")
    assert app.runs.processes == {}


def test_links_in_a_run_directory_are_not_followed_out(tmp_path):
    """A link planted in a run directory: the page shows nothing through it and starts no run that would
    write through it (the log is opened for appending, the run writes metrics.jsonl)."""
    from toolkit_webui.app import App

    runs, outside = tmp_path / "runs", tmp_path / "secret"
    outside.mkdir()
    (outside / "key.txt").write_text("the secret\n")
    (outside / "metrics.jsonl").write_text('{"step": 1, "loss": 42.0}\n')
    run = runs / "planted"
    run.mkdir(parents=True)
    (run / "recipe.yaml").write_text("model: tiny-llama\n")
    (run / "webui.log").symlink_to(outside / "key.txt")
    (run / "metrics.jsonl").symlink_to(outside / "metrics.jsonl")
    app = App(Roots(runs))
    rows, _, loss, *_, log = app.run_view(str(run))
    assert "the secret" not in log and "not shown" in log
    assert loss.empty and rows == [["planted", "empty", "0", ""]]
    with pytest.raises(ToolkitError, match="symbolic link"):
        app.resume(run)
    with pytest.raises(ToolkitError, match="symbolic link"):
        app.runs.launch(["sft"], run)
    assert app.runs.processes == {} and (outside / "key.txt").read_text() == "the secret\n"


def test_chat_and_export_options_are_checked(tmp_path):
    roots = Roots(tmp_path / "runs")
    with pytest.raises(PathRefused, match="hf option"):
        tools.generate(roots, "tiny-llama", "hf", {"dtype": "/etc/passwd"}, "hi")
    (tmp_path / "runs" / "r").mkdir(parents=True)
    with pytest.raises(PathRefused, match="exporter option"):
        tools.export(roots, "r", "hf", "r/export", "template=/etc/passwd")


def test_backend_options_at_their_defaults_are_the_operators(tmp_path):
    """vllm's python option defaults to $TOOLKIT_VLLM_PYTHON (an interpreter outside the roots): left as it
    is, it passes; typed into the page, a path outside is refused."""
    import dataclasses

    @dataclasses.dataclass(kw_only=True)
    class Config:
        python: str = "/opt/vllm/bin/python"
        lora: str = ""

    roots = Roots(tmp_path)
    tools.check_options(roots, Config, {"python": "/opt/vllm/bin/python", "lora": "adapters/a"}, "vllm")
    for typed in ({"python": "/usr/bin/python3"}, {"lora": "/home/someone/adapter"}):
        with pytest.raises(PathRefused, match="vllm option"):
            tools.check_options(roots, Config, typed, "vllm")


def test_remote_host_needs_the_flag_and_warns(monkeypatch, tmp_path):
    from click.testing import CliRunner

    served = []
    monkeypatch.setattr(command, "serve", lambda *args: served.append(args))
    runner = CliRunner()
    refused = runner.invoke(command.webui_command, ["--host", "0.0.0.0", "--runs-dir", str(tmp_path)])
    assert refused.exit_code != 0 and "--allow-remote" in refused.output and not served
    allowed = runner.invoke(command.webui_command, ["--host", "0.0.0.0", "--allow-remote", "--runs-dir", str(tmp_path)])
    assert allowed.exit_code == 0 and "WARNING" in allowed.output and served[0][2] == "0.0.0.0"
    local = runner.invoke(command.webui_command, ["--runs-dir", str(tmp_path)])
    assert local.exit_code == 0 and served[1][2] == "127.0.0.1" and "WARNING" not in local.output


def status_of(url: str) -> int:
    try:
        return urllib.request.urlopen(url, timeout=10).status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_server_serves_no_file(server):
    (server.runs / "mine.txt").write_text("a file inside the runs directory")
    assert status_of(server.url) == 200
    for path in ("/etc/passwd", str(server.runs / "mine.txt"), str(server.root / "webui-server.log")):
        assert status_of(f"{server.url}gradio_api/file={path}") in (403, 404), path


def test_answers_only_requests_to_localhost(server):
    """DNS rebinding: a page of another domain re-pointed at 127.0.0.1 sends its own Host header; the server
    answers it with an error, and serves requests to 127.0.0.1 and localhost."""
    for host, expected in ((f"127.0.0.1:{server.port}", 200), (f"localhost:{server.port}", 200), (f"evil.example:{server.port}", 421),
                           ("evil.example", 421), (f"127.0.0.1.evil.example:{server.port}", 421)):
        request = urllib.request.Request(f"{server.url}config", headers={"Host": host})
        try:
            status = urllib.request.urlopen(request, timeout=10).status
        except urllib.error.HTTPError as exc:
            status = exc.code
        assert status == expected, host


def test_page_calls_no_outside_host(server):
    """The page and its theme load nothing from a web font service (Gradio 6 serves its fonts itself)."""
    for path in ("", "theme.css"):
        text = urllib.request.urlopen(f"{server.url}{path}", timeout=10).read().decode()
        assert "fonts.googleapis" not in text and "fonts.gstatic" not in text, path
