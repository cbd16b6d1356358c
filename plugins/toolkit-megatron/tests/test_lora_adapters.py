"""Megatron LoRA takes its initial adapters from the tuner's ``initial_adapters`` (contracts.OPTIONAL), never
from a loaded HF model: a tuner without it is refused by name; one with it is all hf_adapters reads. Which
Megatron linear an adapter lands on is read from the bridge's table (``_targets``). A fused gate_up adapter's rows are
checkpointed as ``[gate; up]`` at any split, and older checkpoints that hold them as the ranks' blocks still load."""

from __future__ import annotations

import types

import pytest
import torch

from toolkit.contracts import AdapterSpec
from toolkit.errors import ConfigError
from toolkit_megatron.lora import hf_adapters


class _Tuner:
    name = "lora"

    def __init__(self, state, rank=2, alpha=4.0, rslora=False):
        self.spec = AdapterSpec(target_modules=("all-linear",), rank=rank, alpha=alpha, rslora=rslora)
        self.state, self.calls = state, []

    def adapter_spec(self):
        return self.spec

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
    adapters = hf_adapters("SOURCE", tuner, "RECIPE")
    assert tuner.calls == [("SOURCE", "RECIPE")]
    assert set(adapters) == {(1, "model.layers.1.self_attn.q_proj"), (0, "model.layers.0.mlp.down_proj")}
    entry = adapters[(1, "model.layers.1.self_attn.q_proj")]
    assert entry["scale"] == 2.0 and torch.equal(entry["A"], a) and torch.equal(entry["B"], b)


@pytest.mark.parametrize(("family", "path", "expected"), [
    ("phi3", "model.layers.0.self_attn.qkv_proj", ("self_attention.linear_qkv", "qkv", "qkv")),
    ("phi3", "model.layers.0.mlp.gate_up_proj", ("mlp.linear_fc1", "gate_up", "gate_up")),
    ("llama", "model.layers.0.self_attn.k_proj", ("self_attention.linear_qkv", "k", "qkv")),
    ("llama", "model.layers.0.mlp.down_proj", ("mlp.linear_fc2", "row", "row")),
    ("qwen2_moe", "model.layers.0.mlp.shared_expert.up_proj", ("mlp.shared_experts.linear_fc1", "up", "gate_up")),
    ("deepseek_v3", "model.layers.0.self_attn.kv_a_proj_with_mqa", ("self_attention.linear_kv_down_proj", "column", "column")),
    ("mixtral", "experts.down_proj", ("mlp.experts.local_experts.{e}.linear_fc2", "row", "row")),
    ("qwen3_moe", "model.layers.0.mlp.gate", ("mlp.router", "weight", "gate")),
    ("mixtral", "model.layers.0.mlp.gate", ("mlp.router", "weight", "gate")),  # checkpoints: block_sparse_moe.gate
    ("qwen2_moe", "model.layers.0.mlp.shared_expert_gate", ("mlp.shared_experts", "gate_weight", "gate")),
])
def test_hf_modules_map_to_megatron_linears_through_the_bridge_table(family, path, expected):
    """Fused HF linears (Phi-3) become one adapter on the fused Megatron linear; separate ones a part of it; shared
    and routed experts and MLA's projections their own linears; the router and the shared expert gate their module's
    weight, under the HF module's name (not the checkpoint's): all read off the bridge's PER_LAYER table."""
    from toolkit_megatron.architectures import architecture_for
    from toolkit_megatron.lora import _targets

    assert expected in _targets(architecture_for(family), 0)[path]


def test_routed_expert_adapters_keep_peft_scale_and_are_told_apart_by_shape():
    """PEFT (transformers 5) adapts Qwen3-MoE's fused experts with one wrapper per parameter, nested; the fused
    gate/up gets twice the rank and alpha, so with rslora its scale differs from the attention's: each adapter's
    scale is PEFT's own ``scaling`` of that module."""
    import peft
    from peft.tuners.lora.layer import LoraLayer
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
                            num_key_value_heads=1, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24)
    model = peft.get_peft_model(AutoModelForCausalLM.from_config(config), peft.LoraConfig(
        r=2, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "gate_proj", "up_proj", "down_proj"]))
    inner = model.base_model.model
    state = {name: param for name, param in inner.named_parameters() if "lora_" in name}
    scales = {}
    for name, module in inner.named_modules():
        if isinstance(module, LoraLayer):
            key = name.split(".base_layer")[0] + (f".{module.parameter_name}" if hasattr(module, "parameter_name") else "")
            scales[key] = module.scaling["default"]
    adapters = hf_adapters(types.SimpleNamespace(config=config), _Tuner(state, rank=2, alpha=8.0, rslora=True), None)
    assert {path: entry["scale"] for (_, path), entry in adapters.items()} == pytest.approx(scales)
    assert set(scales) == {"model.layers.0.self_attn.q_proj", "model.layers.0.mlp.experts.gate_up_proj",
                           "model.layers.0.mlp.experts.down_proj"}
    assert len({round(s, 6) for s in scales.values()}) == 2  # the fused gate/up's differs


def test_a_tuner_without_initial_adapters_or_adapter_spec_is_refused_by_name():
    """Megatron reads a tuner's adapters through the contract only (``adapter_spec``, ``initial_adapters``): options
    that look like LoRA's (a ``config.rank``) are not enough."""
    class Plain:
        name = "mylora"
        config = types.SimpleNamespace(rank=2, alpha=4.0)

        def initial_adapters(self, source, recipe):
            return {}

    with pytest.raises(ConfigError, match=r"--tuner mylora has no adapter_spec\(\) method"):
        hf_adapters("SOURCE", Plain(), "RECIPE")
    Plain.adapter_spec = lambda self: AdapterSpec(target_modules=("q_proj",), rank=2, alpha=4.0)
    del Plain.initial_adapters
    with pytest.raises(ConfigError, match="--tuner mylora has no initial_adapters"):
        hf_adapters("SOURCE", Plain(), "RECIPE")


@pytest.mark.parametrize(("options", "flag"), [({"modules_to_save": ("lm_head",)}, "--lora-modules-to-save lm_head"),
                                             ({"bias": "all"}, "--lora-bias all")])
def test_options_megatron_would_not_train_are_refused_naming_the_flag(options, flag):
    tuner = _Tuner({})
    tuner.spec = AdapterSpec(target_modules=("q_proj",), rank=2, alpha=4.0, **options)
    with pytest.raises(ConfigError, match=flag):
        hf_adapters("SOURCE", tuner, "RECIPE")


@pytest.mark.parametrize("name", ["lm_head.lora_A.default.weight", "model.layers.0.self_attn.q_proj.base_layer.bias"])
def test_anything_trained_but_a_decoder_layer_adapter_is_refused(name):
    """An adapter outside the layers, or a trained bias: the strategy would leave it out, so it says so."""
    with pytest.raises(ConfigError, match="cannot map"):
        hf_adapters("SOURCE", _Tuner({name: torch.zeros(2, 8)}), "RECIPE")


_ROUTER = {"A": torch.zeros(2, 32), "B": torch.zeros(4, 2), "scale": 1.0}


@pytest.mark.parametrize(("path", "tensors", "dropout", "error"), [
    ("model.layers.0.mlp.shared_expert_gate", {"A": torch.zeros(2, 32), "B": torch.zeros(1, 2), "scale": 1.0}, 0.0,
     r"LoRA on model\.layers\.0\.mlp\.shared_expert_gate is not supported .*--lora-target-modules"),
    ("model.layers.0.mlp.gate", _ROUTER, 0.1, r"with dropout 0\.1.*--lora-dropout 0"),
    ("model.layers.0.mlp.gate", {**_ROUTER, "M": torch.ones(4)}, 0.0, r"DoRA on the gate model\.layers\.0\.mlp\.gate"),
], ids=["no-megatron-module", "gate-dropout", "gate-dora"])
def test_adapters_the_strategy_cannot_train_are_refused(path, tensors, dropout, error, tp1):
    """Qwen3-MoE has no shared expert gate, so the bridge has no weight for the adapter; a gate's adapter is merged
    into its weight, so dropout on its input cannot be honoured; DoRA on a gate is not implemented: each says which
    module and what to do instead of training something else."""
    from transformers import Qwen3MoeConfig

    from toolkit.parallel import ParallelLayout
    from toolkit_megatron.lora import apply_lora
    from toolkit_megatron.model import build_model

    config = Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
                            num_key_value_heads=1, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24)
    models = build_model(config, ParallelLayout())
    with pytest.raises(ConfigError, match=error):
        apply_lora(models, {(0, path): tensors}, dropout, config, models[0].vocab_size)


def _rank_entries(rows: torch.Tensor, ranks: int, metadata: dict | None) -> list:
    """Each of ``ranks`` ranks' checkpoint entry of an expert's fused gate_up ``B`` in Megatron's row order (``rows``:
    the whole HF ``[gate; up]``), expert 1 of 4 (the expert axis Megatron's experts prepend)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from toolkit_megatron.checkpoint import gate_up_rows
    from toolkit_megatron.lora import _megatron_rows

    offsets = ((0, 1, 4),)
    local = _megatron_rows("gate_up", rows, None, ranks).chunk(ranks)
    return [gate_up_rows(ShardedTensor.from_rank_offsets("b", local[rank], *offsets, (1, rank, ranks), prepend_axis_num=1),
                         offsets, metadata, expert=True) for rank in range(ranks)]


def _at(saved: torch.Tensor, piece) -> tuple:
    """Where ``piece`` (a ShardedTensor with one prepended expert axis) lies in the saved ``[experts, rows, r]``."""
    return (piece.global_offset[0], *(slice(o, o + n) for o, n in zip(piece.global_offset[1:], piece.local_shape, strict=True)))


@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_fused_gate_up_adapter_rows_are_saved_as_gate_then_up_at_any_split(ranks):
    """Each rank holds ``[gate shard; up shard]`` of a fused gate_up ``B``; the checkpoint holds ``[gate; up]`` whole
    (as Megatron saves the gated ``linear_fc1.weight``) however many ranks split it, so another split reads the same
    rows. Saved as the ranks' blocks (before), a TP1 reload of an ETP2 checkpoint read up rows as gate rows."""
    rows = torch.arange(24.0)[:, None].expand(24, 3)
    saved = torch.full((4, 24, 3), float("nan"))
    for entry in _rank_entries(rows, ranks, None):
        for piece in entry.build():
            saved[_at(saved, piece)] = piece.data
    assert torch.equal(saved[1], rows)


@pytest.mark.parametrize(("saved_at", "loaded_at"), [(2, 1), (2, 2), (2, 4), (4, 2), (3, 2)])
def test_fused_gate_up_adapter_rows_saved_as_rank_blocks_load_at_any_split(saved_at, loaded_at):
    """A checkpoint written before its marker said ``gate_up_adapter_rows: halves`` holds the rows as the saving ranks'
    ``[gate shard; up shard]`` blocks: each loading rank reads its own shard's rows from them."""
    from toolkit_megatron.checkpoint import load_metadata
    from toolkit_megatron.lora import _megatron_rows

    rows = torch.arange(24.0)[:, None].expand(24, 3)
    saved = torch.full((4, 24, 3), float("nan"))
    saved[1] = _megatron_rows("gate_up", rows, None, saved_at)
    metadata = load_metadata({"saved_layout": {"tensor": 1, "expert_tensor": saved_at}})
    assert load_metadata({"saved_layout": {"tensor": 2}, "gate_up_adapter_rows": "halves"}) == {}
    expected = _megatron_rows("gate_up", rows, None, loaded_at).chunk(loaded_at)
    for rank, entry in enumerate(_rank_entries(torch.zeros(24, 3), loaded_at, metadata)):
        assert torch.equal(entry.merge_fn([saved[_at(saved, piece)] for piece in entry.build()]), expected[rank])
