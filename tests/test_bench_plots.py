"""bench/plot_results.py reads every committed GPU result file (the figures in docs/benchmarks.md come from it)."""

from __future__ import annotations

import importlib.util
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def plot_results():
    spec = importlib.util.spec_from_file_location("plot_results", ROOT / "bench" / "plot_results.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_every_committed_result_file_becomes_a_figure_with_one_baseline_per_group():
    module = plot_results()
    files = module.newest_per_kind(ROOT / "bench" / "results")
    assert {module.file_facts(f)[0] for f in files} == set(module.KINDS)
    for path in files:
        figure = module.figure_of(path)
        assert figure.bars and all(b.tokens_per_s > 0 and b.peak_gib > 0 for b in figure.bars), path
        for group in {b.group for b in figure.bars}:
            assert sum(b.baseline for b in figure.bars if b.group == group) == 1, (path, group)
        assert module.file_facts(path)[2] in figure.title
    speed = {b.label: b for b in module.figure_of(ROOT / "bench" / "results" / "speed-h200-2026-11-30.json").bars}
    assert speed["local+kernels+fused"].tokens_per_s / speed["hf"].tokens_per_s == pytest.approx(1.24, abs=0.005)
    assert speed["lora+kernels+fused"].group == speed["hf-peft"].group == "lora" and speed["hf-peft"].baseline


def test_matplotlib_stays_out_of_the_toolkits_dependencies(tmp_path):
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not any("matplotlib" in d for d in project["dependencies"])
    assert any("matplotlib" in d for d in project["optional-dependencies"]["bench"])
    pytest.importorskip("matplotlib")
    module = plot_results()
    module.draw(module.figure_of(ROOT / "bench" / "results" / "moe-h200-2026-11-30.json"), tmp_path / "moe.png")
    assert (tmp_path / "moe.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
