"""The activation and peak-memory model against what really happens on CPU: autograd's saved
tensors of an HF Llama (fp32 under bf16 autocast, and the local engine's bf16 + fp32-master path with
the registered full/lora tuners) and the CPU allocator trace of one ``engine.train_step``.

``saved_tensors_hooks`` sees every tensor kept for the backward pass; parameters, their bf16
autocast copies and vocabulary-sized loss tensors are accounted separately by the planner.
Weight copies are recognised by identity, not shape: 2 x 128 tokens has the shape of q_proj.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from toolkit.plan import Layout, Workload, shape_from_config
from toolkit.plan.measure import saved_activation_bytes
from toolkit.plan.memory import activation_bytes_per_token_layer

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

CONFIG = dict(model_type="llama", hidden_size=256, intermediate_size=768, num_hidden_layers=3, num_attention_heads=8,
              num_key_value_heads=2, vocab_size=1000, tie_word_embeddings=False)


def hf_loss(model, ids):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return model(input_ids=ids, labels=ids).loss


@pytest.mark.parametrize("seq_len", [96, 128, 384])
def test_full_finetune_activations_match_autograd(seq_len):
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(**CONFIG)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    batch = 2
    ids = torch.randint(0, CONFIG["vocab_size"], (batch, seq_len))
    measured = saved_activation_bytes(model, lambda: hf_loss(model, ids), CONFIG["vocab_size"])
    shape = shape_from_config(config.to_dict())
    workload = Workload(seq_len=seq_len, micro_batch_size=batch, bf16_mode="autocast")  # fp32 under autocast
    predicted = activation_bytes_per_token_layer(shape, Layout("local"), workload) * shape.layers * batch * seq_len
    assert predicted == pytest.approx(measured, rel=0.08)


@pytest.mark.parametrize("tuner", ["full", "lora"])
@pytest.mark.parametrize("family", ["glm4", "gemma", "gemma2", "gemma3_text"])
def test_family_activations_match_autograd(family, tuner, tmp_path):
    """Families whose layers keep more than Llama's (the local engine's bf16 path): GLM-4's and Gemma 2/3's norms on
    the sublayer outputs, Gemma 3's QK norm, Gemma's (1 + weight) norms computed in fp32, and Gemma 2's eager
    attention (transformers' only path with soft-capping: the scores are kept)."""
    from toolkit.plan.measure import local_engine

    if tuner == "lora":
        pytest.importorskip("toolkit_peft")
    config = dict(CONFIG, model_type=family, head_dim=32, pad_token_id=0)
    engine, loss_fn, _ = local_engine(config, tmp_path / "model", tuner=tuner, seq_len=128, micro_batch_size=2)
    measured = saved_activation_bytes(engine.model, loss_fn, CONFIG["vocab_size"])
    shape = shape_from_config(config)
    workload = Workload(seq_len=128, micro_batch_size=2, tuner=tuner, lora_rank=16)
    predicted = activation_bytes_per_token_layer(shape, Layout("local"), workload) * shape.layers * 2 * 128
    assert predicted == pytest.approx(measured, rel=0.08)


@pytest.mark.parametrize("tuner", ["full", "lora"])
def test_engine_activations_match_autograd(tuner, tmp_path):
    """bf16 parameters with fp32 masters (--precision bf16), the tuner from the registry."""
    from toolkit.plan.measure import local_engine

    if tuner == "lora":
        pytest.importorskip("toolkit_peft")
    seq_len = 128
    engine, loss_fn, _ = local_engine(CONFIG, tmp_path / "model", tuner=tuner, seq_len=seq_len, micro_batch_size=2)
    measured = saved_activation_bytes(engine.model, loss_fn, CONFIG["vocab_size"])
    shape = shape_from_config(CONFIG)
    workload = Workload(seq_len=seq_len, micro_batch_size=2, tuner=tuner, lora_rank=16)
    predicted = activation_bytes_per_token_layer(shape, Layout("local"), workload) * shape.layers * 2 * seq_len
    assert predicted == pytest.approx(measured, rel=0.08)


@pytest.mark.parametrize("tuner,recompute,micro_batches", [("full", False, 1), ("full", True, 1), ("lora", False, 1),
                                                            ("full", False, 2)])
def test_peak_memory_matches_the_cpu_allocator(tuner, recompute, micro_batches, tmp_path):
    """The whole breakdown (bf16 weights, fp32 masters and master gradients, Adam states, activations,
    chunked logits, bf16 gradients) against the allocator trace of one ``train_step`` of the local
    engine on CPU. There is no CUDA workspace; CPU AdamW runs tensor by tensor (its temporaries
    replace the fused kernel's none)."""
    from toolkit.plan import layout_memory
    from toolkit.plan.measure import cpu_peak_bytes, engine_allocated_bytes, local_engine
    from toolkit.plan.memory import cpu_optimizer_temp

    if tuner == "lora":
        pytest.importorskip("toolkit_peft")
    seq_len = 256
    engine, _, step = local_engine(CONFIG, tmp_path / "model", tuner=tuner, seq_len=seq_len, recompute=recompute,
                                   micro_batches=micro_batches)
    step()  # creates the optimizer states
    measured = cpu_peak_bytes(step, engine_allocated_bytes(engine))
    shape = shape_from_config(CONFIG)
    estimate = layout_memory(shape, Layout("local", recompute=recompute),
                             Workload(seq_len=seq_len, micro_batch_size=1, tuner=tuner), micro_batches=micro_batches)
    estimate.buffers = 0.0
    estimate.optimizer_step_temp = max(estimate.optimizer_step_temp, cpu_optimizer_temp(shape, tuner))
    assert estimate.total == pytest.approx(measured, rel=0.08)


LOGITS_CONFIG = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                     num_key_value_heads=1, vocab_size=8000, tie_word_embeddings=False)


@pytest.mark.parametrize("recompute_logits", [False, True])
def test_chunk_logits_memory_matches_the_cpu_allocator(recompute_logits, tmp_path):
    """A vocabulary-dominated model with 4 chunks per micro-batch: kept bf16 logits of every chunk
    (the engine's default) against recomputing them in backward (--local-recompute-logits)."""
    from toolkit.plan import layout_memory
    from toolkit.plan.measure import cpu_peak_bytes, engine_allocated_bytes, local_engine
    from toolkit.plan.memory import cpu_optimizer_temp

    seq_len, chunk = 512, 128
    engine, _, step = local_engine(LOGITS_CONFIG, tmp_path / "model", seq_len=seq_len, chunk_tokens=chunk,
                                   recompute_logits=recompute_logits)
    step()
    measured = cpu_peak_bytes(step, engine_allocated_bytes(engine))
    shape = shape_from_config(LOGITS_CONFIG)
    workload = Workload(seq_len=seq_len, logps_chunk_tokens=chunk, recompute_logits=recompute_logits)
    estimate = layout_memory(shape, Layout("local"), workload, micro_batches=1)
    estimate.buffers = 0.0
    estimate.optimizer_step_temp = max(estimate.optimizer_step_temp, cpu_optimizer_temp(shape, "full"))
    assert estimate.forward_backward_peak > estimate.optimizer_step_peak or recompute_logits
    assert estimate.total == pytest.approx(measured, rel=0.08)


@pytest.mark.parametrize("tuner,bf16_mode", [("full", "master"), ("full", "autocast"), ("lora", "master")])
def test_fused_loss_memory_matches_the_cpu_allocator(tuner, bf16_mode, tmp_path):
    """--local-fused-loss (the engine's default on a GPU) with the torch reference ops: the head's
    gradients made in forward, one chunk's logits with an fp32 copy and log-softmax at a time, nothing
    of vocabulary size kept for backward; bf16 parameters with fp32 masters, fp32 parameters under
    autocast (an fp32 weight gradient), and a frozen head (LoRA)."""
    from toolkit.plan import layout_memory
    from toolkit.plan.measure import cpu_peak_bytes, engine_allocated_bytes, local_engine
    from toolkit.plan.memory import cpu_optimizer_temp

    if tuner == "lora":
        pytest.importorskip("toolkit_peft")
    seq_len, chunk = 512, 128
    engine, _, step = local_engine(LOGITS_CONFIG, tmp_path / "model", tuner=tuner, seq_len=seq_len, chunk_tokens=chunk,
                                   bf16_mode=bf16_mode, fused_loss=True)
    step()
    assert engine.fused_loss and engine.kernel_ops is None  # the fused head on the torch reference ops
    measured = cpu_peak_bytes(step, engine_allocated_bytes(engine))
    shape = shape_from_config(LOGITS_CONFIG)
    workload = Workload(seq_len=seq_len, logps_chunk_tokens=chunk, tuner=tuner, bf16_mode=bf16_mode,
                        fused_loss=True)
    estimate = layout_memory(shape, Layout("local"), workload, micro_batches=1)
    estimate.buffers = 0.0
    estimate.optimizer_step_temp = max(estimate.optimizer_step_temp, cpu_optimizer_temp(shape, tuner))
    assert estimate.total == pytest.approx(measured, rel=0.08)
    if tuner == "full":  # the chunked path's estimate (kept logits) does not fit this run: the fused term does
        chunked = layout_memory(shape, Layout("local"), replace(workload, fused_loss=False), micro_batches=1)
        chunked.buffers, chunked.optimizer_step_temp = 0.0, estimate.optimizer_step_temp
        assert chunked.total != pytest.approx(measured, rel=0.08)


def test_the_planner_knows_which_families_the_kernels_patch():
    from toolkit.plan.memory import KERNEL_FAMILIES
    from toolkit.train.kernels.patch import FAMILIES

    assert KERNEL_FAMILIES == FAMILIES


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_pure_bf16_peak_memory_matches_the_cpu_allocator(micro_batches, tmp_path):
    """--local-bf16-mode pure: bf16 parameters, bf16 gradients accumulated in place and bf16 AdamW states
    (no fp32 copy) against the allocator trace of one ``train_step``; the estimate is well below the
    master-weights one for the same run."""
    from toolkit.plan import layout_memory
    from toolkit.plan.measure import cpu_peak_bytes, engine_allocated_bytes, local_engine
    from toolkit.plan.memory import cpu_optimizer_temp

    seq_len = 256
    engine, _, step = local_engine(CONFIG, tmp_path / "model", seq_len=seq_len, bf16_mode="pure", micro_batches=micro_batches)
    assert engine.master is None and all(p.dtype == torch.bfloat16 for p in engine.params)
    step()  # creates the optimizer states
    assert all(t.dtype == torch.bfloat16 for s in engine.optimizer.state.values() for t in s.values() if t.dim())
    measured = cpu_peak_bytes(step, engine_allocated_bytes(engine))
    shape = shape_from_config(CONFIG)
    workload = Workload(seq_len=seq_len, micro_batch_size=1, bf16_mode="pure")
    estimate = layout_memory(shape, Layout("local"), workload, micro_batches=micro_batches)
    estimate.buffers = 0.0
    estimate.optimizer_step_temp = max(estimate.optimizer_step_temp, cpu_optimizer_temp(shape, "full", state_bytes=2.0))
    assert estimate.total == pytest.approx(measured, rel=0.08)
    master = layout_memory(shape, Layout("local"), Workload(seq_len=seq_len), micro_batches=micro_batches)
    assert estimate.weights + estimate.gradients + estimate.optimizer == pytest.approx(
        (master.weights + master.master + master.gradients + master.optimizer) * 8 / 18)
