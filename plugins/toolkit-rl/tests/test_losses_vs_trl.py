"""Each GRPO variant against TRL 1.16's GRPOTrainer._compute_loss on a fixed batch of rollouts: loss, gradients, metrics.

TRL's own loss code runs (with its fused LM head computing the log-probs) on a trainer stub holding
only the attributes that code reads. Our side: a plain HF forward gives label log-probs in the core's
contract and our registered ``grpo`` loss, summed over micro-batches, computes the step loss.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
from helpers import (
    assert_grads_close,
    context,
    grads,
    micro_batch,
    random_rollouts,
    tiny_model,
    token_logps,
    trl_grpo,
    trl_inputs,
)

from toolkit_rl.losses import GRPOConfig, GRPOLoss

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("trl")
torch.set_num_threads(1)
MAX_LENGTH = 10


@pytest.fixture(scope="module")
def setup():
    policy, reference = tiny_model(seed=0), tiny_model(seed=1).eval()
    return policy, random_rollouts(policy, reference, groups=2, group=4, seed=3)


def ours(policy, rollouts, loss: GRPOLoss, splits: int = 1):
    rows = list(range(len(rollouts.prompts)))
    size = len(rows) // splits
    batches = [micro_batch(rollouts, rows[k:k + size]) for k in range(0, len(rows), size)]
    ctx = context(batches)
    total, metrics = 0.0, {}
    for batch in batches:
        out = loss(token_logps(policy, batch), ctx)
        out.loss.backward()
        total += float(out.loss.detach())
        for key, value in out.metrics.items():
            metrics[key] = metrics.get(key, 0.0) + float(value)
    return total, metrics, grads(policy)


def theirs(policy, rollouts, splits: int = 1, **settings):
    model = copy.deepcopy(policy)
    trainer = trl_grpo(model, max_completion_length=MAX_LENGTH, accumulation=splits, **settings)
    rows = list(range(len(rollouts.prompts)))
    size = len(rows) // splits
    total = 0.0
    for k in range(0, len(rows), size):
        loss = trainer._compute_loss(model, trl_inputs(rollouts, rows[k:k + size], generation_rows=rows))
        loss.backward()
        total += float(loss)
    return total, trainer._metrics["train"], grads(model)


CASES = [  # (our loss_type, TRL loss_type, importance level, beta)
    ("grpo", "grpo", "token", 0.0),
    ("grpo", "grpo", "token", 0.04),
    ("dr_grpo", "dr_grpo", "token", 0.04),
    ("bnpo", "bnpo", "token", 0.0),
    ("dapo", "dapo", "token", 0.04),
    ("gspo", "grpo", "sequence", 0.0),
    ("gspo", "grpo", "sequence", 0.04),
]


@pytest.mark.parametrize("loss_type,trl_type,level,beta", CASES)
def test_loss_and_gradients_equal_trl(setup, loss_type, trl_type, level, beta):
    policy, rollouts = setup
    loss = GRPOLoss(GRPOConfig(loss_type=loss_type, beta=beta, max_new_tokens=MAX_LENGTH))
    eps, high, resolved_level, _, _ = loss.config.resolved()
    assert resolved_level == level
    mine, metrics, my_grads = ours(policy, rollouts, loss)
    reference, trl_metrics, trl_grads = theirs(policy, rollouts, loss_type=trl_type, beta=beta, epsilon=eps,
                                               epsilon_high=high, level=level)
    assert mine == pytest.approx(reference, rel=1e-5, abs=1e-7)
    assert_grads_close(my_grads, trl_grads)
    assert metrics["clip_ratio/region"] == pytest.approx(trl_metrics["clip_ratio/region_mean"][0], abs=1e-6)
    assert metrics["clip_ratio/high"] == pytest.approx(trl_metrics["clip_ratio/high_mean"][0], abs=1e-6)
    if beta:
        assert metrics["kl"] == pytest.approx(trl_metrics["kl"][0], rel=1e-5)


@pytest.mark.parametrize("loss_type,trl_type", [("grpo", "grpo"), ("dr_grpo", "dr_grpo"), ("bnpo", "bnpo"), ("dapo", "dapo"),
                                               ("gspo", "grpo")])
def test_two_micro_batches_equal_trl_gradient_accumulation(setup, loss_type, trl_type):
    """One generation batch in two accumulation steps (TRL's steps_per_generation = gradient accumulation)."""
    policy, rollouts = setup
    loss = GRPOLoss(GRPOConfig(loss_type=loss_type, beta=0.04, max_new_tokens=MAX_LENGTH))
    eps, high, level, _, _ = loss.config.resolved()
    mine, _, my_grads = ours(policy, rollouts, loss, splits=2)
    reference, _, trl_grads = theirs(policy, rollouts, splits=2, loss_type=trl_type, beta=0.04, epsilon=eps,
                                     epsilon_high=high, level=level)
    assert mine == pytest.approx(reference, rel=1e-5, abs=1e-7)
    assert_grads_close(my_grads, trl_grads)


def test_the_clip_is_exercised_so_the_comparison_can_fail(setup):
    """With drifted old log-probs some ratios leave [1 - eps, 1 + eps]: clipping changes the gradient."""
    policy, rollouts = setup
    _, metrics, clipped = ours(policy, rollouts, GRPOLoss(GRPOConfig(max_new_tokens=MAX_LENGTH)))
    _, _, unclipped = ours(policy, rollouts, GRPOLoss(GRPOConfig(epsilon=10.0, max_new_tokens=MAX_LENGTH)))
    assert metrics["clip_ratio/region"] > 0
    assert any(not torch.allclose(clipped[n], unclipped[n]) for n in clipped)
