"""Chunked label log-probs through a trainable head: kept logits and recomputed logits equal full autograd."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from toolkit.train.logps import label_logps


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("chunk", [3, 64])
def test_trainable_head_gradients_equal_full_logits(recompute, chunk):
    torch.manual_seed(0)
    head = nn.Linear(16, 50, bias=False)
    hidden = torch.randn(20, 16, requires_grad=True)
    labels = torch.randint(0, 50, (20,))
    weights = torch.randn(20)  # any upstream gradient, as DPO-style losses produce
    ours = label_logps(head, hidden, labels, chunk=chunk, recompute=recompute)
    (ours * weights).sum().backward()
    grads = hidden.grad.clone(), head.weight.grad.clone()
    hidden.grad, head.weight.grad = None, None
    reference = torch.log_softmax(head(hidden), dim=-1).gather(-1, labels[:, None]).squeeze(-1)
    (reference * weights).sum().backward()
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grads[0], hidden.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grads[1], head.weight.grad, rtol=1e-5, atol=1e-6)


def test_kept_logits_under_bf16_autocast_match_recompute():
    torch.manual_seed(1)
    head = nn.Linear(32, 64, bias=False)
    hidden = torch.randn(12, 32, requires_grad=True)
    labels = torch.randint(0, 64, (12,))
    results = []
    for recompute in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = label_logps(head, hidden, labels, chunk=5, recompute=recompute)
        out.sum().backward()
        results.append((out.detach(), hidden.grad.clone(), head.weight.grad.clone()))
        hidden.grad, head.weight.grad = None, None
    for kept, recomputed in zip(*results):
        torch.testing.assert_close(kept, recomputed, rtol=2e-2, atol=2e-2)
    assert results[0][2].dtype == torch.float32  # the weight gradient comes back in the weight's dtype
