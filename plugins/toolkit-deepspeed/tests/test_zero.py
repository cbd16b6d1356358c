"""ZeRO-1/2/3 on two gloo ranks against the ``local`` DDP strategy: trajectories, resume, export.

One torchrun launch (``scenarios.py``) runs every scenario; the tests read its report.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def report(scenarios):
    return scenarios("core")


@pytest.mark.parametrize("stage", ["zero1", "zero2", "zero3"])
def test_loss_trajectory_equals_ddp(report, stage):
    reference, ours = report.series("local", "loss"), report.series(stage, "loss")
    assert len(ours) == 5
    assert ours == pytest.approx(reference, rel=2e-6, abs=2e-6)
    # The loss moved: the comparison is not between two untrained models.
    assert reference[-1] < reference[0] - 0.5


@pytest.mark.parametrize("stage", ["zero1", "zero2", "zero3"])
def test_gradient_norms_are_summed_over_ranks_like_ddp(report, stage):
    # Adam hides a constant gradient factor from the loss; the pre-clip norm does not.
    assert report.series(stage, "grad_norm") == pytest.approx(report.series("local", "grad_norm"), rel=1e-5)
    assert report.series(stage, "lr") == pytest.approx(report.series("local", "lr"), rel=1e-12)


@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_resume_reproduces_the_remaining_steps(report, stage):
    resumed = report[f"{stage}-resumed"]["history"]
    uninterrupted = report[stage]["history"][3:]
    assert [s["loss"] for s in resumed] == pytest.approx([s["loss"] for s in uninterrupted], rel=1e-7, abs=1e-7)
    assert [s["lr"] for s in resumed] == pytest.approx([s["lr"] for s in uninterrupted], rel=1e-12)


def test_zero3_export_reloads_in_transformers_with_the_same_logps(report):
    engine, reloaded = report["zero3"]["engine_logps"], report["zero3"]["reloaded_logps"]
    flat = [v for row in engine for v in row]
    assert any(v < -0.1 for v in flat)
    assert [v for row in reloaded for v in row] == pytest.approx(flat, abs=1e-5)
    # ... and the same model as DDP trained.
    ddp = [v for row in report["local"]["reloaded_logps"] for v in row]
    assert [v for row in reloaded for v in row] == pytest.approx(ddp, abs=1e-4)


@pytest.mark.parametrize("stage", ["zero1", "zero2", "zero3", "zero3-freeze-moe"])
def test_checkpoint_consolidation_equals_the_live_export(report, stage):
    assert report[stage]["offline_missing"] == []
    assert report[stage]["offline_max_diff"] == 0.0


@pytest.mark.parametrize("run", ["zero1-bf16", "zero2-bf16", "zero3-offload-bf16"])
def test_bf16_trains_close_to_fp32(report, run):
    """DeepSpeed's bf16 (bf16 weights, fp32 masters; ZeRO-3 also with CPU offload of parameters and optimizer)."""
    ours = report.series(run, "loss")
    assert ours == pytest.approx(report.series("local", "loss")[: len(ours)], rel=2e-3)
    assert report.series(run, "lr") == pytest.approx(report.series("local", "lr")[: len(ours)], rel=1e-12)
    assert ours[-1] < ours[0]


@pytest.mark.parametrize("stage", ["zero1-lora", "zero3-lora"])
def test_adapter_tuner_with_reference_loss_matches_ddp(report, stage):
    """An adapter tuner (frozen base, merged export) and a loss needing reference log-probs."""
    reference, ours = report.series("local-lora", "loss"), report.series(stage, "loss")
    assert ours == pytest.approx(reference, rel=2e-6, abs=2e-6)
    assert report.series(stage, "grad_norm") == pytest.approx(report.series("local-lora", "grad_norm"), rel=1e-5)
    assert reference[-1] < reference[0] - 0.1


@pytest.mark.parametrize("stage", ["zero1-lora", "zero3-lora"])
def test_adapter_tuner_resume_and_merged_export(report, stage):
    resumed = [s["loss"] for s in report[f"{stage}-resumed"]["history"]]
    assert resumed == pytest.approx([s["loss"] for s in report[stage]["history"][3:]], rel=1e-7, abs=1e-7)
    # The merged export reloads as a plain HF model giving the trained policy's log-probs.
    engine = [v for row in report[stage]["engine_logps"] for v in row]
    assert [v for row in report[stage]["reloaded_logps"] for v in row] == pytest.approx(engine, abs=1e-5)
    assert report[stage]["offline_missing"] == [] and report[stage]["offline_max_diff"] < 1e-6


@pytest.mark.parametrize("stage", ["zero2-ref", "zero3-ref"])
def test_frozen_reference_model_matches_ddp(report, stage):
    """Full tuning with a reference loss: ZeRO-3 shards a second, frozen engine for the reference."""
    assert report.series(stage, "loss") == pytest.approx(report.series("local-ref", "loss"), rel=1e-5, abs=1e-6)
    assert report.series(stage, "grad_norm") == pytest.approx(report.series("local-ref", "grad_norm"), rel=1e-5)


def test_evaluate_matches_ddp(report):
    assert report["zero3"]["evaluate"]["loss"] == pytest.approx(report["local"]["evaluate"]["loss"], rel=1e-6)


def test_gradient_checkpointing_under_zero3_matches_ddp(report):
    assert report.series("zero3-checkpointing", "loss") == pytest.approx(report.series("local", "loss")[:3], rel=2e-6)
    assert report.series("zero3-checkpointing", "grad_norm") == pytest.approx(report.series("local", "grad_norm")[:3], rel=1e-5)


def test_moe_model_under_zero3_matches_ddp(report):
    """Router auxiliary loss included: tiny Qwen2-MoE, experts partitioned by ZeRO-3."""
    assert report.series("zero3-moe", "loss") == pytest.approx(report.series("local-moe", "loss"), rel=2e-6)
    assert report.series("zero3-moe", "grad_norm") == pytest.approx(report.series("local-moe", "grad_norm"), rel=1e-5)


def test_freeze_tuner_on_moe_exports_what_trained(report):
    """Frozen layers are not in the checkpoint; the export takes them from the base model."""
    entry = report["zero3-freeze-moe"]
    engine = [v for row in entry["engine_logps"] for v in row]
    assert [v for row in entry["reloaded_logps"] for v in row] == pytest.approx(engine, abs=1e-5)
    assert report.series("zero3-freeze-moe", "loss")[-1] < report.series("zero3-freeze-moe", "loss")[0] - 0.5
