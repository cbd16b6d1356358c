"""The bridge's mapping table, both directions, without Megatron: for every dense entry and TP 1, 2 and 4,
the shards each rank reads from HF tensors, joined as the gather joins them, give back the HF tensors bit
for bit (test_bridge.py checks the same through real Megatron models and logits)."""

from __future__ import annotations

import pytest
import torch

from toolkit_megatron.architectures import DeepseekV3Architecture, DenseArchitecture
from toolkit_megatron.bridge import (
    PER_LAYER,
    TOP_LEVEL,
    Geometry,
    SafetensorsReader,
    hf_from_full,
    hf_names,
    join_shards,
    mapping_of,
    read_local,
)

HEADS, GROUPS, HEAD_DIM, HIDDEN, FFN, VOCAB = 8, 4, 4, 32, 24, 50
TABLE = DeepseekV3Architecture
"""Its layer table names every per-layer row: the dense ones (DenseArchitecture's) and MLA's projections."""


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(0)
    shapes = {"q": (HEADS * HEAD_DIM, HIDDEN), "k": (GROUPS * HEAD_DIM, HIDDEN), "v": (GROUPS * HEAD_DIM, HIDDEN)}
    tensors = {}
    for part, layer_name in TABLE.layer.items():
        name = layer_name.format(i=3)
        if part in shapes:
            tensors[name + ".weight"] = torch.randn(shapes[part], generator=generator)
            tensors[name + ".bias"] = torch.randn(shapes[part][0], generator=generator)
        else:
            shape = {"o": (HIDDEN, HEADS * HEAD_DIM), "gate": (FFN, HIDDEN), "up": (FFN, HIDDEN), "down": (HIDDEN, FFN),
                     "q_norm": (HEAD_DIM,), "k_norm": (HEAD_DIM,), "q_proj": (HEADS * HEAD_DIM, HIDDEN),
                     "q_a": (16, HIDDEN), "q_b": (HEADS * HEAD_DIM, 16), "kv_a": (12, HIDDEN), "kv_b": (HEADS * 8, 8),
                     "kv_norm": (8,)}.get(part, (HIDDEN,))
            tensors[name] = torch.randn(shape, generator=generator)
    tensors[DenseArchitecture.embedding] = torch.randn(VOCAB, HIDDEN, generator=generator)
    tensors[DenseArchitecture.lm_head] = torch.randn(VOCAB, HIDDEN, generator=generator)
    tensors[DenseArchitecture.final_norm] = torch.randn(HIDDEN, generator=generator)
    directory = tmp_path_factory.mktemp("hf")
    save_file(tensors, str(directory / "model.safetensors"))
    return tensors, SafetensorsReader.from_directory(directory)


DENSE = [(name, None) for name in TOP_LEVEL] + [(f"decoder.layers.0.{leaf}", 3) for leaf, m in PER_LAYER.items()
                                                 if m.table == "layer"]


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize(("mcore_name", "layer"), DENSE, ids=[n for n, _ in DENSE])
def test_each_mapping_round_trips_through_every_tensor_parallel_split(checkpoint, mcore_name, layer, tp):
    tensors, reader = checkpoint
    mapping, _, expert = mapping_of(mcore_name, layer)
    names = hf_names(TABLE, mapping, layer, expert)
    assert all(name in tensors for name in names), names
    padded = -(-VOCAB // tp) * tp + tp  # Megatron pads the vocabulary to a multiple of TP
    shards = [read_local(reader, mapping, names, Geometry(HEADS, GROUPS, HEAD_DIM, FFN, VOCAB, padded, tp, rank))
              for rank in range(tp)]
    if mapping.split != "none" and tp > 1:
        assert len({shard.shape for shard in shards}) == 1  # even shards
        assert shards[0].numel() < sum(s.numel() for s in shards)  # each rank reads a part only
    full = join_shards(mapping, shards)
    back = hf_from_full(mapping, names, full, Geometry(HEADS, GROUPS, HEAD_DIM, FFN, VOCAB, padded, tp, 0))
    assert [name for name, _ in back] == names
    for name, tensor in back:
        assert torch.equal(tensor, tensors[name]), name


def test_unknown_parameters_have_no_mapping():
    assert mapping_of("decoder.layers.0.self_attention.linear_qkv.layer_norm_weight", 0) is None
    assert mapping_of("something.else", None) is None


@pytest.mark.parametrize(("family", "overrides"), [
    ("qwen3_moe", {"mlp_only_layers": [0, 3]}), ("qwen3_moe", {"decoder_sparse_step": 2}),
    ("qwen3_moe", {"decoder_sparse_step": 2, "mlp_only_layers": [1]}), ("qwen2_moe", {"decoder_sparse_step": 3}),
    ("qwen2_moe", {}), ("mixtral", {}),
])
def test_moe_layer_pattern_is_the_one_transformers_builds(family, overrides):
    """Which layers hold experts (``mlp_only_layers``, ``decoder_sparse_step``), against the modules transformers
    itself creates from the config; Megatron gets the pattern as ``moe_layer_freq`` (left at 1 when every layer is MoE)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from toolkit_megatron.architectures import MixtralArchitecture, Qwen2MoeArchitecture, Qwen3MoeArchitecture

    arch = {"qwen3_moe": Qwen3MoeArchitecture, "qwen2_moe": Qwen2MoeArchitecture, "mixtral": MixtralArchitecture}[family]
    sizes = dict(hidden_size=16, intermediate_size=24, num_hidden_layers=6, num_attention_heads=2, num_key_value_heads=1,
                 head_dim=8, vocab_size=32, num_experts_per_tok=2)
    sizes.update({"num_local_experts": 2} if family == "mixtral" else {"num_experts": 2, "moe_intermediate_size": 8,
                                                                       "shared_expert_intermediate_size": 8})
    config = AutoConfig.for_model(family, **sizes, **overrides)
    model = AutoModelForCausalLM.from_config(config)
    built = [hasattr(getattr(layer, "mlp", None) or layer.block_sparse_moe, "experts") for layer in model.model.layers]
    assert arch.moe_layers(config) == built
    freq = arch.transformer_options(config).get("moe_layer_freq", 1)
    assert freq == ([int(b) for b in built] if not all(built) else 1)


def test_deepseek_routing_megatron_cannot_reproduce_is_refused_naming_the_field():
    """Configs whose routing megatron-core computes differently are refused before a model is built."""
    from transformers import DeepseekV2Config, DeepseekV3Config

    from toolkit.errors import ModelError
    from toolkit_megatron.architectures import DeepseekV2Architecture

    shape = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, n_routed_experts=8, q_lora_rank=None,
                 kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
    DeepseekV3Architecture.check(DeepseekV3Config(**shape, num_experts_per_tok=4, n_group=4, topk_group=2))
    refused = {
        "norm_topk_prob=false": (DeepseekV3Architecture, DeepseekV3Config(**shape, num_experts_per_tok=4, n_group=4,
                                                                           topk_group=2, norm_topk_prob=False)),
        "num_experts_per_tok == 2 * topk_group": (DeepseekV3Architecture, DeepseekV3Config(
            **shape, num_experts_per_tok=2, n_group=4, topk_group=2)),
        "rope_interleave=false": (DeepseekV3Architecture, DeepseekV3Config(**shape, num_experts_per_tok=4, n_group=4,
                                                                            topk_group=2, rope_interleave=False)),
        "num_experts_per_tok == topk_group": (DeepseekV2Architecture, DeepseekV2Config(
            **shape, num_experts_per_tok=4, topk_method="group_limited_greedy", n_group=4, topk_group=2)),
    }
    for field, (arch, config) in refused.items():
        with pytest.raises(ModelError, match=field.replace("*", r"\*")):
            arch.check(config)
    DeepseekV2Architecture.check(DeepseekV2Config(**shape, num_experts_per_tok=2, topk_method="group_limited_greedy",
                                                  n_group=4, topk_group=2))
