"""The loss contract's edges: pairing errors, a missing reference, option validation, the NLL fallback."""

from __future__ import annotations

import pytest
import torch
from helpers import context, pair_batch, random_pairs, tiny_model, token_logps

from toolkit.contracts import StepContext
from toolkit.errors import ConfigError, ToolkitError
from toolkit_dpo import losses
from toolkit_dpo.functional import PairingError

PAIRS = random_pairs(3, seed=7)


def test_incomplete_pairs_are_refused():
    batch = pair_batch(PAIRS)
    batch["sequence_meta"]["roles"][-1] = 0  # the last pair now has two "chosen" sequences
    out = token_logps(tiny_model(), batch)
    ctx = context(batch, 3)
    with pytest.raises(PairingError, match="complete chosen/rejected pairs"):
        losses.CPOLoss()(out, ctx)
    del batch["sequence_meta"]["roles"]
    with pytest.raises(PairingError, match="'preference' dataset format"):
        losses.CPOLoss()(out, ctx)


def test_missing_reference_is_a_clear_error():
    batch = pair_batch(PAIRS)
    with pytest.raises(ToolkitError, match="needs reference log-probs"):
        losses.DPOLoss()(token_logps(tiny_model(), batch), context(batch, 3))


def test_options_are_validated_with_the_section_named():
    from toolkit.recipe import resolve_recipe

    with pytest.raises(ConfigError) as info:
        resolve_recipe({"loss": "dpo", "dpo": {"beta": 0, "variant": "robust", "label_smoothing": 0.5}})
    text = str(info.value)
    assert "dpo" in text and "beta must be positive" in text and "label_smoothing must lie in [0, 0.5)" in text
    with pytest.raises(ConfigError, match="undesirable_weight must be positive"):
        losses.KTOLoss(losses.KTOConfig(undesirable_weight=0))


def test_nll_term_without_a_chosen_token_count_averages_each_response():
    """An engine that gives no counts['chosen_label_tokens'] gets the per-sequence mean, then the example mean."""
    model, reference = tiny_model(0), tiny_model(1).eval()
    batch = pair_batch(PAIRS)
    with_counts = context(batch, 3)
    without = StepContext(label_tokens=with_counts.label_tokens, sequences=6, examples=3)
    with torch.no_grad():
        out = token_logps(model, batch, reference)
    dpo_only = float(losses.DPOLoss(losses.DPOConfig(beta=0.1))(out, without).loss)
    mixed = float(losses.DPOLoss(losses.DPOConfig(beta=0.1, sft_weight=1.0))(out, without).loss)
    sums, tokens = out.sequence_sums()[0::2], out.sequence_token_counts()[0::2]
    assert mixed - dpo_only == pytest.approx(float(-(sums / tokens).mean()), rel=1e-5)
    token_mean = float(losses.DPOLoss(losses.DPOConfig(beta=0.1, sft_weight=1.0))(out, with_counts).loss) - dpo_only
    assert token_mean == pytest.approx(float(-sums.sum() / tokens.sum()), rel=1e-5)
    assert not torch.isclose(torch.tensor(token_mean), torch.tensor(mixed - dpo_only))  # lengths differ here
