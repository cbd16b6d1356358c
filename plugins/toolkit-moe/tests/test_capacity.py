"""Capacity factor: which assignments are dropped, how they are counted, and what the block outputs."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st


def _brute_force_keep(experts: torch.Tensor, capacity: int | None) -> list[list[bool]]:
    """Token-major, first come first served: assignment (t, j) is kept while its expert has room."""
    used: dict[int, int] = {}
    keep = []
    for row in experts.tolist():
        flags = []
        for e in row:
            used[e] = used.get(e, 0) + 1
            flags.append(capacity is None or used[e] <= capacity)
        keep.append(flags)
    return keep


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.integers(1, 40),
    num_experts=st.integers(2, 9),
    top_k=st.integers(1, 3),
    capacity_factor=st.sampled_from([0.0, 0.25, 0.5, 1.0, 1.3, 2.0]),
    seed=st.integers(0, 2**16),
)
def test_route_drops_and_counts_like_brute_force(tokens, num_experts, top_k, capacity_factor, seed) -> None:
    from toolkit_moe.routing import capacity, route

    top_k = min(top_k, num_experts)
    logits = torch.randn(tokens, num_experts, generator=torch.Generator().manual_seed(seed)) * 3
    routing = route(logits, top_k, normalize=True, capacity_factor=capacity_factor)
    limit = capacity(tokens, top_k, num_experts, capacity_factor)
    assert limit is None or limit == math.ceil(capacity_factor * tokens * top_k / num_experts)
    keep = torch.tensor(_brute_force_keep(routing.experts, limit))
    counts = torch.bincount(routing.experts.flatten(), minlength=num_experts)

    assert torch.equal(routing.tokens_per_expert, counts)
    expected_kept = counts if limit is None else counts.clamp(max=limit)
    assert torch.equal(routing.kept_per_expert, expected_kept)
    assert int(routing.dropped) == int((~keep).sum()) == int((counts - expected_kept).sum())
    assert torch.equal(routing.kept.view(tokens, top_k), keep)
    unrouted = route(logits, top_k, normalize=True)
    assert torch.equal(routing.weights, torch.where(keep, unrouted.weights, torch.zeros_like(unrouted.weights)))
    # Expert-major order: every kept assignment first, grouped by expert, ties in token order.
    kept_total = int(keep.sum())
    order = routing.order.tolist()
    flat_experts = routing.experts.flatten().tolist()
    front = order[:kept_total]
    assert all(keep.flatten()[i] for i in front) and not any(keep.flatten()[i] for i in order[kept_total:])
    assert front == sorted(front, key=lambda i: (flat_experts[i], i))
    assert sorted(order) == list(range(tokens * top_k))


@settings(max_examples=12, deadline=None)
@given(tokens=st.integers(1, 24), capacity_factor=st.sampled_from([0.3, 0.7, 1.0]), seed=st.integers(0, 2**16),
       backend=st.sampled_from(["loop", "grouped_mm"]))
def test_block_output_skips_exactly_the_dropped_assignments(tokens, capacity_factor, seed, backend) -> None:
    """Output = sum over kept (token, slot) of weight * expert(token), computed one by one.

    With ``grouped_mm`` the dropped rows are computed by the last expert and must still vanish.
    """
    import transformers

    from toolkit_moe.block import BlockOptions, MoeBlock
    from toolkit_moe.families import FAMILIES
    from toolkit_moe.routing import capacity, route
    from toolkit_moe.testing import tiny_config

    config = tiny_config("qwen3_moe")
    torch.manual_seed(seed)
    hf = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock(config)
    for p in hf.parameters():
        torch.nn.init.normal_(p, std=0.3)
    block = MoeBlock(hf, FAMILIES["qwen3_moe"], config, BlockOptions(capacity_factor=capacity_factor, experts_backend=backend)).train()
    x = torch.randn(1, tokens, config.hidden_size, generator=torch.Generator().manual_seed(seed))
    out = block(x)[0]

    logits = x[0] @ hf.gate.weight.T
    unrouted = route(logits, config.num_experts_per_tok, normalize=True)
    keep = _brute_force_keep(unrouted.experts, capacity(tokens, config.num_experts_per_tok, config.num_experts, capacity_factor))
    expected = torch.zeros_like(out)
    for t in range(tokens):
        for j, e in enumerate(unrouted.experts[t].tolist()):
            if keep[t][j]:
                gate, up = (hf.experts.gate_up_proj[e] @ x[0, t]).chunk(2)
                expected[t] += unrouted.weights[t, j] * (hf.experts.down_proj[e] @ (torch.nn.functional.silu(gate) * up))
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_grouped_mm_with_drops_has_the_gradients_of_the_loop() -> None:
    """Dropped rows ride along in the last expert's group: they must add nothing to any gradient."""
    import copy

    import transformers

    from toolkit_moe.block import BlockOptions, MoeBlock
    from toolkit_moe.families import FAMILIES
    from toolkit_moe.testing import tiny_config

    config = tiny_config("qwen2_moe")
    torch.manual_seed(0)
    hf = transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock(config)
    for p in hf.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(2, 13, config.hidden_size, generator=torch.Generator().manual_seed(1))
    results = []
    for backend in ("loop", "grouped_mm"):
        block = MoeBlock(copy.deepcopy(hf), FAMILIES["qwen2_moe"], config, BlockOptions(capacity_factor=0.5, experts_backend=backend)).train()
        xb = x.clone().requires_grad_(True)
        block(xb).square().sum().backward()
        results.append((xb.grad, {n: p.grad for n, p in block.named_parameters()}))
    (x_loop, loop), (x_grouped, grouped) = results
    torch.testing.assert_close(x_grouped, x_loop)
    for name in loop:
        torch.testing.assert_close(grouped[name], loop[name], msg=lambda m, n=name: f"{n}: {m}")
