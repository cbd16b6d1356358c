"""The planner's memory and time model against hand-computed properties, HF parameter counts and its CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from toolkit.errors import ConfigError, LayoutError, ModelError
from toolkit.plan import Layout, Workload, choose_strategy, layout_memory, load_shape, make_cluster, plan, shape_from_config
from toolkit.plan.hardware import GIB, parse_memory
from toolkit.plan.memory import activation_bytes_per_token_layer, stage_memory
from toolkit.plan.timing import step_time

CONFIGS = Path(__file__).resolve().parents[1] / "examples" / "configs"
QWEN72 = load_shape(CONFIGS / "qwen2-72b.json")
LLAMA1B = load_shape(CONFIGS / "llama-3.2-1b.json")
MIXTRAL = load_shape(CONFIGS / "mixtral-8x22b.json")
WORK = Workload(seq_len=4096)


def memory(shape, layout, workload=WORK, micro_batches=64):
    return layout_memory(shape, layout, workload, micro_batches)


# ----------------------------------------------------------------------------- model shape


TINY_CONFIGS = {
    "llama": dict(model_type="llama", hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=300, tie_word_embeddings=False),
    "qwen2": dict(model_type="qwen2", hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=300, tie_word_embeddings=True),
    "qwen3": dict(model_type="qwen3", hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, vocab_size=300, tie_word_embeddings=False),
    "mixtral": dict(model_type="mixtral", hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, vocab_size=300),
    "qwen2_moe": dict(model_type="qwen2_moe", hidden_size=64, intermediate_size=160, moe_intermediate_size=48,
                      shared_expert_intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                      num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[1], vocab_size=300),
    "qwen3_moe": dict(model_type="qwen3_moe", hidden_size=64, intermediate_size=160, moe_intermediate_size=48,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=4,
                      num_experts_per_tok=2, vocab_size=300, tie_word_embeddings=False),
    # dense MLPs between MoE layers: layer 0 (sparse step 2), 2 (mlp_only_layers) and 4 are dense, 1 and 3 MoE
    "qwen3_moe_mixed": dict(model_type="qwen3_moe", hidden_size=64, intermediate_size=160, moe_intermediate_size=48,
                            num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=4,
                            num_experts_per_tok=2, decoder_sparse_step=2, mlp_only_layers=[2], vocab_size=300),
    # issue 27: fused linears (phi3, glm4), post-sublayer norms (glm4, gemma2/3), QK norm (gemma3)
    **{family: dict(model_type=family, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=300, pad_token_id=0, **extra)
       for family, extra in (("phi3", {}), ("glm4", {"head_dim": 16}), ("gemma", {"head_dim": 16}), ("gemma2", {"head_dim": 16}),
                             ("gemma3_text", {"head_dim": 32}), ("internlm3", {}))},
    "deepseek_v3": dict(model_type="deepseek_v3", hidden_size=64, intermediate_size=160, moe_intermediate_size=48,
                        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
                        n_shared_experts=1, num_experts_per_tok=2, n_group=4, topk_group=2, first_k_dense_replace=1,
                        q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
                        vocab_size=300),
    "deepseek_v2": dict(model_type="deepseek_v2", hidden_size=64, intermediate_size=160, moe_intermediate_size=48,
                        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
                        n_shared_experts=2, num_experts_per_tok=2, first_k_dense_replace=2, q_lora_rank=None,
                        kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, vocab_size=300),
}


@pytest.mark.parametrize("family", ["llama", "phi3", "glm4", "gemma3_text", "mixtral", "qwen2_moe", "qwen3_moe",
                                    "qwen3_moe_mixed", "deepseek_v2", "deepseek_v3", "tiny-qwen3-moe", "tiny-mixtral",
                                    "tiny-qwen2-moe", "tiny-deepseek-v3"])
def test_lora_parameter_count_matches_peft(family):
    """LoRA on every linear: PEFT's trainable parameters, fused Phi-3/GLM-4 modules (one adapter each) included, and
    transformers 5's fused experts as PEFT (>= 0.22) adapts them (router and experts through target_parameters,
    gate_up at twice the rank; dense MLPs and shared experts as linears). ``tiny-*``:
    the embedded presets ``toolkit plan --model tiny-...`` reads."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from toolkit.models import preset_config

    config = preset_config(family) if family.startswith("tiny-") else transformers.AutoConfig.for_model(**TINY_CONFIGS[family])
    model = peft.get_peft_model(transformers.AutoModelForCausalLM.from_config(config),
                                peft.LoraConfig(r=4, target_modules="all-linear"))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert shape_from_config(config.to_dict()).lora_params(4) == trainable


@pytest.mark.parametrize("family", sorted(TINY_CONFIGS))
def test_parameter_count_matches_transformers(family):
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.for_model(**TINY_CONFIGS[family])
    model = transformers.AutoModelForCausalLM.from_config(config)
    expected = sum(p.numel() for p in model.parameters())  # tied weights are counted once
    assert shape_from_config(config.to_dict()).total_params == expected


@pytest.mark.parametrize(("pp", "vpp"), [(2, 1), (2, 2), (4, 1)])
def test_each_pipeline_stage_holds_the_parameters_of_its_own_layers(pp, vpp):
    """Dense layers first, MoE layers last (``mlp_only_layers``): the first and last stages' weights are the
    parameters of the very layers Megatron gives them, counted on transformers' modules (not an average stage)."""
    transformers = pytest.importorskip("transformers")
    from toolkit.plan.memory import params_on_stage, stage_layers

    values = dict(TINY_CONFIGS["qwen3_moe"], num_hidden_layers=8, mlp_only_layers=[0, 1, 2, 3, 4])
    config = transformers.AutoConfig.for_model(**values)
    model = transformers.AutoModelForCausalLM.from_config(config)
    shape = shape_from_config(config.to_dict())
    layout = Layout("megatron", pp=pp, vpp=vpp, dp=1)
    for rank, first, last, ends in ((0, True, False, ("model.embed_tokens.",)), (pp - 1, False, True, ("lm_head.", "model.norm."))):
        held = stage_layers(shape, layout, rank)
        assert len(held) == 8 // pp and (vpp == 1) == (held == list(range(rank * 8 // pp, (rank + 1) * 8 // pp)))
        expected = sum(p.numel() for name, p in model.named_parameters()
                       if name.startswith(ends) or (name.startswith("model.layers.") and int(name.split(".")[2]) in held))
        dense, expert = params_on_stage(shape, layout, first, last)
        assert dense + expert == pytest.approx(expected)
        assert expert == pytest.approx(sum(p.numel() for name, p in model.named_parameters()
                                           if ".experts." in name and int(name.split(".")[2]) in held))


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_moe_mixed", "mixtral", "llama"])
def test_active_parameters_per_token_match_transformers_modules(family):
    """The matmul weights one token meets (the planner's FLOPs are 6 x this), counted on the modules transformers
    builds: every linear, the routed experts at top-k / E, the LM head; embeddings and norms do no matmul."""
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.for_model(**TINY_CONFIGS[family])
    model = transformers.AutoModelForCausalLM.from_config(config)
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", 1)
    share = config.num_experts_per_tok / experts if experts > 1 else 1.0
    expected = sum(p.numel() * (share if ".experts." in name else 1.0) for name, p in model.named_parameters()
                   if "norm" not in name and "embed_tokens" not in name)
    assert shape_from_config(config.to_dict()).active_matmul_params == pytest.approx(expected, rel=1e-12)


def test_example_configs_have_the_published_sizes():
    sizes = {"llama-70b": 70.55, "qwen2-72b": 72.71, "mixtral-8x22b": 140.6, "qwen3-30b-a3b": 30.5, "llama-3.2-1b": 1.24,
             "phi-4-mini": 3.84, "glm-4-9b": 9.40,
             "deepseek-v2-lite": 15.71, "deepseek-v3": 671.0}
    for name, billions in sizes.items():
        assert load_shape(CONFIGS / f"{name}.json").total_params / 1e9 == pytest.approx(billions, abs=0.06)


# ----------------------------------------------------------------------------- memory properties


def test_doubling_tp_halves_weights_grads_and_optimizer():
    one = memory(QWEN72, Layout("megatron", tp=4, pp=4, dp=2))
    two = memory(QWEN72, Layout("megatron", tp=8, pp=4, dp=1))
    for part in ("weights", "gradients", "optimizer"):
        assert getattr(two, part) == pytest.approx(getattr(one, part) / 2, rel=1e-9)
    assert two.activations == pytest.approx(one.activations / 2, rel=1e-9)  # sequence parallelism


def test_bytes_per_parameter_follow_each_strategy():
    params = LLAMA1B.total_params
    local = memory(LLAMA1B, Layout("local"))  # --precision bf16: bf16 params + fp32 master
    assert (local.weights, local.master, local.gradients, local.optimizer) == (2 * params, 4 * params, 4 * params, 8 * params)
    assert local.weight_copies == 0  # no autocast copies
    autocast = memory(LLAMA1B, Layout("local"), replace(WORK, bf16_mode="autocast"))
    assert (autocast.weights, autocast.master, autocast.gradients, autocast.optimizer) == (4 * params, 0, 4 * params, 8 * params)
    assert autocast.weight_copies == 2 * params
    mega = memory(LLAMA1B, Layout("megatron"))
    assert (mega.weights, mega.gradients, mega.optimizer) == (2 * params, 4 * params, 12 * params)


def test_zero_stages_shard_over_data_parallel():
    base = memory(QWEN72, Layout("deepspeed", dp=1, zero=1))
    for dp in (8, 32):
        z1 = memory(QWEN72, Layout("deepspeed", dp=dp, zero=1))
        z3 = memory(QWEN72, Layout("deepspeed", dp=dp, zero=3))
        assert z1.optimizer == pytest.approx(base.optimizer / dp)
        assert z1.weights == base.weights  # ZeRO-1 keeps full weights
        assert z3.optimizer == pytest.approx(base.optimizer / dp)
        assert z3.weights == pytest.approx(base.weights / dp)
    dist_opt = memory(QWEN72, Layout("megatron", tp=8, dp=4, zero=1))
    plain = memory(QWEN72, Layout("megatron", tp=8, dp=4, zero=0))
    assert dist_opt.optimizer == pytest.approx(plain.optimizer / 4)
    assert dist_opt.gradients == plain.gradients


def test_recompute_keeps_only_layer_inputs():
    plain = memory(LLAMA1B, Layout("local"))
    again = memory(LLAMA1B, Layout("local", recompute=True))
    assert again.activations_without_recompute == plain.activations
    tokens, layers, hidden = WORK.micro_batch_tokens, LLAMA1B.layers, LLAMA1B.hidden
    one_layer = plain.activations / layers
    assert again.activations == pytest.approx(layers * tokens * 2 * hidden + one_layer)  # bf16 layer inputs
    assert again.activations < plain.activations / 5
    autocast = memory(LLAMA1B, Layout("local", recompute=True), replace(WORK, bf16_mode="autocast"))
    fp32_layer = autocast.activations_without_recompute / layers
    assert autocast.activations == pytest.approx(layers * tokens * 4 * hidden + fp32_layer)  # fp32 residual


def test_master_weights_add_eight_bytes_per_param_at_the_optimizer_step():
    """bf16 params + fp32 master + fp32 master grads + m, v = 18 B/param when the step runs; a pure
    bf16 scheme would hold 2 + 2 + 8 with the same Adam states, so the masters cost 4 + 4 - 2 + 2."""
    params = LLAMA1B.total_params
    one = memory(LLAMA1B, Layout("local"), micro_batches=1)
    held = one.weights + one.master + one.gradients + one.optimizer
    assert held == 18 * params
    assert held - (2 * params + 8 * params) == 8 * params  # vs bf16 params + Adam states alone
    # One micro-batch per step: the fp32 master gradients do not exist during forward/backward yet.
    assert not one.gradients_persistent
    assert one.forward_backward_peak == pytest.approx(
        14 * params + one.activations + one.logits + one.transient_gradients + one.buffers)
    # With accumulation they do, and the next accumulation holds every bf16 gradient beside them.
    accumulating = memory(LLAMA1B, Layout("local"), micro_batches=4)
    assert accumulating.gradients_persistent
    assert accumulating.forward_backward_peak - one.forward_backward_peak == pytest.approx(4 * params)
    assert accumulating.optimizer_step_temp >= 2 * params
    # The head's bf16 gradient exists at the loss-time peak (its backward runs first).
    assert one.transient_gradients == 2 * LLAMA1B.embedding_params
    # DDP buckets hold gradients in the parameter dtype: bf16 with master weights, fp32 under autocast.
    ddp = memory(LLAMA1B, Layout("local", dp=2), micro_batches=1)
    assert ddp.buffers - one.buffers == 2 * params
    autocast = replace(WORK, bf16_mode="autocast")
    assert (memory(LLAMA1B, Layout("local", dp=2), autocast, 1).buffers
            - memory(LLAMA1B, Layout("local"), autocast, 1).buffers) == 4 * params


def test_auto_reads_the_local_engine_precision_options():
    from toolkit.plan.auto import local_precision
    from toolkit.recipe import resolve_recipe

    default = resolve_recipe({"model": "m", "precision": "bf16"}, source="test")
    assert local_precision(default) == {"bf16_mode": "master", "logps_chunk_tokens": 2048, "recompute_logits": False}
    custom = resolve_recipe({"model": "m", "precision": "bf16", "local": {"master_weights": False, "logps_chunk_tokens": 512,
                                                                          "recompute_logits": True}}, source="test")
    assert local_precision(custom) == {"bf16_mode": "autocast", "logps_chunk_tokens": 512, "recompute_logits": True}
    assert local_precision(resolve_recipe({"model": "m", "precision": "fp32"}, source="test"))["bf16_mode"] == "autocast"
    pure = resolve_recipe({"model": "m", "precision": "bf16", "local": {"bf16_mode": "pure"}}, source="test")
    assert local_precision(pure)["bf16_mode"] == "pure"
    autocast = resolve_recipe({"model": "m", "precision": "bf16", "local": {"bf16_mode": "autocast"}}, source="test")
    assert local_precision(autocast) == local_precision(custom) | {"logps_chunk_tokens": 2048, "recompute_logits": False}


def test_pure_bf16_halves_the_optimizer_step_and_drops_the_masters():
    """--local-bf16-mode pure: 2 + 2 + 4 bytes per parameter, no master, and a cheaper optimizer step."""
    from toolkit.plan.hardware import make_cluster
    from toolkit.plan.timing import step_time

    pure = memory(LLAMA1B, Layout("local"), replace(WORK, bf16_mode="pure"))
    params = LLAMA1B.total_params
    assert (pure.weights, pure.master, pure.gradients, pure.optimizer) == (2 * params, 0, 2 * params, 4 * params)
    master = memory(LLAMA1B, Layout("local"), WORK)
    assert pure.total < master.total and pure.forward_backward_peak < master.forward_backward_peak
    assert pure.activations == master.activations  # bf16 residual stream in both
    cluster = make_cluster(1, 1, None, "h200")
    timing = {w: step_time(LLAMA1B, Layout("local"), w, cluster, 64) for w in (WORK, replace(WORK, bf16_mode="pure"))}
    assert timing[replace(WORK, bf16_mode="pure")].optimizer < 0.5 * timing[WORK].optimizer


def test_kept_chunk_logits_grow_with_the_micro_batch():
    """The engine keeps every chunk's bf16 logits for backward unless --local-recompute-logits."""
    tokens = WORK.micro_batch_tokens
    chunk = min(tokens, 2048)
    kept = memory(LLAMA1B, Layout("local")).logits
    recomputed = memory(LLAMA1B, Layout("local"), replace(WORK, recompute_logits=True)).logits
    assert recomputed == 12 * LLAMA1B.vocab * chunk
    assert kept == 2 * LLAMA1B.vocab * tokens + 8 * LLAMA1B.vocab * chunk
    longer = replace(WORK, seq_len=4 * WORK.seq_len)
    assert memory(LLAMA1B, Layout("local"), longer).logits - kept == pytest.approx(2 * LLAMA1B.vocab * 3 * tokens)
    assert memory(LLAMA1B, Layout("local"), replace(longer, recompute_logits=True)).logits == recomputed
    lora = memory(LLAMA1B, Layout("local"), replace(WORK, tuner="lora")).logits  # frozen head: gradient in forward
    assert lora == 10 * LLAMA1B.vocab * chunk + 2 * LLAMA1B.hidden * tokens


def test_pipeline_first_stage_holds_pp_micro_batches():
    per_layer = memory(QWEN72, Layout("megatron", tp=8)).activations / QWEN72.layers
    first = memory(QWEN72, Layout("megatron", tp=8, pp=4), micro_batches=64)
    assert first.stage == "first stage"
    assert first.activations == pytest.approx(per_layer * QWEN72.layers)  # 4 in flight x 20 layers
    few = stage_memory(QWEN72, Layout("megatron", tp=8, pp=4), WORK, 2, first=True, last=False)
    assert few.activations == pytest.approx(per_layer * 2 * 20)
    interleaved = memory(QWEN72, Layout("megatron", tp=8, pp=4, vpp=2))
    assert interleaved.activations == pytest.approx(per_layer * QWEN72.layers * (1 + 3 / 8))


def test_lora_trains_only_adapters_and_qlora_quantises_the_base():
    lora = memory(LLAMA1B, Layout("local"), replace(WORK, tuner="lora"))
    qlora = memory(LLAMA1B, Layout("local"), replace(WORK, tuner="qlora"))
    adapters = LLAMA1B.lora_params(16)
    assert lora.optimizer == pytest.approx(8 * adapters)
    # The local engine casts the adapters to bf16 too and keeps their fp32 masters (+ master grads).
    assert lora.weights == pytest.approx(2 * LLAMA1B.total_params + 2 * adapters)
    assert lora.master == lora.gradients == pytest.approx(4 * adapters)
    fp32_adapters = memory(LLAMA1B, Layout("local"), replace(WORK, tuner="lora", bf16_mode="autocast"))
    assert fp32_adapters.weights == pytest.approx(2 * LLAMA1B.total_params + 4 * adapters) and fp32_adapters.master == 0
    assert qlora.weights < lora.weights / 3


def test_expert_parallel_splits_only_experts():
    ep1 = memory(MIXTRAL, Layout("megatron", tp=2, pp=4, ep=1, dp=8))
    ep8 = memory(MIXTRAL, Layout("megatron", tp=2, pp=4, ep=8, dp=8))
    expert_share = MIXTRAL.expert_params / 4 * 2  # bf16 expert weights of one stage
    assert ep1.weights - ep8.weights == pytest.approx(expert_share * (1 - 1 / 8), rel=1e-6)
    # toolkit-moe's --ep under local: the same split of the experts; DDP's buckets leave the expert slices out
    local1, local8 = memory(MIXTRAL, Layout("local", dp=8)), memory(MIXTRAL, Layout("local", ep=8, dp=8))
    assert local1.weights - local8.weights == pytest.approx(2 * MIXTRAL.expert_params * (1 - 1 / 8), rel=1e-6)
    assert local1.buffers - local8.buffers == pytest.approx(2 * MIXTRAL.expert_params, rel=1e-6)


# ----------------------------------------------------------------------------- time properties


def test_tp_across_nodes_is_slower_than_inside_a_node():
    cluster = make_cluster(32, 4, "80GiB")
    inside = step_time(QWEN72, Layout("megatron", tp=8, pp=4), WORK, cluster, 256)
    across = step_time(QWEN72, Layout("megatron", tp=16, pp=2), WORK, cluster, 256)
    assert across.tensor_parallel > 5 * inside.tensor_parallel


def test_bubble_shrinks_with_micro_batches_and_virtual_stages():
    cluster = make_cluster(32, 4, "80GiB")
    few = step_time(QWEN72, Layout("megatron", tp=8, pp=4), WORK, cluster, 16)
    many = step_time(QWEN72, Layout("megatron", tp=8, pp=4), WORK, cluster, 256)
    interleaved = step_time(QWEN72, Layout("megatron", tp=8, pp=4, vpp=2), WORK, cluster, 256)
    assert few.bubble == pytest.approx(3 / 16 * (few.compute + few.tensor_parallel), rel=1e-6)
    assert many.bubble / many.compute < few.bubble / few.compute / 10
    assert interleaved.bubble == pytest.approx(many.bubble / 2, rel=1e-6)


def test_lora_and_no_recompute_are_faster():
    cluster = make_cluster(1, 1, None, "h200")
    work = replace(WORK, micro_batch_size=4)
    full = step_time(LLAMA1B, Layout("local"), work, cluster, 8)
    lora = step_time(LLAMA1B, Layout("local"), replace(work, tuner="lora"), cluster, 8)
    recompute = step_time(LLAMA1B, Layout("local", recompute=True), work, cluster, 8)
    assert lora.total < full.total < recompute.total


def test_short_micro_batches_are_bound_by_host_launches():
    """Measured on an H200: LoRA at 1 x 4096 tokens is slower than full fine-tuning (more kernels to
    launch per layer than GPU work to hide them), while at 4 x 4096 it is faster."""
    cluster = make_cluster(1, 1, None, "h200")
    full = step_time(LLAMA1B, Layout("local"), WORK, cluster, 1)
    lora = step_time(LLAMA1B, Layout("local"), replace(WORK, tuner="lora"), cluster, 1)
    assert lora.host > lora.device_total and lora.total == lora.host
    assert lora.total > full.total
    assert any(name.startswith("host-bound") for name, _ in lora.rows())
    megatron = step_time(LLAMA1B, Layout("megatron"), replace(WORK, tuner="lora"), cluster, 1)
    assert megatron.host == 0.0


# ----------------------------------------------------------------------------- search


def test_72b_on_four_nodes_gets_a_megatron_layout():
    result = plan(QWEN72, make_cluster(32, 4, "80GiB"), WORK)
    best = result.best
    assert best.layout.strategy == "megatron"
    assert 4 <= best.layout.tp <= 8  # tensor parallel inside a node
    assert best.layout.tp * best.layout.pp >= 16  # 72B does not fit with less model parallelism
    top = [c.layout for c in result.ranked[:6]]
    assert any(lay.tp == 8 and lay.pp == 4 for lay in top)
    assert not any(c.layout.strategy == "local" for c in result.ranked)  # 72B x 18 bytes never fits replicated
    from toolkit.plan.report import render, why_lines

    why = " ".join(why_lines(result))
    assert "does not fit" in why and "NVLink" in why
    assert "#1 megatron" in render(result)


def test_infeasible_layouts_are_rejected_with_reasons():
    result = plan(QWEN72, make_cluster(8, 1, "80GiB"), WORK, ("local", "megatron"))
    assert result.best is None
    reasons = {c.layout.describe(): c.rejected for c in result.rejected}
    assert "needs" in reasons["local DP8"] and "GiB" in reasons["local DP8"]
    assert any("layers per virtual stage is not a whole number" in r for r in reasons.values())
    from toolkit.plan.report import render

    assert "no layout fits" in render(result)


def test_megatron_layouts_need_a_family_the_bridge_knows():
    """OLMo 2 has no Megatron bridge architecture: the plan offers the strategies that train it; GLM-4 and the
    Gemmas (bridged for issue 27) get Megatron layouts."""
    pytest.importorskip("toolkit_megatron")
    config = dict(TINY_CONFIGS["gemma2"], hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, head_dim=128,
                  num_attention_heads=16, num_key_value_heads=8)
    olmo2 = dict(config, model_type="olmo2")
    result = plan(shape_from_config(olmo2), make_cluster(2, 1, "80GiB"), WORK, ("local", "fsdp", "megatron"))
    assert result.ranked and all(c.layout.strategy != "megatron" for c in result.ranked)
    assert all("no architecture for olmo2" in c.rejected for c in result.rejected if c.layout.strategy == "megatron")
    for family in ("glm4", "gemma", "gemma2", "gemma3_text"):
        assert plan(shape_from_config(dict(config, model_type=family)), make_cluster(2, 1, "80GiB"), WORK, ("megatron",)).ranked


def test_small_model_on_one_gpu_fits_everywhere():
    result = plan(LLAMA1B, make_cluster(1, 1, None, "h200"), WORK, ("local",))
    assert [c.layout.describe() for c in result.ranked] == ["local DP1", "local DP1 recompute"]


def test_tp_that_does_not_divide_kv_heads_is_impossible():
    result = plan(QWEN72, make_cluster(32, 2, "80GiB"), WORK, ("megatron",))
    reasons = [c.rejected for c in result.rejected if c.layout.tp == 16]
    assert reasons and all("key/value heads 8 / tp 16" in r for r in reasons)


# ----------------------------------------------------------------------------- errors


def test_bad_inputs_give_clear_errors(tmp_path):
    with pytest.raises(ModelError, match="no such model directory"):
        load_shape(tmp_path / "missing.json")
    (tmp_path / "broken.json").write_text('{"model_type": "llama",\n "hidden_size": }')
    with pytest.raises(ModelError, match=r"broken.json:2: not valid JSON"):
        load_shape(tmp_path / "broken.json")
    (tmp_path / "partial.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    with pytest.raises(ModelError, match="partial.json.*'num_hidden_layers'"):
        load_shape(tmp_path / "partial.json")
    with pytest.raises(ModelError, match="no config.json"):
        load_shape(tmp_path)
    with pytest.raises(ConfigError, match="does not split evenly"):
        make_cluster(12, 5)
    with pytest.raises(ConfigError, match="cannot read 'lots'"):
        parse_memory("lots")
    with pytest.raises(ConfigError, match="--seq-len"):
        plan(LLAMA1B, make_cluster(1), Workload(seq_len=0))
    assert parse_memory("80GiB") == 80 * GIB and parse_memory("141GB") == 141 * 10**9


# ----------------------------------------------------------------------------- auto and CLI


class _Recipe:
    seq_len, micro_batch_size, global_batch_size, tuner = 4096, 1, 0, "full"

    def section(self, name):
        return {}


def test_choose_strategy_on_cpu_is_local():
    overrides = choose_strategy(_Recipe(), {**TINY_CONFIGS["llama"]}, world_size=2)
    assert overrides["strategy"] == "local" and overrides["tensor_parallel"] == 1


def test_choose_strategy_with_gpus(monkeypatch):
    import toolkit.plan.auto as auto

    monkeypatch.setattr(auto, "_gpu_memory_and_kind", lambda memory: ("80GiB", "h100"))
    monkeypatch.setattr(auto, "installed_strategies", lambda: ("local", "megatron"))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    overrides = choose_strategy(_Recipe(), CONFIGS / "qwen2-72b.json", world_size=32)
    assert overrides["strategy"] == "megatron" and overrides["tensor_parallel"] >= 4
    assert overrides["sequence_parallel"] is True
    monkeypatch.setattr(auto, "installed_strategies", lambda: ("local",))
    with pytest.raises(LayoutError, match="no installed strategy fits"):
        choose_strategy(_Recipe(), CONFIGS / "qwen2-72b.json", world_size=32)


def test_plan_command_prints_ranked_layouts_without_importing_torch():
    code = ("import sys; from toolkit.cli import main\n"
            "try:\n    main(['plan', '--model', sys.argv[1], '--gpus', '32', '--nodes', '4', '--gpu-memory', '80GiB', '--json'])\n"
            "finally:\n    print('TORCH' if 'torch' in sys.modules else 'NO-TORCH', file=sys.stderr)")
    proc = subprocess.run([sys.executable, "-c", code, str(CONFIGS / "qwen2-72b.json")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["ranked"][0]["overrides"]["strategy"] == "megatron"
    command = data["ranked"][0]["command"]  # a hand-written config has no weights to train: MODEL_DIR stands for them
    assert command[:5] == ["toolkit", "launch", "--nproc", "8", "--nnodes"] and "--model MODEL_DIR --strategy megatron" in " ".join(command)
    assert "NO-TORCH" in proc.stderr
    bad = subprocess.run([sys.executable, "-m", "toolkit", "plan", "--model", "nope.json", "--gpus", "1"],
                         capture_output=True, text=True)
    assert bad.returncode == 1 and "nope.json: no such model" in bad.stderr and "Traceback" not in bad.stderr


def test_expert_parallel_feeds_experts_bigger_matmuls():
    qwen3_moe = load_shape(CONFIGS / "qwen3-30b-a3b.json")
    cluster = make_cluster(16, 2, "80GiB")
    ep1 = step_time(qwen3_moe, Layout("megatron", pp=2, ep=1, dp=8, zero=1), WORK, cluster, 128)
    ep8 = step_time(qwen3_moe, Layout("megatron", pp=2, ep=8, dp=8, zero=1), WORK, cluster, 128)
    assert ep8.compute < ep1.compute and ep8.expert_parallel > 0 == ep1.expert_parallel
    best = plan(qwen3_moe, cluster, WORK, ("megatron",)).best
    assert best.layout.ep > 1


def test_choose_strategy_accepts_the_runner_call(monkeypatch, tmp_path):
    import toolkit.plan.auto as auto

    (tmp_path / "config.json").write_text((CONFIGS / "llama-3.2-1b.json").read_text())
    recipe = _Recipe()
    recipe.model = str(tmp_path)
    assert choose_strategy(recipe, 1)["strategy"] == "local"  # CPU
    monkeypatch.setattr(auto, "_gpu_memory_and_kind", lambda memory: (141 * 10**9, "h200"))
    monkeypatch.setattr(auto, "installed_strategies", lambda: ("local", "fsdp"))
    overrides = choose_strategy(recipe, 1)
    assert overrides["strategy"] == "local" and overrides["gradient_checkpointing"] is False


def test_speed_model_reproduces_the_h200_measurements():
    """Measured on one and two H200s (shared/notes/cpu-stack.md): 1.24B shape, 4 x 4096 tokens per
    micro-batch; HF one GPU 47.7k tokens/s, HF DDP 45.7k per GPU, Megatron-Core TP2 (no TE) 36.2k
    per GPU at 32.4 GiB."""
    work = Workload(seq_len=4096, micro_batch_size=4)
    one, two = make_cluster(1, 1, None, "h200"), make_cluster(2, 1, None, "h200")
    # bench/local_sft.py (2026-11-30): local engine, bf16 + fp32 master, untied head: 43.0k at 49.9 GiB.
    config = json.loads((CONFIGS / "llama-3.2-1b.json").read_text())
    untied = shape_from_config({**config, "tie_word_embeddings": False}, name="untied")
    # (measured before the engine kept chunk logits for backward: --local-recompute-logits semantics)
    measured_path = replace(work, recompute_logits=True)
    local = step_time(untied, Layout("local"), measured_path, one, 4)
    assert local.tokens_per_second == pytest.approx(43.0e3, rel=0.05)
    assert layout_memory(untied, Layout("local"), measured_path, 1).total / GIB == pytest.approx(49.9, rel=0.08)
    # bench/peft_lora.py (2026-11-30): lora r16 through the local engine, 51.2k at 29.7 GiB.
    lora = replace(work, tuner="lora")
    assert step_time(LLAMA1B, Layout("local"), lora, one, 4).tokens_per_second == pytest.approx(51.2e3, rel=0.05)
    assert layout_memory(LLAMA1B, Layout("local"), lora, 1).total / GIB == pytest.approx(29.7, rel=0.08)
    assert step_time(LLAMA1B, Layout("fsdp"), work, one, 4).tokens_per_second == pytest.approx(47.7e3, rel=0.05)
    assert step_time(LLAMA1B, Layout("megatron", tp=2), work, two, 8).tokens_per_second / 2 == pytest.approx(36.2e3, rel=0.05)
    tp2 = layout_memory(LLAMA1B, Layout("megatron", tp=2), work, micro_batches=2)
    assert tp2.total / GIB == pytest.approx(32.4, rel=0.15)
    # bench/speed.py (2026-11-30, bench/results/speed-h200-2026-11-30.json): the engine's GPU defaults,
    # Triton kernels + fused loss. Speeds are the fitted LEVERS_SPEEDUP points; the peaks are not fitted.
    levers = replace(work, kernels="triton", fused_loss=True)
    assert step_time(untied, Layout("local"), levers, one, 4).tokens_per_second == pytest.approx(60.1e3, rel=0.05)
    assert layout_memory(untied, Layout("local"), levers, 1).total / GIB == pytest.approx(39.4, rel=0.08)
    lora_levers = replace(levers, tuner="lora")
    assert step_time(LLAMA1B, Layout("local"), lora_levers, one, 4).tokens_per_second == pytest.approx(70.5e3, rel=0.05)
    assert layout_memory(LLAMA1B, Layout("local"), lora_levers, 1).total / GIB == pytest.approx(21.8, rel=0.08)


def test_plan_command_takes_the_local_precision_flags():
    from click.testing import CliRunner

    from toolkit.plan.command import plan_command

    def run(*flags):
        args = ["--model", str(CONFIGS / "llama-3.2-1b.json"), "--gpus", "1", "--gpu", "h200", "--micro-batch-size", "4",
                "--global-batch-size", "4", "--strategies", "local", "--json", *flags]
        out = CliRunner().invoke(plan_command, args)
        assert out.exit_code == 0, out.output
        return json.loads(out.output)["ranked"][0]

    chunked, recompute, autocast = (run("--no-local-fused-loss", *flags) for flags in
                                    ((), ("--local-recompute-logits",), ("--no-local-master-weights",)))
    assert chunked["memory_gib"]["fp32 master weights"] > 0 and "bf16 weight copies (autocast)" not in chunked["memory_gib"]
    assert recompute["memory_gib"]["logits + loss"] < chunked["memory_gib"]["logits + loss"]
    assert recompute["tokens_per_second"] < chunked["tokens_per_second"]  # the head GEMM runs again in backward
    assert "fp32 master weights" not in autocast["memory_gib"] and autocast["memory_gib"]["bf16 weight copies (autocast)"] > 0
    # The engine's GPU defaults (Triton kernels, fused loss) are the plan's defaults: less memory, faster.
    default, fused_only = run(), run("--local-kernels", "none")
    assert default["memory_gib"]["logits + loss"] < fused_only["memory_gib"]["logits + loss"] < chunked["memory_gib"]["logits + loss"]
    assert default["memory_gib"]["activations"] == chunked["memory_gib"]["activations"] < fused_only["memory_gib"]["activations"]
    assert default["tokens_per_second"] > chunked["tokens_per_second"]
    assert run("--local-fused-loss", "--local-recompute-logits")["memory_gib"] == default["memory_gib"]  # fused wins


def test_gemma2_keeps_its_score_rows_only_when_left_eager(tmp_path):
    """Gemma 2's soft-capped attention: FlexAttention (``--local-packed-attention auto`` on a GPU) keeps no scores for
    backward, eager (``sdpa-mask``) keeps a row of them per query and head; other families run SDPA either way.
    On an H100 the two measured 37.7 and 62.0 GiB where the planner says 40.5 and 64.8 (docs/benchmarks.md)."""
    from click.testing import CliRunner

    from toolkit.plan.command import plan_command

    def activations(config, *flags):
        path = tmp_path / f"{config['model_type']}.json"
        path.write_text(json.dumps(config))
        args = ["--model", str(path), "--gpus", "1", "--seq-len", "4096", "--micro-batch-size", "4", "--strategies",
                "local", "--json", *flags]
        out = CliRunner().invoke(plan_command, args)
        assert out.exit_code == 0, out.output
        return json.loads(out.output)["ranked"][0]["memory_gib"]["activations"]

    gemma2 = dict(TINY_CONFIGS["gemma2"], hidden_size=2304, intermediate_size=9216, num_hidden_layers=6,
                  num_attention_heads=8, num_key_value_heads=4, head_dim=256, vocab_size=256000, sliding_window=1024)
    flex, eager = activations(gemma2), activations(gemma2, "--local-packed-attention", "sdpa-mask")
    assert flex == activations(gemma2, "--local-packed-attention", "flex") and eager > 2 * flex
    llama = dict(gemma2, model_type="llama")
    assert activations(llama) == activations(llama, "--local-packed-attention", "sdpa-mask")


def test_fused_loss_keeps_nothing_of_vocabulary_size_per_token():
    """The fused head's loss-time memory does not grow with the micro-batch's tokens times the vocabulary."""
    fused = replace(WORK, fused_loss=True)
    tokens, chunk, v, h = WORK.micro_batch_tokens, 2048, LLAMA1B.vocab, LLAMA1B.hidden
    reference = memory(LLAMA1B, Layout("local"), fused).logits  # torch reference ops: 10 bytes x vocab x chunk
    assert reference == max(2 * h * tokens + 10 * v * chunk, 2 * v * h + 4 * h * tokens)
    triton = memory(LLAMA1B, Layout("local"), replace(fused, kernels="triton")).logits  # gradient over the logits
    assert triton == max(2 * h * tokens + 2 * v * chunk, 2 * v * h + 4 * h * tokens)
    longer = replace(fused, seq_len=4 * WORK.seq_len)
    assert memory(LLAMA1B, Layout("local"), longer).logits - reference == pytest.approx(2 * h * 3 * tokens)
    assert memory(LLAMA1B, Layout("fsdp", dp=2, zero=3), fused).logits == memory(LLAMA1B, Layout("fsdp", dp=2, zero=3)).logits
    lora = memory(LLAMA1B, Layout("local"), replace(fused, tuner="lora")).logits  # frozen head: no weight gradient
    assert lora == 2 * h * tokens + 10 * v * chunk


def test_triton_kernels_keep_less_for_backward_in_their_families():
    kernels = replace(WORK, kernels="triton")
    h, f = LLAMA1B.hidden, LLAMA1B.ffn
    hf, fused = (activation_bytes_per_token_layer(LLAMA1B, Layout("local"), w) for w in (WORK, kernels))
    assert hf - fused == 8 * h + 2 * f
    assert (activation_bytes_per_token_layer(LLAMA1B, Layout("local"), replace(WORK, tuner="lora"))
            - activation_bytes_per_token_layer(LLAMA1B, Layout("local"), replace(kernels, tuner="lora"))) == 4 * h + 2 * f
    assert activation_bytes_per_token_layer(MIXTRAL, Layout("local"), kernels) == activation_bytes_per_token_layer(
        MIXTRAL, Layout("local"), WORK)  # not a patched family
    assert activation_bytes_per_token_layer(LLAMA1B, Layout("fsdp", dp=2, zero=3), kernels) == activation_bytes_per_token_layer(
        LLAMA1B, Layout("fsdp", dp=2, zero=3), WORK)  # only the local engine runs them


def test_auto_plans_the_engine_levers_as_they_resolve_on_a_gpu():
    from toolkit.plan.auto import local_speed
    from toolkit.recipe import resolve_recipe

    assert local_speed(resolve_recipe({"model": "m"}, source="test")) == {
        "kernels": "triton", "packed_attention": "flex", "fused_loss": True, "megatron_fused_loss": True}
    off = resolve_recipe({"model": "m", "local": {"kernels": "none", "fused_loss": False, "packed_attention": "sdpa-mask"}},
                         source="test")
    assert local_speed(off) == {"kernels": "none", "packed_attention": "sdpa-mask", "fused_loss": False,
                                "megatron_fused_loss": True}
    dpo_like = resolve_recipe({"model": "m"}, source="test")
    object.__setattr__(dpo_like, "loss", "no-such-loss")  # unknown or non-uniform losses keep the chunked head
    assert local_speed(dpo_like)["fused_loss"] is False and local_speed(dpo_like)["megatron_fused_loss"] is False


def test_megatron_fused_head_replaces_the_logits_of_the_last_stage():
    """--megatron-fused-loss: one chunk of the vocabulary shard instead of every token's logits shard."""
    tokens, chunk, v, h = WORK.micro_batch_tokens, 2048, LLAMA1B.vocab, LLAMA1B.hidden
    fused = replace(WORK, megatron_fused_loss=True)
    tp2 = Layout("megatron", tp=2)
    assert memory(LLAMA1B, tp2).logits == 10 * v / 2 * tokens
    assert memory(LLAMA1B, tp2, fused).logits == max(4 * h * tokens + 8 * v / 2 * chunk + 2 * v / 2 * h,
                                                     6 * h * tokens + 4 * v / 2 * h)
    assert memory(LLAMA1B, tp2, fused).logits < memory(LLAMA1B, tp2).logits
    longer = replace(fused, seq_len=4 * WORK.seq_len)  # grows with hidden x tokens, not vocabulary x tokens
    assert memory(LLAMA1B, tp2, longer).logits - memory(LLAMA1B, tp2, fused).logits <= 6 * h * 3 * tokens
    assert memory(LLAMA1B, Layout("local"), fused).logits == memory(LLAMA1B, Layout("local")).logits  # megatron only
    lora = memory(LLAMA1B, Layout("megatron"), replace(fused, tuner="lora")).logits  # TP1, torch ops, frozen head
    assert lora == 4 * h * tokens + max(10 * v * chunk, 2 * h * tokens)


@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "deepseek_v3", "deepseek_v2"])
def test_forward_flops_match_torch_flop_counter(family):
    """The planner's FLOPs per token against torch's FLOP counter on the transformers model (eager attention, so
    the scores' matmuls are counted; the counter counts them over the whole square, the planner the pairs the causal
    mask allows). MLA's latent projections and its query-key vs value widths, experts (top-k), shared experts and
    dense first layers all enter the count."""
    transformers = pytest.importorskip("transformers")
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from toolkit.plan.model import ModelShape
    from toolkit.plan.timing import train_flops_per_token

    config = transformers.AutoConfig.for_model(**TINY_CONFIGS[family], attn_implementation="eager",
                                              experts_implementation="eager")  # a loop over routed tokens
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    batch, seq = 2, 24
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(torch.randint(0, config.vocab_size, (batch, seq)))
    shape: ModelShape = shape_from_config(config.to_dict())
    dense, routed = train_flops_per_token(shape, Workload(seq_len=seq, micro_batch_size=batch), recompute=False)
    forward_causal = (dense + routed) / 3  # forward + backward = 3 forwards without recompute
    upper_triangle = 4 * shape.attention_width * shape.layers * (seq * (seq - 1) // 2)  # masked pairs the counter adds
    assert counter.get_total_flops() == pytest.approx(batch * (seq * forward_causal + upper_triangle), rel=1e-9)


WINDOWED = {  # window 5 over rows of 12 tokens: windowed layers see 5 keys per query at most
    "gemma2": dict(TINY_CONFIGS["gemma2"], num_hidden_layers=4, sliding_window=5),  # every other layer
    "gemma3_text": dict(TINY_CONFIGS["gemma3_text"], num_hidden_layers=4, sliding_window=5, sliding_window_pattern=3),
    "gemma3_layer_types": dict(TINY_CONFIGS["gemma3_text"], num_hidden_layers=3, sliding_window=5,
                               layer_types=["full_attention", "sliding_attention", "sliding_attention"]),
    "mistral": dict(TINY_CONFIGS["llama"], model_type="mistral", sliding_window=5),  # every layer
    "phi3": dict(TINY_CONFIGS["phi3"], sliding_window=5),
    "qwen2": dict(TINY_CONFIGS["qwen2"], num_hidden_layers=3, use_sliding_window=True, sliding_window=5,
                  max_window_layers=1),  # layers 1 and 2
    "qwen2_off": dict(TINY_CONFIGS["qwen2"], use_sliding_window=False, sliding_window=5),  # the window is ignored
    "qwen2_moe": dict(TINY_CONFIGS["qwen2_moe"], use_sliding_window=True, sliding_window=5, max_window_layers=2),
}


@pytest.mark.parametrize("case", sorted(WINDOWED))
def test_attention_pairs_match_the_masks_transformers_builds(case):
    """Sliding-window layers: the planner's query-key pairs per row against the masks transformers' own forward hands
    each attention layer (eager, so every mask is materialised), counted entry by entry: which layers are windowed
    (layer_types or each family's rule) and the window's bounds (the query itself inside) both come from transformers.
    Counting a windowed layer as full causal attention fails this."""
    transformers = pytest.importorskip("transformers")
    import torch

    config = transformers.AutoConfig.for_model(**WINDOWED[case], attn_implementation="eager")
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    allowed = []

    def count(module, args, kwargs):
        mask = kwargs["attention_mask"]
        allowed.append(int(mask.sum()) if mask.dtype == torch.bool else int((mask == 0).sum()))

    layers = model.model.layers
    for layer in layers:
        layer.self_attn.register_forward_pre_hook(count, with_kwargs=True)
    seq = 12
    with torch.no_grad():
        model(torch.randint(0, config.vocab_size, (1, seq)))
    shape = shape_from_config(config.to_dict())
    assert len(allowed) == len(layers) and shape.attention_pairs(seq) == sum(allowed)
    full = len(layers) * seq * (seq + 1) // 2
    assert (shape.attention_pairs(seq) < full) == (case != "qwen2_off")
    # the FLOPs and the time follow: a windowed model's attention is cheaper than the same model counted in full
    from toolkit.plan.timing import train_flops_per_token

    dense, _ = train_flops_per_token(shape, Workload(seq_len=seq), recompute=False)
    unwindowed, _ = train_flops_per_token(replace(shape, attention_windows=()), Workload(seq_len=seq), recompute=False)
    assert unwindowed - dense == pytest.approx(12 * shape.attention_width * (full - sum(allowed)) / seq)


@pytest.mark.parametrize(("family", "recompute"), [("llama", False), ("qwen2_moe", False), ("qwen3_moe", False),
                                                   ("qwen3_moe_mixed", False), ("mixtral", False), ("deepseek_v3", False),
                                                   ("llama", True), ("qwen2_moe", True), ("qwen3_moe", True),
                                                   ("deepseek_v3", True)])
def test_lora_training_flops_match_torch_flop_counter(family, recompute):
    """Issue 27: LoRA's training FLOPs (forward + backward, recompute) against torch's FLOP counter on a PEFT model
    (r=4 on every linear, as toolkit-peft's default), so every matmul PEFT and autograd actually run counts: the
    frozen base's input gradients without weight gradients (none through the first layer's input projections), the
    adapters, top-k routed experts (folded ``W + s*A_e B_e`` by PEFT >= 0.22 on every MoE family, whose folded
    weights do get a gradient), the router, shared experts and their gate, dense layers between MoE
    layers. The counter counts the attention scores over the whole square, the planner the pairs the causal mask
    allows (the strict upper triangle, added below). Without recompute the counts agree exactly. With recompute torch's non-reentrant
    checkpoint stops re-running a layer once backward has every tensor it saved, so the trailing matmul of each
    layer whose output nothing saves (the last adapter's B, a frozen down projection) is skipped: the planner, which
    counts a whole second forward, may be high by at most one linear's forward per layer, never low."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from toolkit.plan.timing import train_flops_per_token

    config = transformers.AutoConfig.for_model(**TINY_CONFIGS[family], attn_implementation="eager",
                                              experts_implementation="eager")  # a loop over routed tokens
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).train()
    if recompute:  # as toolkit.models.load_hf_model enables it, before the tuner
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    rank, batch, seq = 4, 2, 24
    model = peft.get_peft_model(model, peft.LoraConfig(r=rank, target_modules="all-linear"))
    with FlopCounterMode(display=False) as counter:
        model(torch.randint(0, config.vocab_size, (batch, seq))).logits.float().logsumexp(-1).mean().backward()
    shape = shape_from_config(config.to_dict())
    dense, routed = train_flops_per_token(shape, Workload(seq_len=seq, micro_batch_size=batch, tuner="lora",
                                                          lora_rank=rank), recompute=recompute)
    upper_triangle = (16 if recompute else 12) * shape.attention_width * shape.layers * (seq * (seq - 1) // 2)
    planned, measured = batch * (seq * (dense + routed) + upper_triangle), counter.get_total_flops()
    if not recompute:
        assert measured == pytest.approx(planned, rel=1e-12)
        return
    widths = [(shape.hidden, shape.ffn), (shape.hidden, shape.expert_ffn), (shape.hidden, shape.shared_expert_ffn)]
    one_linear = max(2 * (i * o + rank * (i + o)) for i, o in widths)
    assert 0 <= planned - measured <= batch * seq * shape.layers * one_linear, (planned, measured)
