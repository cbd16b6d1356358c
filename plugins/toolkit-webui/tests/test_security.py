"""Localhost unless asked; no file outside the chosen directories readable through the page."""

from __future__ import annotations

import urllib.error
import urllib.request

import pytest

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


def test_page_calls_no_outside_host(server):
    """The page and its theme load nothing from a web font service (Gradio 6 serves its fonts itself)."""
    for path in ("", "theme.css"):
        text = urllib.request.urlopen(f"{server.url}{path}", timeout=10).read().decode()
        assert "fonts.googleapis" not in text and "fonts.gstatic" not in text, path
