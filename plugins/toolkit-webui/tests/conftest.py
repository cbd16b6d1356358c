"""Fixtures: a real ``toolkit webui`` server in a subprocess, and Debian's chromium driven by Playwright.

The browser is never downloaded: Playwright starts the system's chromium (``TOOLKIT_CHROMIUM`` or
/usr/bin/chromium). Without one the browser tests skip, except in CI (``CI`` or ``TOOLKIT_CI`` set),
where a missing chromium is a failure: .ci/run installs it.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from toolkit import forkserver
from toolkit.train.distributed import free_port

CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage"]


def chromium_path() -> str | None:
    explicit = os.environ.get("TOOLKIT_CHROMIUM")
    if explicit:
        return explicit
    for name in ("chromium", "chromium-browser"):
        found = shutil.which(name)
        if found:
            return found
    return None


def in_ci() -> bool:
    return any(os.environ.get(name, "").lower() not in ("", "0", "false") for name in ("CI", "TOOLKIT_CI"))


class Server:
    """``toolkit webui`` on a free localhost port, with its runs and data directories."""

    def __init__(self, root: Path):
        self.root = root
        self.runs = root / "runs"
        self.data = root / "data"
        self.data.mkdir(parents=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/"
        self.log = root / "webui-server.log"
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "GRADIO_ANALYTICS_ENABLED": "False", "OMP_NUM_THREADS": "1",
               "TOKENIZERS_PARALLELISM": "false"}
        forkserver.warm()  # so that the server, and every run it launches, is forked from it (toolkit._forksite)
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "toolkit", "webui", "--runs-dir", str(self.runs), "--data-dir", str(self.data),
                 "--port", str(self.port)], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, cwd=root)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"toolkit webui exited with {self.process.returncode}:\n{self.log.read_text()}")
            try:
                urllib.request.urlopen(self.url, timeout=2).read()
                return
            except OSError:
                time.sleep(0.5)
        raise RuntimeError(f"toolkit webui did not answer in 120 s:\n{self.log.read_text()}")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)  # the server stops its own runs, each with a checkpoint
            try:
                self.process.wait(180)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory):
    """One server for the browser and the security tests (which only read from it)."""
    srv = Server(tmp_path_factory.mktemp("webui"))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def browser():
    executable = chromium_path()
    if executable is None:
        if in_ci():
            pytest.fail("CI must run the browser tests but no chromium is installed (apt-get install chromium; .ci/run does)")
        pytest.skip("no chromium on this machine (apt-get install chromium); the browser tests need it")
    try:
        import playwright.sync_api as playwright
    except ImportError:
        if in_ci():
            pytest.fail("CI must run the browser tests but playwright is not installed (toolkit-webui[test] has it)")
        pytest.skip("playwright is not installed (pip install -e 'plugins/toolkit-webui[test]')")
    with playwright.sync_playwright() as p:
        instance = p.chromium.launch(executable_path=executable, headless=True, args=CHROMIUM_FLAGS)
        yield instance
        instance.close()


@pytest.fixture
def page(browser, server):
    context = browser.new_context(viewport={"width": 1400, "height": 1000})  # a fresh profile per test
    tab = context.new_page()
    tab.set_default_timeout(60_000)
    tab.goto(server.url)
    tab.wait_for_selector("#recipe-yaml")
    tab.wait_for_function("(document.querySelector('#recipe-yaml')?.innerText || '').includes('model:')")  # page.load done
    yield tab
    context.close()
