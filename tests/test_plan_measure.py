"""The activation model against what autograd really saves in an HF Llama (CPU, bf16 autocast).

``saved_tensors_hooks`` sees every tensor kept for the backward pass; parameters, their bf16
autocast copies and vocabulary-sized loss tensors are accounted separately by the planner.
Weight copies are recognised by identity, not shape: 2 x 128 tokens has the shape of q_proj.
"""

from __future__ import annotations

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
    workload = Workload(seq_len=seq_len, micro_batch_size=batch)
    predicted = activation_bytes_per_token_layer(shape, Layout("local"), workload) * shape.layers * batch * seq_len
    assert predicted == pytest.approx(measured, rel=0.08)


def test_lora_activations_match_autograd():
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(**CONFIG)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(torch.bfloat16)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=32, target_modules=targets, lora_dropout=0.0))
    batch, seq_len = 2, 96
    ids = torch.randint(0, CONFIG["vocab_size"], (batch, seq_len))
    measured = saved_activation_bytes(model, lambda: hf_loss(model, ids), CONFIG["vocab_size"])
    shape = shape_from_config(config.to_dict())
    workload = Workload(seq_len=seq_len, micro_batch_size=batch, tuner="lora", lora_rank=16)
    predicted = activation_bytes_per_token_layer(shape, Layout("local"), workload) * shape.layers * batch * seq_len
    assert predicted == pytest.approx(measured, rel=0.08)


@pytest.mark.parametrize("tuner,recompute", [("full", False), ("full", True), ("lora", False)])
def test_peak_memory_matches_the_cpu_allocator(tuner, recompute):
    """The whole breakdown (weights, optimizer, activations, chunked logits, autocast copies) against
    the allocator trace of one training step of the core engine's path, on CPU. CPU AdamW runs per
    tensor (no foreach temporary) and there is no CUDA workspace, so those two terms are left out."""
    from toolkit.plan import layout_memory
    from toolkit.plan.measure import allocated_bytes, cpu_peak_bytes
    from toolkit.train.logps import CausalLMLogps

    if tuner == "lora":
        peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(**CONFIG)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    if tuner == "lora":
        model = peft.get_peft_model(model.to(torch.bfloat16), peft.LoraConfig(
            r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    if recompute:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if tuner == "lora":
            model.enable_input_require_grads()
    module = CausalLMLogps(model, torch.bfloat16)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-4)
    seq_len = 256
    ids = torch.randint(0, CONFIG["vocab_size"], (1, seq_len + 1))
    positions = torch.arange(seq_len)[None]

    def step():
        optimizer.zero_grad(set_to_none=True)
        logps = module(ids[:, :-1], ids[:, 1:], positions, torch.zeros_like(positions))[0]
        (-logps.mean()).backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()

    step()  # creates the optimizer states
    optimizer.zero_grad(set_to_none=True)
    measured = cpu_peak_bytes(step, allocated_bytes(model, optimizer))
    shape = shape_from_config(config.to_dict())
    estimate = layout_memory(shape, Layout("local", recompute=recompute),
                             Workload(seq_len=seq_len, micro_batch_size=1, tuner=tuner), micro_batches=1)
    estimate.buffers = estimate.optimizer_step_temp = 0.0
    assert estimate.total == pytest.approx(measured, rel=0.08)
