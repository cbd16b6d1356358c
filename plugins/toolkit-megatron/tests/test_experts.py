"""GroupedExperts (toolkit_megatron.experts) against Megatron-Core's SequentialMLP: outputs and gradients of the
module (kernel, stacking, loop and fused-SwiGLU paths; with LoRA on the experts at ETP2) and of a whole Qwen3-MoE model
at EP1, EP2 and TP2+SP with ETP2 and ETP1 (2 processes, gloo); the model's logits also against Hugging Face."""

from __future__ import annotations

import pytest

from conftest import run_worker

pytestmark = pytest.mark.slow


def test_grouped_experts_equal_sequential_mlp(tiny_models, tmp_path):
    result = run_worker("_experts_worker.py", tmp_path, str(tiny_models["qwen3_moe"]),
                        "ep=1,ep=2,tp=2+sp=1+etp=2,tp=2+sp=1+etp=1")
    assert result["module"].pop("kernel_failures") == []
    for key, entry in result["module"].items():
        bf16 = "bfloat16" in key
        # fp32: the same products summed in another order; bf16: one rounding of the output apart at most
        tolerance = 2e-2 * entry["scale"] if bf16 else 1e-5
        assert entry["output"] <= tolerance and entry["grads"] <= (5e-2 if bf16 else 1e-5), (key, entry)
        assert entry["packed"], key  # the zero-copy path: weights are slices of one tensor
        assert entry["empty_expert_grad"] == 0.0, key  # an expert without tokens gets a zero gradient, not None
    assert len(result["module"]) == 7
    for entry in result["lora_etp2"]:  # LoRA'd experts split over ETP2 run grouped, with SequentialMLP's gradients
        assert entry["unsupported"] is None and entry["expert_comm"] and entry["tp"] == 2, entry
        assert entry["names"] and entry["missing"] == [] and len(entry["grads"]) == 1 + 4 * 6, entry
        assert entry["output"] <= 1e-5 * max(1.0, entry["scale"]), entry
        assert max(entry["grads"].values()) <= 1e-5, entry
    for layout, ranks in result["model"].items():
        for entry in ranks:
            assert entry["types"] == ["SequentialMLP", "GroupedExperts"], layout
            assert entry["same_names"] and entry["expert_grads"] > 0, (layout, entry)
            assert entry["logits"] <= 1e-5 and entry["hf"] <= 1e-4, (layout, entry)
            assert entry["grads"] <= 1e-5, (layout, entry)
