"""Packed rows through FlexAttention (``--local-packed-attention flex``) against masked SDPA and HF per sample.

torch 2.13 refuses FlexAttention's backward on CPU with a device check in ``flex_attention``; its eager
path (the unfused reference the compiled kernels are tested against) is device-agnostic, so the tests
that compare gradients lift that one check (``cpu_flex_backward`` from toolkit.testing). The engine keeps
refusing it otherwise.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from toolkit.contracts import StepContext
from toolkit.errors import ConfigError
from toolkit.testing import packed_batch
from toolkit.train import attention
from toolkit.train.logps import CausalLMLogps, attention_mask_for, token_logps

pytest.importorskip("torch.nn.attention.flex_attention")

# row 0: three samples packed + padding; row 1: one sample filling the row (plain); row 2: one sample + padding
ROWS = [[7, 9, 5], [24], [15]]
LENGTH = 24


def make_batch(rows: list[list[int]], vocab: int) -> dict:
    return packed_batch(rows, LENGTH, vocab)


def weights_for(batch: dict) -> torch.Tensor:
    """Fixed per-token weights, so the gradients below are not those of a plain sum."""
    return torch.linspace(0.5, 1.5, batch["labels"].numel()).view(batch["labels"].shape)


def engine_logps_and_grads(model, batch: dict, packed: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    out = token_logps(CausalLMLogps(model, packed_attention=packed), batch, torch.device("cpu"))
    (out.logps * weights_for(batch)).sum().backward()
    return out.logps.detach(), [p.grad.clone() for p in model.parameters()]


def per_sample_logps_and_grads(model, batch: dict) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The reference: one plain HF forward per sample, its label log-probs put back where the batch has them."""
    model.zero_grad(set_to_none=True)
    logps = torch.zeros(batch["labels"].shape)
    weights = weights_for(batch)
    for row in range(batch["input_ids"].shape[0]):
        for sequence in batch["sequence_ids"][row].unique().tolist():
            if sequence < 0:
                continue
            where = (batch["sequence_ids"][row] == sequence).nonzero().squeeze(1)
            ids, labels = batch["input_ids"][row, where], batch["labels"][row, where]
            logits = model(input_ids=ids[None]).logits[0].float()
            trained = labels != -100
            picked = torch.log_softmax(logits[trained], -1).gather(-1, labels[trained, None]).squeeze(-1)
            (picked * weights[row, where[trained]]).sum().backward()
            logps[row, where[trained]] = picked.detach()
    return logps, [p.grad.clone() for p in model.parameters()]


def assert_grads_close(ours, reference, what):
    for a, b in zip(ours, reference):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=lambda m: f"{what}: {m}")


def test_block_mask_is_the_dense_block_causal_mask():
    from torch.nn.attention.flex_attention import create_mask

    sequence_ids = make_batch(ROWS, 64)["sequence_ids"]
    block_mask = attention.document_block_mask(sequence_ids)
    pattern = create_mask(block_mask.mask_mod, len(ROWS), 1, LENGTH, LENGTH, device="cpu")
    assert torch.equal(pattern, attention_mask_for(sequence_ids))
    assert pattern[0, 0, 7, 6].item() is False and pattern[0, 0, 7, 7].item() is True  # a new sample starts at 7
    assert pattern[0, 0, 23].sum() == 1  # padding attends to itself only


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "qwen3_moe"])
def test_flex_equals_masked_sdpa_and_hf_per_sample(tiny_model_factory, cpu_flex_backward, flex_calls, family):
    model = tiny_model_factory(family, num_hidden_layers=2).train()
    assert model.config._attn_implementation == "sdpa" and model.config.head_dim >= 16
    batch = make_batch(ROWS, model.config.vocab_size)
    reference, reference_grads = per_sample_logps_and_grads(model, batch)
    masked, masked_grads = engine_logps_and_grads(model, batch, "sdpa-mask")
    attention.use_flex(model)
    flex, flex_grads = engine_logps_and_grads(model, batch, "flex")
    assert len(flex_calls) == model.config.num_hidden_layers  # one mixed batch -> one BlockMask for all its rows
    trained = batch["labels"] != -100
    torch.testing.assert_close(flex[trained], masked[trained], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(flex, reference, rtol=1e-5, atol=1e-5)
    assert_grads_close(flex_grads, masked_grads, "flex vs masked SDPA")
    assert_grads_close(flex_grads, reference_grads, "flex vs HF per sample")


WINDOWED = {  # model_type: config the masked-SDPA path must hand its own mask (HF uses a 4-D mask as given)
    # eager attention (soft-capping): an additive 0/-inf mask; a final soft-cap low enough to bend these logits
    "gemma2": dict(head_dim=16, sliding_window=4, final_logit_softcapping=0.5),
    "gemma3_text": dict(head_dim=16, sliding_window=4),  # 5 windowed : 1 full layers, a mask per layer type
    "phi3": dict(sliding_window=4),  # every layer windowed
    "llama": dict(attn_implementation="eager"),
}


@pytest.mark.parametrize("model_type", list(WINDOWED))
def test_packed_rows_of_windowed_and_eager_models_equal_hf_per_sample(model_type):
    """Packed rows on the masked path keep each layer's sliding window and work under eager attention (before,
    a boolean mask added to eager scores masked nothing and windows were dropped for packed rows); Gemma 2's
    final logit soft-capping is in the trained log-probs."""
    from transformers import AutoConfig, AutoModelForCausalLM

    extra = dict(WINDOWED[model_type])
    implementation = extra.pop("attn_implementation", None)
    config = AutoConfig.for_model(model_type, vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
                                  num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, **extra)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, **({"attn_implementation": implementation} if implementation else {}))
    model = model.float().train()
    batch = make_batch(ROWS, model.config.vocab_size)
    reference, reference_grads = per_sample_logps_and_grads(model, batch)
    masked, masked_grads = engine_logps_and_grads(model, batch, "sdpa-mask")
    torch.testing.assert_close(masked, reference, rtol=1e-5, atol=1e-5)
    assert_grads_close(masked_grads, reference_grads, f"{model_type} masked SDPA vs HF per sample")


@pytest.mark.parametrize("model_type", ["gemma2", "gemma3_text", "phi3"])
def test_windowed_and_soft_capped_models_under_flex_equal_masked_sdpa_and_hf_per_sample(model_type, cpu_flex_backward,
                                                                                        monkeypatch):
    """Under ``flex`` each sliding-window layer gets the windowed document BlockMask (a dict by layer type where
    windowed and full layers mix) and Gemma 2, loaded eager for its attention soft cap, runs transformers' own
    flex_attention, which applies the cap: log-probs and gradients equal the masked path and HF per sample. The
    cap is set low enough to bend these scores, so a flex path without it fails."""
    from torch.nn.attention.flex_attention import flex_attention
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.integrations import flex_attention as hf_flex

    from toolkit.models import attention_kwargs

    # transformers compiles flex_attention on first use; on CPU the unfused reference is what the GPU kernel is tested against
    monkeypatch.setattr(hf_flex, "compile_friendly_flex_attention",
                        lambda query, key, value, training=False, **kwargs: flex_attention(query, key, value, **kwargs))
    extra = dict(WINDOWED[model_type], **({"attn_logit_softcapping": 0.5} if model_type == "gemma2" else {}))
    config = AutoConfig.for_model(model_type, vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
                                  num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, **extra)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, **attention_kwargs(config)).float().train()
    batch = make_batch(ROWS, model.config.vocab_size)
    reference, reference_grads = per_sample_logps_and_grads(model, batch)
    masked, masked_grads = engine_logps_and_grads(model, batch, "sdpa-mask")
    assert attention.apply_packed_attention("flex", model, torch.device("cpu"), "--local-packed-attention") == "flex"
    flex, flex_grads = engine_logps_and_grads(model, batch, "flex")
    trained = batch["labels"] != -100
    torch.testing.assert_close(flex[trained], masked[trained], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(flex, reference, rtol=1e-5, atol=1e-5)
    assert_grads_close(flex_grads, masked_grads, f"{model_type} flex vs masked SDPA")
    assert_grads_close(flex_grads, reference_grads, f"{model_type} flex vs HF per sample")


def test_plain_rows_never_build_a_block_mask(tiny_model_factory, monkeypatch, flex_calls):
    model = tiny_model_factory("llama").eval()
    batch = make_batch([[LENGTH], [LENGTH]], model.config.vocab_size)
    with torch.no_grad():
        before = token_logps(CausalLMLogps(model), batch, torch.device("cpu")).logps
    attention.use_flex(model)

    def refuse(sequence_ids):
        raise AssertionError("a plain batch built a BlockMask")

    monkeypatch.setattr(attention, "document_block_mask", refuse)
    with torch.no_grad():
        after = token_logps(CausalLMLogps(model, packed_attention="flex"), batch, torch.device("cpu")).logps
    assert flex_calls == []
    torch.testing.assert_close(after, before, rtol=0, atol=0)  # the same is_causal SDPA call


def test_reward_scores_with_flex_equal_masked_sdpa(tiny_model_factory):
    from transformers import AutoModelForSequenceClassification

    config = tiny_model_factory.config("llama", num_labels=1, pad_token_id=3)
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32).eval()
    batch = make_batch(ROWS, config.vocab_size)
    with torch.no_grad():
        masked = token_logps(CausalLMLogps(model), batch, torch.device("cpu")).scores
        attention.use_flex(model)
        flex = token_logps(CausalLMLogps(model, packed_attention="flex"), batch, torch.device("cpu")).scores
    assert masked.shape == (batch["num_sequences"],)
    torch.testing.assert_close(flex, masked, rtol=1e-5, atol=1e-5)


def _engine(packed: str, strategy: str = "local"):
    from toolkit.builtins.fsdp import FSDPConfig, FSDPEngine
    from toolkit.builtins.losses import SFTLoss
    from toolkit.builtins.strategies import LocalConfig, LocalEngine
    from toolkit.builtins.tuners import FullTuner
    from toolkit.models import resolve_model
    from toolkit.recipe import resolve_recipe

    recipe = resolve_recipe({"model": "tiny-llama", "lr": 1e-3, "precision": "fp32", "packing": True})
    if strategy == "fsdp":
        engine = FSDPEngine(resolve_model("tiny-llama"), FullTuner(), SFTLoss(), recipe, FSDPConfig(packed_attention=packed))
    else:
        engine = LocalEngine(resolve_model("tiny-llama"), FullTuner(), SFTLoss(), recipe, LocalConfig(packed_attention=packed))
    engine.set_total_steps(2)
    return engine, SFTLoss()


@pytest.mark.parametrize("strategy", ["local", "fsdp"])
def test_engine_step_with_flex_equals_masked_sdpa(cpu_flex_backward, flex_calls, strategy):
    results = {}
    for packed in ("sdpa-mask", "flex"):
        engine, loss = _engine(packed, strategy)
        try:
            assert engine.packed_attention == packed
            batch = make_batch(ROWS, 768)
            ctx = StepContext(label_tokens=int((batch["labels"] != -100).sum()), sequences=5, examples=5)
            grads = {}
            for name, param in engine.model.named_parameters():  # the gradients the optimizer steps with
                param.register_post_accumulate_grad_hook(lambda p, name=name, grads=grads: grads.__setitem__(name, full(p.grad)))
            step = engine.train_step([batch], loss, ctx)
            results[packed] = step.loss, step.grad_norm, grads
        finally:
            engine.close()
    assert flex_calls, "the flex engine never ran FlexAttention"
    (loss_m, norm_m, grads_m), (loss_f, norm_f, grads_f) = results["sdpa-mask"], results["flex"]
    assert loss_f == pytest.approx(loss_m, rel=1e-6) and norm_f == pytest.approx(norm_m, rel=1e-5)
    assert len(grads_m) == len(grads_f) == len(list(engine.model.parameters()))
    for name, grad in grads_m.items():
        torch.testing.assert_close(grads_f[name], grad, rtol=1e-4, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


def full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach().clone()


def test_auto_keeps_masked_sdpa_on_cpu(tiny_model_factory):
    model = tiny_model_factory("llama")
    assert attention.apply_packed_attention("auto", model, torch.device("cpu"), "--local-packed-attention") == "sdpa-mask"
    assert model.config._attn_implementation == "sdpa"


def test_auto_is_flex_on_cuda_unless_something_stands_in_the_way(tiny_model_factory, monkeypatch):
    """The GPU default without a GPU: torch's device check answered as on CUDA (where it accepts backward)."""
    monkeypatch.setattr(attention, "flex_backward_refused", lambda device: device.type != "cuda")
    model = tiny_model_factory("llama")
    assert attention.apply_packed_attention("auto", model, torch.device("cuda"), "--local-packed-attention") == "flex"
    assert model.config._attn_implementation == attention.ATTENTION_NAME
    dropout = tiny_model_factory("llama", attention_dropout=0.1)
    assert attention.apply_packed_attention("auto", dropout, torch.device("cuda"), "--local-packed-attention") == "sdpa-mask"
    eager = tiny_model_factory("llama", attn_implementation="eager")
    assert attention.apply_packed_attention("auto", eager, torch.device("cuda"), "--local-packed-attention") == "sdpa-mask"
    windowed = tiny_model_factory("mistral", sliding_window=16)  # the document BlockMask takes the window
    assert attention.apply_packed_attention("auto", windowed, torch.device("cuda"), "--local-packed-attention") == "flex"
    from transformers import AutoConfig, AutoModelForCausalLM

    gemma2 = AutoConfig.for_model("gemma2", vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    # loaded eager for its soft cap, which transformers' flex_attention applies too (measured on an H100: same losses,
    # 1.25x the tokens/s, 24 GiB less; docs/benchmarks.md)
    capped = AutoModelForCausalLM.from_config(gemma2, attn_implementation="eager")
    assert attention.apply_packed_attention("sdpa-mask", capped, torch.device("cuda"), "--local-packed-attention") == "sdpa-mask"
    assert capped.config._attn_implementation == "eager"
    assert attention.apply_packed_attention("auto", capped, torch.device("cuda"), "--local-packed-attention") == "flex"
    assert capped.config._attn_implementation == "flex_attention"


def test_forced_flex_that_cannot_run_is_a_clear_error(tiny_model_factory, monkeypatch):
    model = tiny_model_factory("llama")
    flag = "--local-packed-attention"
    with pytest.raises(ConfigError, match="no FlexAttention backward on cpu") as caught:
        attention.apply_packed_attention("flex", model, torch.device("cpu"), flag)
    assert f"use {flag} sdpa-mask" in str(caught.value)
    eager = tiny_model_factory("llama", attn_implementation="eager")
    with pytest.raises(ConfigError, match="attn_implementation 'eager'"):
        attention.apply_packed_attention("flex", eager, torch.device("cpu"), flag)
    monkeypatch.setattr(attention, "flex_missing", lambda: "torch 2.4 has no FlexAttention")
    with pytest.raises(ConfigError, match="torch 2.4 has no FlexAttention"):
        attention.apply_packed_attention("flex", model, torch.device("cpu"), flag)
    assert attention.apply_packed_attention("auto", model, torch.device("cuda"), flag) == "sdpa-mask"


@pytest.mark.skipif(not any(shutil.which(c) for c in ("c++", "g++", "clang++")), reason="inductor needs a C++ compiler on CPU")
def test_compiled_flex_forward_equals_masked_sdpa(tiny_model_factory, monkeypatch):
    """The mask function compiles (what runs on a GPU); on CPU inductor compiles the forward only."""
    from torch.nn.attention.flex_attention import flex_attention

    compiled = torch.compile(flex_attention)
    monkeypatch.setattr(attention, "_flex_kernel", lambda device_type: compiled)
    model = tiny_model_factory("qwen3").eval()
    batch = make_batch(ROWS, model.config.vocab_size)
    with torch.no_grad():
        masked = token_logps(CausalLMLogps(model), batch, torch.device("cpu")).logps
        attention.use_flex(model)
        flex = token_logps(CausalLMLogps(model, packed_attention="flex"), batch, torch.device("cpu")).logps
    torch.testing.assert_close(flex, masked, rtol=1e-5, atol=1e-5)
