"""Label log-probs through a frozen head (gradient made in forward) equal autograd through the logits."""

from __future__ import annotations

import pytest
import torch

from toolkit.train import logps


def reference(head, hidden, labels):
    return torch.log_softmax(head(hidden).float(), dim=-1).gather(-1, labels[:, None]).squeeze(-1)


@pytest.mark.parametrize("autocast", [False, True])
def test_frozen_head_matches_autograd(autocast):
    torch.manual_seed(0)
    head = torch.nn.Linear(48, 500, bias=False).requires_grad_(False)
    assert logps.frozen_head(head)
    labels = torch.randint(0, 500, (130,))
    weights = torch.randn(130)
    results = []
    for fused in (True, False):
        hidden = (torch.randn(130, 48, generator=torch.Generator().manual_seed(1)) * 2).requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = logps.label_logps(head, hidden, labels, chunk=64) if fused else reference(head, hidden, labels)
        (out * weights).sum().backward()
        results.append((out.detach(), hidden.grad))
    (ours, our_grad), (theirs, their_grad) = results
    assert ours.dtype == torch.float32 and our_grad.dtype == torch.float32
    tolerance = dict(atol=2e-2, rtol=2e-2) if autocast else dict(atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(ours, theirs, **tolerance)
    torch.testing.assert_close(our_grad, their_grad, **tolerance)


def test_trainable_or_wrapped_heads_take_the_recompute_path():
    head = torch.nn.Linear(8, 16, bias=False)
    assert not logps.frozen_head(head)
    assert not logps.frozen_head(torch.nn.Linear(8, 16).requires_grad_(False))
    assert not logps.frozen_head(torch.nn.Sequential(torch.nn.Linear(8, 16, bias=False).requires_grad_(False)))
