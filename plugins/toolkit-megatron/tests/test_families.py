"""Per-family facts of the bridge checked in one process (no Megatron model): RoPE variants equal HF's
rotary embedding, configs the bridge cannot reproduce are refused in one line naming the piece."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from conftest import needs_transformers_family
from toolkit.errors import ModelError
from toolkit_megatron.architectures import architecture_for


def _hf_rotated(hf_config, module, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``x [b, h, s, d]`` rotated by HF's own rotary embedding and ``apply_rotary_pos_emb`` of ``module``."""
    rotary = next(getattr(module, n) for n in dir(module) if n.endswith("RotaryEmbedding"))(hf_config)
    cos, sin = rotary(x, positions)
    return module.apply_rotary_pos_emb(x, x, cos, sin)[0]


ROPES = {
    "llama3": ("llama", dict(rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                                              "high_freq_factor": 4.0, "original_max_position_embeddings": 8})),
    "yarn": ("qwen2", dict(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                            "original_max_position_embeddings": 64})),
    "longrope-short": ("phi3", dict(max_position_embeddings=256, original_max_position_embeddings=32, rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 32,
        "short_factor": [1.0 + i / 10 for i in range(12)], "long_factor": [2.0 + i for i in range(12)],
        "partial_rotary_factor": 0.75})),
    "longrope-long": ("phi3", dict(max_position_embeddings=256, original_max_position_embeddings=8, rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 8,
        "short_factor": [1.0 + i / 10 for i in range(12)], "long_factor": [2.0 + i for i in range(12)],
        "partial_rotary_factor": 0.75})),
    "glm4-partial-interleaved": ("glm4", dict(partial_rotary_factor=0.5)),
}


@pytest.mark.parametrize("variant", list(ROPES))
def test_rope_equals_hf_rotary_embedding(variant):
    import importlib

    from transformers import AutoConfig

    from toolkit_megatron.attention import apply_rope

    model_type, extra = ROPES[variant]
    hf_config = AutoConfig.for_model(model_type, hidden_size=128, num_attention_heads=4, num_key_value_heads=4, head_dim=32,
                                     **extra)
    module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    x = torch.randn(2, 4, 16, 32, generator=torch.Generator().manual_seed(0))
    positions = torch.arange(16)[None].repeat(2, 1)
    expected = _hf_rotated(hf_config, module, x, positions)
    rope = architecture_for(model_type).rope(hf_config)
    if variant.startswith("longrope"):
        assert rope.long_after == {"longrope-short": 32, "longrope-long": 8}[variant]
    inv_freq = torch.tensor(rope.long_inv_freq if rope.long_inv_freq and 16 > rope.long_after else rope.inv_freq)
    got = apply_rope(x.permute(2, 0, 1, 3), positions, inv_freq, rope.scaling, rope.interleaved).permute(1, 2, 0, 3)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


def test_rope_whose_frequencies_follow_the_length_is_refused():
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=64, num_attention_heads=4,
                         rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    with pytest.raises(ModelError, match="rope_type 'dynamic' is not supported by the Megatron bridge.*--strategy local"):
        architecture_for("llama").check(config)


@pytest.mark.parametrize("tp", [1, 2])
def test_fused_hf_tensors_split_and_refuse_bit_exactly(tmp_path, tp):
    """Phi-3's ``qkv_proj`` ([all q; all k; all v] rows) and ``gate_up_proj`` ([gate; up]): each TP rank reads its
    query groups / halves out of the one tensor, and the gathered parameter gives the tensor back bit for bit.
    A LoRA adapter on the fused linear has its ``B`` rows split the very same way (Megatron LoRA on Phi-3)."""
    from safetensors.torch import save_file

    from toolkit_megatron.architectures import Phi3Architecture
    from toolkit_megatron.bridge import PER_LAYER, Geometry, SafetensorsReader, hf_from_full, hf_names, join_shards, read_local
    from toolkit_megatron.lora import _megatron_rows

    heads, groups, head_dim, hidden, ffn = 8, 4, 4, 16, 12
    generator = torch.Generator().manual_seed(0)
    tensors = {"model.layers.1.self_attn.qkv_proj.weight": torch.randn((heads + 2 * groups) * head_dim, hidden, generator=generator),
               "model.layers.1.mlp.gate_up_proj.weight": torch.randn(2 * ffn, hidden, generator=generator)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    reader = SafetensorsReader.from_directory(tmp_path)
    for leaf, expected in (("self_attention.linear_qkv.weight", "qkv"), ("mlp.linear_fc1.weight", "gate_up")):
        mapping = PER_LAYER[leaf]
        names = hf_names(Phi3Architecture, mapping, 1)
        assert mapping.split == expected and len(set(names)) == 1 and names[0] in tensors
        shards = [read_local(reader, mapping, names, Geometry(heads, groups, head_dim, ffn, 10, 10, tp, rank)) for rank in range(tp)]
        geo = Geometry(heads, groups, head_dim, ffn, 10, 10, tp, 0)
        adapter_rows = _megatron_rows(expected, tensors[names[0]], geo, tp).chunk(tp)
        assert all(torch.equal(rows, shard) for rows, shard in zip(adapter_rows, shards, strict=True)), leaf
        back = hf_from_full(mapping, names, join_shards(mapping, shards), Geometry(heads, groups, head_dim, ffn, 10, 10, tp, 0))
        assert [name for name, _ in back] == names[:1]
        assert torch.equal(back[0][1], tensors[names[0]]), leaf
    # the interleaving Megatron expects: query group 0's query heads, then its key head, then its value head
    qkv = read_local(reader, PER_LAYER["self_attention.linear_qkv.weight"], hf_names(Phi3Architecture, PER_LAYER[
        "self_attention.linear_qkv.weight"], 1), Geometry(heads, groups, head_dim, ffn, 10, 10, 1, 0))
    fused = tensors["model.layers.1.self_attn.qkv_proj.weight"]
    assert torch.equal(qkv[2 * head_dim:3 * head_dim], fused[heads * head_dim:(heads + 1) * head_dim])  # k head 0


@pytest.mark.parametrize(("model_type", "piece"), [("gemma3", "vision-language wrapper.*gemma3_text"),
                                                   ("mamba", "supported: ")])
def test_families_the_bridge_cannot_build_are_refused_naming_the_missing_piece(model_type, piece):
    with pytest.raises(ModelError, match=piece) as caught:
        architecture_for(model_type)
    assert "--strategy local" in str(caught.value) or "toolkit_register_architectures" in str(caught.value)


@pytest.mark.parametrize("model_type", ["llama", "qwen3",
                                        pytest.param("internlm3", marks=needs_transformers_family("internlm3"))])
def test_attention_bias_that_reaches_o_proj_is_refused(model_type):
    """These families' ``attention_bias`` biases o_proj too (GLM-4's does not): the bridge has no such bias."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type, hidden_size=64, num_attention_heads=4, attention_bias=True,
                                  **({"mlp_bias": True} if model_type == "internlm3" else {}))
    with pytest.raises(ModelError, match="o_proj bias"):
        architecture_for(model_type).check(config)
    architecture_for("glm4").check(AutoConfig.for_model("glm4", hidden_size=64, num_attention_heads=4, attention_bias=True))


def test_gemma3_rope_per_layer_type_equals_hf():
    """Gemma 3 keys ``rope_parameters`` by layer type: the window layers' local base, the full layers' global base
    with its linear scaling, each equal to transformers' rotary embedding for that layer type."""
    from transformers.models.gemma3 import modeling_gemma3

    from conftest import tiny_config
    from toolkit_megatron.attention import apply_rope

    hf_config = tiny_config("gemma3_text")
    rotary = modeling_gemma3.Gemma3RotaryEmbedding(hf_config)
    x = torch.randn(2, 4, 16, 32, generator=torch.Generator().manual_seed(0))
    positions = torch.arange(16)[None].repeat(2, 1)
    per_layer = architecture_for("gemma3_text").layer_attention(hf_config)
    assert [window for _, window in per_layer] == [4, None, 4, None]
    for layer_type, (rope, _) in zip(hf_config.layer_types, per_layer, strict=True):
        cos, sin = rotary(x, positions, layer_type)
        expected = modeling_gemma3.apply_rotary_pos_emb(x, x, cos, sin)[0]
        got = apply_rope(x.permute(2, 0, 1, 3), positions, torch.tensor(rope.inv_freq), rope.scaling).permute(1, 2, 0, 3)
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    assert per_layer[0][0] != per_layer[1][0]


@pytest.mark.parametrize("family", ["gemma2", "gemma3_text"])
def test_gemma_fixtures_exercise_every_gemma_piece(family):
    """The tiny Gemma 2/3 configs test_bridge.py holds the bridge to: dropping the final (and, Gemma 2, the
    attention) soft-capping, the window or Gemma 3's per-layer RoPE each changes transformers' logits by far more
    than the bridge's 1e-4, so logits equal to HF's mean the bridge reproduces every one."""
    import copy

    from transformers import AutoModelForCausalLM

    from conftest import tiny_config

    config = tiny_config(family)
    torch.manual_seed(0)
    # eager: the attention in which transformers soft-caps (5.17 ran Gemma 2 under sdpa without the cap)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    ids = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    changes = {"final_logit_softcapping": None, "sliding_window": 16}
    if family == "gemma2":
        changes["attn_logit_softcapping"] = None
    else:
        changes["rope_parameters"] = {kind: dict(config.rope_parameters["full_attention"]) for kind in config.layer_types}
    with torch.no_grad():
        reference = model(ids).logits
        for key, value in changes.items():
            changed = copy.deepcopy(config)
            setattr(changed, key, value)
            other = AutoModelForCausalLM.from_config(changed, attn_implementation="eager").eval()
            other.load_state_dict(model.state_dict())
            assert (other(ids).logits - reference).abs().max() > 1e-2, key


def test_softcapped_attention_equals_hf_eager_attention():
    """The bridge's soft-capped attention (GQA, a window mask) against transformers' eager Gemma 2 attention."""
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    from toolkit_megatron.attention import softcapped_attention

    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, heads, 12, 16, generator=generator) * 3 for heads in (4, 2, 2))
    index = torch.arange(12)
    allowed = (index[None, :] <= index[:, None]) & (index[:, None] - index[None, :] < 5)
    additive = torch.zeros(12, 12).masked_fill(~allowed, torch.finfo(torch.float32).min)[None, None]
    module = SimpleNamespace(num_key_value_groups=2, training=False)
    expected, _ = eager_attention_forward(module, q, k, v, additive, scaling=0.3, softcap=2.0)
    got = softcapped_attention(q, k, v, allowed[None, None], 0.3, 2.0)
    torch.testing.assert_close(got.transpose(1, 2), expected, rtol=0, atol=1e-6)


def _dense_attention(q, k, v, mask, scale, cap):
    if cap:
        from toolkit_megatron.attention import softcapped_attention

        return softcapped_attention(q, k, v, mask, scale, cap)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)


@pytest.mark.parametrize("cap", [2.0, None])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("window", [None, 4])
def test_flex_masked_attention_equals_the_dense_path(packed, window, cap):
    """The GPU path of masked attention (FlexAttention: soft-capping as a score_mod, the mask as a BlockMask) gives
    the dense path's output for a context-parallel rank's token order, packed rows and a window (forward, on CPU:
    torch has no FlexAttention backward there)."""
    from toolkit_megatron.attention import SDPAAttention, flex_masked_attention, load_balanced_indices

    generator = torch.Generator().manual_seed(0)
    index_q = load_balanced_indices(16, 2, 1)
    index_k = torch.cat([load_balanced_indices(16, 2, rank) for rank in range(2)])
    q = torch.randn(2, 4, len(index_q), 16, generator=generator) * 3
    k, v = (torch.randn(2, 2, 16, 16, generator=generator) * 3 for _ in range(2))
    meta = torch.stack([torch.zeros(2, 16, dtype=torch.long), torch.tensor([[0] * 10 + [1] * 6, [2] * 14 + [-1] * 2])])
    meta = meta if packed else None
    dense_mask = SDPAAttention._mask(SimpleNamespace(sliding_window=window), index_q, index_k, meta)
    expected = _dense_attention(q, k, v, dense_mask, 0.3, cap)
    got = flex_masked_attention(q, k, v, index_q, index_k, meta, window, 0.3, cap, cp_rank=1)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention's backward needs a GPU")
@pytest.mark.parametrize("cap", [50.0, None])
def test_flex_masked_attention_gradients_equal_the_dense_path_on_gpu(cap):
    """Gemma's head size (256) through the compiled FlexAttention with a window on packed rows, soft-capped (Gemma 2)
    or not (Gemma 3), forward and backward, against the dense path."""
    from toolkit_megatron.attention import SDPAAttention, flex_masked_attention

    generator = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, heads, 256, 256, device="cuda", generator=generator, requires_grad=True)
               for heads in (8, 4, 4))
    index = torch.arange(256, device="cuda")
    meta = torch.stack([index[None].repeat(2, 1), torch.tensor([[0] * 100 + [1] * 156, [2] * 256], device="cuda")])
    dense = _dense_attention(q, k, v, SDPAAttention._mask(SimpleNamespace(sliding_window=64), index, index, meta),
                             256 ** -0.5, cap)
    expected = torch.autograd.grad(dense.square().sum(), (q, k, v))
    flex = flex_masked_attention(q, k, v, index, index, meta, 64, 256 ** -0.5, cap)
    torch.testing.assert_close(flex, dense, rtol=1e-4, atol=1e-4)
    for got, want in zip(torch.autograd.grad(flex.square().sum(), (q, k, v)), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)


def test_gemma_configs_the_bridge_cannot_reproduce_are_refused():
    from transformers import Gemma2Config, Gemma3TextConfig

    with pytest.raises(ModelError, match="use_bidirectional_attention=true"):
        architecture_for("gemma3_text").check(Gemma3TextConfig(hidden_size=64, num_attention_heads=4, head_dim=16,
                                                               use_bidirectional_attention=True))
    with pytest.raises(ModelError, match="hidden_act='silu' .only gelu_pytorch_tanh"):
        architecture_for("gemma2").check(Gemma2Config(hidden_size=64, num_attention_heads=4, head_dim=16,
                                                      hidden_activation="silu"))


def test_megatron_local_attention_refuses_soft_capping(tp1):
    """Megatron's unfused kernel has no score hook: a soft-capped model asks for the SDPA core attention."""
    from conftest import tiny_config
    from toolkit.errors import ConfigError
    from toolkit.parallel import ParallelLayout
    from toolkit_megatron.model import build_model

    with pytest.raises(ConfigError, match="--megatron-attention local has no attention logit soft-capping"):
        build_model(tiny_config("gemma2"), ParallelLayout(), attention="local")
    assert build_model(tiny_config("gemma3_text"), ParallelLayout(), attention="local")  # Gemma 3's attention is not capped


@pytest.mark.parametrize(("model_type", "changes", "refused"), [
    ("qwen2", {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 2}, "use_sliding_window=true"),
    ("qwen3", {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 2}, "use_sliding_window=true"),
    ("gemma2", {"hidden_activation": "silu"}, "hidden_act='silu'"),
    ("qwen2", {"use_sliding_window": False, "sliding_window": 64}, None)])
def test_the_planner_offers_megatron_only_for_configs_the_bridge_builds(model_type, changes, refused):
    """The planner asks the bridge's architecture (``refusal``) about the model's own config.json: a setting the
    bridge refuses at start-up rejects every megatron layout with the bridge's own words; without it megatron is
    planned. The same config through the bridge's ``check`` and per-layer attention raises the same words."""
    from transformers import AutoConfig

    from toolkit.plan.hardware import make_cluster
    from toolkit.plan.memory import Workload
    from toolkit.plan.model import shape_from_config
    from toolkit.plan.search import plan

    config = AutoConfig.for_model(model_type, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=1000, **changes)
    result = plan(shape_from_config(config.to_dict()), make_cluster(2, gpu_memory="80GiB"), Workload(seq_len=256),
                  ("local", "megatron"))
    megatron = [c for c in result.rejected if c.layout.strategy == "megatron"]
    planned = [c for c in result.ranked if c.layout.strategy == "megatron"]
    if refused is None:
        assert planned and not any("Megatron bridge" in c.rejected for c in megatron), [c.rejected for c in megatron]
        return
    assert not planned and any(refused in c.rejected for c in megatron), [c.rejected for c in megatron]
    with pytest.raises(ModelError, match=refused.replace("(", r"\(")):
        architecture = architecture_for(model_type)
        architecture.check(config)
        architecture.layer_attention(config)


def test_the_planners_question_reads_a_legacy_config_json_without_torch(tmp_path):
    """``refusal`` answers from the JSON dict alone (``toolkit plan`` imports no torch): a legacy ``rope_scaling`` of
    a type the bridge refuses is named as ``Rope.from_hf_config`` names it; a supported one passes."""
    import json
    import subprocess
    import sys

    legacy = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "intermediate_size": 128, "vocab_size": 100, "rope_theta": 10000.0}
    code = ("import json, sys\nfrom toolkit_megatron.architectures import architecture_for\n"
            "answers = [architecture_for('llama').refusal(json.loads(c)) for c in sys.argv[1:]]\n"
            "print(json.dumps([answers, 'torch' in sys.modules]))")
    configs = [{**legacy, "rope_scaling": {"type": "dynamic", "factor": 2.0}},
               {**legacy, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}, legacy]
    done = subprocess.run([sys.executable, "-c", code, *map(json.dumps, configs)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    (dynamic, linear, plain), torch_imported = json.loads(done.stdout.strip().splitlines()[-1])
    assert "rope_type 'dynamic' is not supported by the Megatron bridge" in dynamic and linear is None and plain is None
    assert not torch_imported
