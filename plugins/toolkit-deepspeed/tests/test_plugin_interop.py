"""The real first-party tuners and losses under ZeRO, through their registered names only.

Runs when toolkit-peft and toolkit-dpo are installed (the repository's shared test session);
skipped otherwise. Each pair compares ZeRO with the ``local`` DDP strategy on the same data.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("toolkit_peft")
pytest.importorskip("toolkit_dpo")

from test_zero import HERE, series, torchrun  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    work = tmp_path_factory.mktemp("interop")
    path = work / "report.json"
    done = torchrun(HERE / "scenarios.py", str(path), str(work), env={"SCENARIOS": "plugins"})
    assert path.is_file(), f"scenarios failed (exit {done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    data = json.loads(path.read_text())
    assert not data.get("errors"), data["errors"]
    return data


@pytest.mark.parametrize(("ours", "reference", "norm_tolerance"), [
    ("zero3-peft-lora-dpo", "local-peft-lora-dpo", 1e-5),
    ("zero3-peft-dora", "local-peft-dora", 1e-5),
    ("zero2-peft-qlora", "local-peft-qlora", 3e-4),  # 4-bit dequantisation noise
])
def test_peft_tuners_match_ddp(report, ours, reference, norm_tolerance):
    assert series(report, ours, "loss") == pytest.approx(series(report, reference, "loss"), rel=1e-5, abs=1e-6)
    assert series(report, ours, "grad_norm") == pytest.approx(series(report, reference, "grad_norm"), rel=norm_tolerance)


def test_lora_dpo_zero3_export_and_consolidation(report):
    entry = report["zero3-peft-lora-dpo"]
    engine = [v for row in entry["engine_logps"] for v in row]
    assert [v for row in entry["reloaded_logps"] for v in row] == pytest.approx(engine, abs=1e-5)
    assert entry["offline_missing"] == [] and entry["offline_max_diff"] < 1e-6


def test_adapter_only_export_reads_the_deepspeed_checkpoint(report):
    """PEFT's own checkpoint reader gets the adapters the ZeRO-3 run trained (gathered into model.safetensors)."""
    entry = report["zero3-peft-lora-dpo"]
    assert entry["adapter_tensors"] == entry["adapter_matched"] > 0
    assert entry["adapter_max_diff"] == 0.0


def test_real_qlora_is_refused_under_zero3():
    from toolkit.recipe import resolve_recipe
    from toolkit_deepspeed.strategy import DeepSpeedStrategy

    recipe = resolve_recipe({"strategy": "deepspeed", "zero": 3, "tuner": "qlora"}, source="test")
    problems = DeepSpeedStrategy().validate(recipe, 2)
    assert any("--zero 3 cannot shard --tuner qlora" in p for p in problems), problems
