"""toolkit-webui is discovered, registers `toolkit webui`, and stays cheap: --help imports no Gradio or torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("TOOLKIT_")}


def test_toolkit_plugins_lists_this_plugin():
    result = subprocess.run([sys.executable, "-m", "toolkit", "plugins", "--json"], capture_output=True, text=True,
                            env=clean_env(), timeout=120)
    assert result.returncode == 0, result.stderr
    (row,) = [r for r in json.loads(result.stdout) if r["name"] == "webui"]
    assert (row["distribution"], row["error"]) == ("toolkit-webui", None)
    assert row["registers"] == {"command": ["webui"]}


def test_help_imports_neither_gradio_nor_torch():
    code = ("import sys\nfrom toolkit.cli import main\ntry:\n    main(['webui', '--help'])\nexcept SystemExit:\n    pass\n"
            "print('LOADED', [m for m in ('gradio', 'torch') if m in sys.modules])")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=clean_env(), timeout=120)
    assert "--allow-remote" in result.stdout and "LOADED []" in result.stdout, result.stdout + result.stderr
