"""Megatron LoRA takes its initial adapters from the tuner's ``initial_adapters`` (contracts.OPTIONAL), never
from a loaded HF model: a tuner without it is refused by name; one with it is all hf_adapters reads."""

from __future__ import annotations

import types

import pytest
import torch

from toolkit.errors import ConfigError
from toolkit_megatron.lora import hf_adapters


class _Tuner:
    name = "lora"

    def __init__(self, state):
        self.config = types.SimpleNamespace(rank=2, alpha=4.0, rslora=False)
        self.state, self.calls = state, []

    def initial_adapters(self, source, recipe):
        self.calls.append((source, recipe))
        return self.state


def test_adapters_come_from_initial_adapters_and_are_grouped_per_projection(monkeypatch):
    import toolkit.models

    monkeypatch.setattr(toolkit.models, "load_hf_model", lambda *a, **k: pytest.fail("load_hf_model was called"))
    a, b = torch.randn(2, 8), torch.zeros(6, 2)
    state = {"model.layers.1.self_attn.q_proj.lora_A.default.weight": a,
             "model.layers.1.self_attn.q_proj.lora_B.default.weight": b,
             "model.layers.0.mlp.down_proj.lora_A.default.weight": torch.randn(2, 12),
             "model.layers.0.mlp.down_proj.lora_B.default.weight": torch.zeros(8, 2)}
    tuner = _Tuner(state)
    adapters, scale = hf_adapters("SOURCE", tuner, "RECIPE")
    assert tuner.calls == [("SOURCE", "RECIPE")]
    assert set(adapters) == {(1, "q_proj"), (0, "down_proj")} and scale == 2.0
    assert torch.equal(adapters[(1, "q_proj")]["A"], a) and torch.equal(adapters[(1, "q_proj")]["B"], b)


def test_adapters_on_fused_linears_map_to_megatron_fused_parameters():
    """Phi-3's qkv_proj / gate_up_proj: one adapter each, on linear_qkv / linear_fc1 (their rows reordered
    when wrapped; tests/test_families.py checks the order against the bridge's)."""
    from toolkit_megatron.lora import _HF_TO_PARTS

    state = {f"model.layers.0.{where}.lora_{m}.default.weight": torch.zeros(2, 8)
             for where in ("self_attn.qkv_proj", "mlp.gate_up_proj") for m in "AB"}
    adapters, _ = hf_adapters("SOURCE", _Tuner(state), "RECIPE")
    assert set(adapters) == {(0, "qkv_proj"), (0, "gate_up_proj")}
    assert _HF_TO_PARTS["qkv_proj"] == ("linear_qkv", "qkv") and _HF_TO_PARTS["gate_up_proj"] == ("linear_fc1", "gate_up")


def test_a_tuner_without_initial_adapters_is_refused_by_name():
    class Plain:
        name = "mylora"
        config = types.SimpleNamespace(rank=2, alpha=4.0)

    with pytest.raises(ConfigError, match="--tuner mylora has no initial_adapters"):
        hf_adapters("SOURCE", Plain(), "RECIPE")


def test_an_adapter_on_a_module_megatron_cannot_map_is_refused():
    tuner = _Tuner({"model.layers.0.mlp.experts.3.gate_proj.lora_A.default.weight": torch.zeros(2, 8)})
    with pytest.raises(ConfigError, match="cannot map"):
        hf_adapters("SOURCE", tuner, "RECIPE")


def test_adapters_on_latent_attention_projections_map_to_mla_linears():
    """DeepSeek's MLA projections (refused before issue 27's audit): each its own Megatron linear; test_bridge.py's
    launch holds their logits, gradients and merged export to PEFT's."""
    from toolkit_megatron.lora import _MLA_TO_PARTS

    names = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
    state = {f"model.layers.1.self_attn.{name}.lora_{m}.default.weight": torch.zeros(2, 8) for name in names for m in "AB"}
    adapters, _ = hf_adapters("SOURCE", _Tuner(state), "RECIPE")
    assert set(adapters) == {(1, name) for name in names}
    assert _MLA_TO_PARTS["kv_a_proj_with_mqa"] == ("linear_kv_down_proj", "kv_down")
    assert _MLA_TO_PARTS["q_a_proj"] == ("linear_q_down_proj", "column")
