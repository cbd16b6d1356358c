"""A patched block equals transformers' own (fp32 outputs and gradients), per family."""

from __future__ import annotations

import copy

import pytest
import torch

from toolkit_moe.testing import tiny_config

FAMILY_CASES = [
    ("qwen3_moe", {"norm_topk_prob": True}),
    ("qwen3_moe", {"norm_topk_prob": False}),
    ("qwen2_moe", {"norm_topk_prob": False}),
    ("qwen2_moe", {"norm_topk_prob": True}),
    ("mixtral", {}),
    ("qwen3_moe", {"num_hidden_layers": 3, "mlp_only_layers": [1]}),  # a dense MLP between two MoE layers
]


def _hf_model(family: str, **overrides):
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(family, **overrides)).float().train()
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return model


def _forward_backward(model, ids, probe):
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids).logits
    (logits * probe).sum().backward()
    return logits.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("backend", ["loop", "grouped_mm"])  # torch's grouped GEMM also runs on CPU (torch >= 2.10)
@pytest.mark.parametrize(("family", "overrides"), FAMILY_CASES)
def test_patched_model_matches_hf(family: str, overrides: dict, backend: str) -> None:
    from toolkit_moe.block import MoeBlock
    from toolkit_moe.patch import patch_moe_blocks

    reference = _hf_model(family, **overrides)
    ours = copy.deepcopy(reference)
    sparse = [hasattr(layer.mlp, "experts") for layer in reference.model.layers]  # as transformers built them
    assert patch_moe_blocks(ours, experts_backend=backend) == sum(sparse)
    assert [isinstance(layer.mlp, MoeBlock) for layer in ours.model.layers] == sparse
    assert dict(ours.state_dict()).keys() == dict(reference.state_dict()).keys()

    ids = torch.randint(0, reference.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    probe = torch.randn(2, 12, reference.config.vocab_size, generator=torch.Generator().manual_seed(2))
    ref_logits, ref_grads = _forward_backward(reference, ids, probe)
    logits, grads = _forward_backward(ours, ids, probe)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_aux_loss_matches_hf_load_balancing(family: str) -> None:
    """One layer's aux loss equals transformers' Switch loss on that layer's router logits."""
    import importlib

    from toolkit_moe.families import FAMILIES
    from toolkit_moe.routing import route

    config = tiny_config(family)
    logits = torch.randn(40, FAMILIES[family].num_experts(config), generator=torch.Generator().manual_seed(3), requires_grad=True)
    hf = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    expected = hf.load_balancing_loss_func((logits,), logits.shape[1], config.num_experts_per_tok)
    routing = route(logits, config.num_experts_per_tok, normalize=True)
    torch.testing.assert_close(routing.aux_loss, expected)
    torch.testing.assert_close(routing.z_loss, (torch.logsumexp(logits, -1) ** 2).mean())
    grad, = torch.autograd.grad(routing.aux_loss, logits)
    expected_grad, = torch.autograd.grad(expected, logits)
    torch.testing.assert_close(grad, expected_grad)


def test_mixtral_topk_then_softmax_is_renormalised_softmax() -> None:
    from toolkit_moe.routing import route, route_reference

    logits = torch.randn(64, 8, generator=torch.Generator().manual_seed(4))
    routing = route(logits, 2, normalize=True)
    weights, experts = route_reference(logits, 2, normalize=True)
    torch.testing.assert_close(routing.weights, weights)
    assert torch.equal(routing.experts, experts)


def test_model_aux_loss_is_added_and_cleared_per_forward() -> None:
    from toolkit_moe.patch import patch_moe_blocks

    model = _hf_model("qwen3_moe")
    patch_moe_blocks(model, aux_loss_coef=0.5, z_loss_coef=0.25, experts_backend="loop")
    ids = torch.randint(0, 64, (1, 8))
    model(input_ids=ids)
    model(input_ids=ids)  # a second forward replaces, never accumulates
    loss, metrics = model.toolkit_pop_aux_loss()
    assert loss.requires_grad
    expected = 0.5 * metrics["moe_aux_loss"] + 0.25 * metrics["moe_z_loss"]
    torch.testing.assert_close(loss.detach(), expected)
    assert model.toolkit_pop_aux_loss() == (None, {})
    model.eval()
    model(input_ids=ids)
    assert model.toolkit_pop_aux_loss() == (None, {})


def _padded_forward(model):
    """A forward of two rows, the second ending in 5 padding positions; the router logits per MoE layer and the real mask."""
    logits = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda _m, _i, out: logits.append(out[0].detach()))
             for layer in model.model.layers]
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(6))
    attention_mask = torch.ones_like(ids)
    attention_mask[1, 7:] = 0
    model(input_ids=ids, attention_mask=attention_mask)
    for hook in hooks:
        hook.remove()
    return logits, attention_mask


def test_aux_loss_leaves_padding_out_like_hf_with_an_attention_mask() -> None:
    """Given the real tokens, each layer's aux loss is transformers' Switch loss with that attention mask."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    from toolkit_moe.patch import patch_moe_blocks, patched_blocks
    from toolkit_moe.routing import load_balancing_loss

    model = _hf_model("qwen3_moe")
    patch_moe_blocks(model, aux_loss_coef=1.0, z_loss_coef=0.0, experts_backend="loop")
    layer_logits, attention_mask = _padded_forward(model)
    real = attention_mask.flatten().bool()
    experts, top_k = model.config.num_experts, model.config.num_experts_per_tok
    expected = [load_balancing_loss_func((logits,), experts, top_k, attention_mask) for logits in layer_logits]
    routings = list(patched_blocks(model)[0].collector.routings)
    assert len(routings) == len(expected) == 2
    for routing, reference in zip(routings, expected, strict=True):
        torch.testing.assert_close(load_balancing_loss(routing.probs, routing.experts, real), reference, rtol=0, atol=1e-6)
    loss, metrics = model.toolkit_pop_aux_loss(tokens=real)
    torch.testing.assert_close(loss, torch.stack(expected).mean(), rtol=0, atol=1e-6)
    z = [(torch.logsumexp(logits, -1) ** 2)[real].mean() for logits in layer_logits]
    torch.testing.assert_close(metrics["moe_z_loss"], torch.stack(z).mean(), rtol=0, atol=1e-6)
    unmasked = [load_balancing_loss_func((logits,), experts, top_k) for logits in layer_logits]
    assert abs(float(loss.detach()) - float(torch.stack(unmasked).mean())) > 1e-3  # the padding positions did count before


def test_aux_loss_without_tokens_counts_every_position() -> None:
    """``toolkit_pop_aux_loss()`` keeps its old meaning: every position, padding included, counts (bit for bit)."""
    from toolkit_moe.patch import patch_moe_blocks

    model = _hf_model("qwen3_moe")
    patch_moe_blocks(model, aux_loss_coef=0.5, z_loss_coef=0.25, experts_backend="loop")
    layer_logits, _ = _padded_forward(model)
    experts, top_k = model.config.num_experts, model.config.num_experts_per_tok
    layers = []
    for logits in layer_logits:  # the formula as toolkit-moe computed it in the block before the mask existed
        probs = torch.softmax(logits.float(), dim=-1)
        counts = torch.bincount(torch.topk(probs, top_k, dim=-1).indices.flatten(), minlength=experts)
        aux = experts * torch.sum(counts.float() / logits.shape[0] * probs.mean(dim=0))
        layers.append(0.5 * aux + 0.25 * torch.logsumexp(logits.float(), dim=-1).square().mean())
    loss, _ = model.toolkit_pop_aux_loss()
    assert torch.equal(loss.detach(), torch.stack(layers).sum() / len(layers))


def test_engine_forward_passes_the_real_tokens() -> None:
    """Through the core's ``CausalLMLogps`` with padding, the aux loss of three MoE layers and its router gradients
    equal the core's own HF path (transformers' ``load_balancing_loss_func`` per layer, averaged)."""
    from toolkit.train.logps import CausalLMLogps
    from toolkit_moe.patch import patch_moe_blocks

    reference = _hf_model("qwen3_moe", num_hidden_layers=3, router_aux_loss_coef=0.1)
    ours = copy.deepcopy(reference)
    patch_moe_blocks(ours, z_loss_coef=0.0, experts_backend="loop")
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(7))
    sequence_ids = torch.zeros_like(ids)
    sequence_ids[1, 7:] = -1
    positions = torch.arange(12).expand(2, 12)
    labels = ids.masked_fill(sequence_ids < 0, -100)
    expected = CausalLMLogps(reference)(ids, labels, positions, sequence_ids)[1]
    aux = CausalLMLogps(ours)(ids, labels, positions, sequence_ids)[1]
    torch.testing.assert_close(aux, expected, rtol=0, atol=1e-6)
    expected.backward()
    aux.backward()
    gates = [name for name, _ in reference.named_parameters() if name.endswith("mlp.gate.weight")]
    assert len(gates) == 3
    for name in gates:
        torch.testing.assert_close(ours.get_parameter(name).grad, reference.get_parameter(name).grad, rtol=1e-5, atol=1e-7)


def test_unknown_family_is_a_clear_error() -> None:
    import transformers

    from toolkit.errors import ModelError
    from toolkit_moe.patch import patch_moe_blocks

    config = transformers.LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1)
    with pytest.raises(ModelError, match="llama"):
        patch_moe_blocks(transformers.AutoModelForCausalLM.from_config(config))


def test_fused_weighted_swiglu_and_permutation_gradients_match_autograd() -> None:
    from toolkit_moe.permute import inverse_permutation, reduce_rows, replicate_rows, weighted_swiglu

    gen = torch.Generator().manual_seed(5)
    gate_up = torch.randn(11, 8, dtype=torch.float64, generator=gen, requires_grad=True)
    weight = torch.rand(11, 1, dtype=torch.float64, generator=gen, requires_grad=True)
    assert torch.autograd.gradcheck(weighted_swiglu, (gate_up, weight))
    tokens = torch.randn(5, 3, dtype=torch.float64, generator=gen, requires_grad=True)
    order = torch.randperm(10, generator=gen)
    inverse = inverse_permutation(order)
    assert torch.autograd.gradcheck(lambda t: replicate_rows(t, order, inverse, 2), (tokens,))
    rows = torch.randn(10, 3, dtype=torch.float64, generator=gen, requires_grad=True)
    assert torch.autograd.gradcheck(lambda r: reduce_rows(r, order, inverse, 2), (rows,))
    torch.testing.assert_close(replicate_rows(tokens, order, inverse, 2), tokens[order // 2])
