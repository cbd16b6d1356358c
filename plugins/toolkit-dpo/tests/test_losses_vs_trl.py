"""Every loss against TRL 1.16 on the same tiny model and data: loss value, gradients and metrics.

TRL's own loss code runs (DPOTrainer/KTOTrainer._compute_loss with TRL's fused LM head,
CPOTrainer.get_batch_loss_metrics with TRL's forward, ORPOTrainer.odds_ratio_loss,
RewardTrainer.compute_loss) on a trainer stub that holds only the attributes that code reads.
Our side computes label log-probs with a plain HF forward and calls our registered loss.
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
    pair_batch,
    random_pairs,
    tiny_model,
    token_logps,
    trl_pair_inputs,
    trl_stub,
)

from toolkit_dpo import losses

os.environ.setdefault("HF_HUB_OFFLINE", "1")
trl = pytest.importorskip("trl")
torch.set_num_threads(1)

PAIRS = random_pairs(4, seed=3)


@pytest.fixture(scope="module")
def models():
    policy = tiny_model(seed=0)
    reference = tiny_model(seed=1).eval()
    return policy, reference


def ours(loss, policy, reference, pairs=PAIRS, splits=1):
    """Our loss summed over ``splits`` micro-batches of the pairs; returns (loss, metrics, grads)."""
    size = len(pairs) // splits
    batches = [pair_batch(pairs[k:k + size], start=k) for k in range(0, len(pairs), size)]
    ctx = context(batches, examples=len(pairs))
    total, metrics = 0.0, {}
    for batch in batches:
        out = loss(token_logps(policy, batch, reference if loss.needs_reference else None), ctx)
        out.loss.backward()
        total += out.loss.detach()
        for key, value in out.metrics.items():
            metrics[key] = metrics.get(key, 0.0) + float(value)
    return float(total), metrics, grads(policy)


def reference_sums(reference, pairs):
    out = token_logps(reference, pair_batch(pairs))
    sums = out.sequence_sums().detach()
    return sums[0::2], sums[1::2]


def trl_dpo(policy, reference, loss_types, weights=None, pairs=PAIRS, **attrs):
    from trl import DPOTrainer
    from trl.trainer.utils import add_fused_lm_head

    model = copy.deepcopy(policy)
    add_fused_lm_head(model, outputs=("log_probs", "entropy", "mean_logits", "is_top1"))
    stub = trl_stub(DPOTrainer, model, ld_alpha=None, precompute_ref_logps=True, f_divergence_type="reverse_kl",
                    loss_types=loss_types, loss_weights=weights or [1.0] * len(loss_types), use_weighting=False, **attrs)
    inputs = trl_pair_inputs(pairs)
    inputs["ref_chosen_logps"], inputs["ref_rejected_logps"] = reference_sums(reference, pairs)
    loss = stub._compute_loss(model, inputs, return_outputs=False)
    loss.backward()
    metrics = {k: v[-1] for k, v in stub._metrics["train"].items()}
    return float(loss.detach()), metrics, grads(model)


def check_metrics(mine, theirs, keys=("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies",
                                      "logps/chosen", "logps/rejected")):
    for key in keys:
        assert mine[key] == pytest.approx(theirs[key], rel=1e-5, abs=1e-6), key


@pytest.mark.parametrize("splits", [1, 2])
def test_dpo_sigmoid_matches_trl(models, splits):
    policy, reference = models
    expected = trl_dpo(policy, reference, ["sigmoid"], beta=0.1, label_smoothing=0.0)
    got = ours(losses.DPOLoss(losses.DPOConfig(beta=0.1)), policy, reference, splits=splits)
    assert got[0] == pytest.approx(expected[0], rel=1e-6)
    assert_grads_close(got[2], expected[2])
    check_metrics(got[1], expected[1])


def test_dpo_robust_matches_trl(models):
    policy, reference = models
    expected = trl_dpo(policy, reference, ["robust"], beta=0.5, label_smoothing=0.2)
    got = ours(losses.DPOLoss(losses.DPOConfig(beta=0.5, label_smoothing=0.2, variant="robust")), policy, reference)
    assert got[0] == pytest.approx(expected[0], rel=1e-6)
    assert_grads_close(got[2], expected[2])


@pytest.mark.parametrize("splits", [1, 2])
def test_dpo_with_sft_term_matches_trl(models, splits):
    policy, reference = models
    expected = trl_dpo(policy, reference, ["sigmoid", "sft"], weights=[1.0, 0.3], beta=0.2, label_smoothing=0.0)
    got = ours(losses.DPOLoss(losses.DPOConfig(beta=0.2, sft_weight=0.3)), policy, reference, splits=splits)
    assert got[0] == pytest.approx(expected[0], rel=1e-6)
    assert_grads_close(got[2], expected[2])


def test_conservative_dpo_matches_trl_cpo_formula(models):
    """TRL 1.16's DPO sigmoid has no label smoothing; its CPO sigmoid loss is the cDPO formula on log-ratios."""
    from trl.experimental.cpo import CPOTrainer

    policy, reference = models
    model = copy.deepcopy(policy)
    out = token_logps(model, pair_batch(PAIRS))
    sums = out.sequence_sums()
    ref_c, ref_r = reference_sums(reference, PAIRS)
    stub = trl_stub(CPOTrainer, model, alpha=0.0, loss_type="sigmoid", beta=0.3, label_smoothing=0.15)
    trl_losses, _, _ = stub.cpo_loss(sums[0::2] - ref_c, sums[1::2] - ref_r)
    trl_losses.mean().backward()
    expected = grads(model)
    got = ours(losses.DPOLoss(losses.DPOConfig(beta=0.3, label_smoothing=0.15)), policy, reference)
    assert got[0] == pytest.approx(float(trl_losses.mean().detach()), rel=1e-6)
    assert_grads_close(got[2], expected)


def test_ipo_matches_trl(models):
    policy, reference = models
    expected = trl_dpo(policy, reference, ["ipo"], beta=0.4, label_smoothing=0.0)
    got = ours(losses.IPOLoss(losses.IPOConfig(beta=0.4)), policy, reference)
    assert got[0] == pytest.approx(expected[0], rel=1e-6)
    assert_grads_close(got[2], expected[2])


def test_hinge_matches_trl(models):
    policy, reference = models
    expected = trl_dpo(policy, reference, ["hinge"], beta=2.0, label_smoothing=0.0)
    got = ours(losses.HingeLoss(losses.HingeConfig(beta=2.0)), policy, reference)
    assert got[0] == pytest.approx(expected[0], rel=1e-6)
    assert expected[0] > 0  # some pairs inside the hinge, so gradients are not trivially zero
    assert_grads_close(got[2], expected[2])


def trl_cpo_batch(pairs):
    """CPOTrainer's batch: unshifted labels, -100 on prompt and padding."""
    batch = {}
    for side, index in (("chosen", 1), ("rejected", 2)):
        rows = [(p[0], p[index]) for p in pairs]
        width = max(len(a) + len(b) for a, b in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        attention = torch.zeros_like(ids)
        labels = torch.full_like(ids, -100)
        for i, (prompt, response) in enumerate(rows):
            n = len(prompt) + len(response)
            ids[i, :n] = torch.tensor(prompt + response)
            attention[i, :n] = 1
            labels[i, len(prompt):n] = torch.tensor(response)
        batch.update({f"{side}_input_ids": ids, f"{side}_attention_mask": attention, f"{side}_labels": labels})
    return batch


def trl_cpo(policy, **attrs):
    from trl.experimental.cpo import CPOTrainer

    model = copy.deepcopy(policy)
    stub = trl_stub(CPOTrainer, model, is_encoder_decoder=False, pad_token_id=0, alpha=0.0, **attrs)
    loss, metrics = stub.get_batch_loss_metrics(model, trl_cpo_batch(PAIRS))
    loss.backward()
    return float(loss.detach()), metrics, grads(model)


@pytest.mark.parametrize("splits", [1, 2])
def test_cpo_matches_trl(models, splits):
    policy, _ = models
    expected = trl_cpo(policy, loss_type="sigmoid", beta=0.1, label_smoothing=0.1, cpo_alpha=1.0)
    got = ours(losses.CPOLoss(losses.CPOConfig(beta=0.1, label_smoothing=0.1, sft_weight=1.0)), policy, None,
               splits=splits)
    assert got[0] == pytest.approx(expected[0], rel=1e-6)
    assert_grads_close(got[2], expected[2])
    check_metrics(got[1], expected[1])
    assert got[1]["nll"] == pytest.approx(expected[1]["nll_loss"], rel=1e-6)


def test_simpo_matches_trl(models):
    policy, _ = models
    expected = trl_cpo(policy, loss_type="simpo", beta=2.0, simpo_gamma=0.7, label_smoothing=0.0, cpo_alpha=0.0)
    got = ours(losses.SimPOLoss(losses.SimPOConfig(beta=2.0, gamma=0.7)), policy, None)
    assert got[0] == pytest.approx(expected[0], rel=1e-6)
    assert_grads_close(got[2], expected[2])
    check_metrics(got[1], expected[1], keys=("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"))


def test_orpo_matches_trl(models):
    """TRL's odds_ratio_loss and get_batch_logps; the NLL term over the chosen response tokens.

    (TRL's ORPO trainer also puts the prompt tokens into its NLL term; ours trains responses only,
    like every preference loss here, so the reference NLL is TRL's cross-entropy on response labels.)
    """
    from trl.experimental.orpo import ORPOTrainer

    policy, _ = models
    model = copy.deepcopy(policy)
    stub = trl_stub(ORPOTrainer, model, beta=0.25)
    batch = trl_cpo_batch(PAIRS)
    logits, labels = [], []
    for side in ("chosen", "rejected"):
        logits.append(model(input_ids=batch[f"{side}_input_ids"], attention_mask=batch[f"{side}_attention_mask"]).logits)
        labels.append(batch[f"{side}_labels"])
    chosen = ORPOTrainer.get_batch_logps(logits[0], labels[0], average_log_prob=True)
    rejected = ORPOTrainer.get_batch_logps(logits[1], labels[1], average_log_prob=True)
    odds_losses, *_ = stub.odds_ratio_loss(chosen, rejected)
    nll = torch.nn.functional.cross_entropy(logits[0][:, :-1].flatten(0, 1), labels[0][:, 1:].flatten())
    expected_loss = nll - odds_losses.mean()
    expected_loss.backward()
    expected = grads(model)
    got = ours(losses.ORPOLoss(losses.ORPOConfig(beta=0.25)), policy, None)
    assert got[0] == pytest.approx(float(expected_loss.detach()), rel=1e-6)
    assert_grads_close(got[2], expected)


def kto_records(n: int, seed: int):
    pairs = random_pairs(n, seed=seed)
    labels = [k % 3 != 1 for k in range(n)]  # unbalanced on purpose
    completions = [c for _, c, _ in pairs]
    kl_completions = [completions[-1]] + completions[:-1]  # TRL's rotation by one
    return [(p, c, kl, lab) for (p, c, _), kl, lab in zip(pairs, kl_completions, labels, strict=True)]


def kto_batch(records):
    seqs, ids, roles, label, kl = [], [], [], [], []
    for k, (prompt, completion, kl_completion, desirable) in enumerate(records):
        seqs += [(prompt, completion), (prompt, kl_completion)]
        ids += [k, k]
        roles += [0 if desirable else 1] * 2
        label += [float(desirable)] * 2
        kl += [0.0, 1.0]
    return micro_batch(seqs, ids, roles, {"kto_label": label, "kto_kl": kl})


def trl_kto_inputs(records, reference):
    def padded(rows):
        inputs = trl_pair_inputs([(p, c, c) for p, c in rows])
        return {k: v[:len(rows)] for k, v in inputs.items()}

    main = padded([(p, c) for p, c, _, _ in records])
    kl = padded([(p, k) for p, _, k, _ in records])
    ref = token_logps(reference, kto_batch(records)).sequence_sums().detach()
    return {**main, "KL_input_ids": kl["input_ids"], "KL_attention_mask": kl["attention_mask"],
            "KL_completion_mask": kl["completion_mask"], "label": torch.tensor([r[3] for r in records]),
            "ref_logps": ref[0::2], "ref_KL_logps": ref[1::2]}


def test_kto_unpaired_matches_trl(models):
    from trl import KTOTrainer
    from trl.trainer.utils import add_fused_lm_head

    policy, reference = models
    records = kto_records(6, seed=5)
    model = copy.deepcopy(policy)
    add_fused_lm_head(model, outputs=("log_probs", "entropy", "mean_logits"))
    stub = trl_stub(KTOTrainer, model, calculate_KL=True, precompute_ref_logps=True, loss_type="kto", beta=0.3,
                    desirable_weight=1.0, undesirable_weight=1.5)
    expected_loss = stub._compute_loss(model, trl_kto_inputs(records, reference), return_outputs=False)
    expected_loss.backward()
    expected = grads(model)
    assert stub._metrics["train"]["kl"][-1] > 0  # the reference point is active, not clamped to 0

    loss = losses.KTOLoss(losses.KTOConfig(beta=0.3, desirable_weight=1.0, undesirable_weight=1.5))
    # TRL estimates the KL reference point over its whole batch: one micro-batch here.
    batch = kto_batch(records)
    out = loss(token_logps(policy, batch, reference), context(batch, examples=len(records)))
    out.loss.backward()
    total = float(out.loss.detach())
    assert total == pytest.approx(float(expected_loss.detach()), rel=1e-6)
    assert_grads_close(grads(policy), expected)
    assert float(out.metrics["kl"]) == pytest.approx(stub._metrics["train"]["kl"][-1], rel=1e-5)
    fraction = float(out.metrics["kto/desirable_fraction"])
    assert float(out.metrics["rewards/chosen"]) / fraction == pytest.approx(stub._metrics["train"]["rewards/chosen"][-1], rel=1e-5)


def test_kto_paired_matches_trl_unpaired_expansion(models):
    """Preference pairs under KTO: chosen desirable, rejected undesirable, no KL sequences (z0 = 0)."""
    from trl import KTOTrainer
    from trl.trainer.utils import add_fused_lm_head

    policy, reference = models
    model = copy.deepcopy(policy)
    add_fused_lm_head(model, outputs=("log_probs", "entropy", "mean_logits"))
    stub = trl_stub(KTOTrainer, model, calculate_KL=False, precompute_ref_logps=True, loss_type="kto", beta=0.2,
                    desirable_weight=1.0, undesirable_weight=1.0)
    inputs = trl_pair_inputs(PAIRS)
    ref_c, ref_r = reference_sums(reference, PAIRS)
    inputs.update(label=torch.tensor([True] * len(PAIRS) + [False] * len(PAIRS)), ref_logps=torch.cat([ref_c, ref_r]))
    expected_loss = stub._compute_loss(model, inputs, return_outputs=False)
    expected_loss.backward()
    expected = grads(model)
    got = ours(losses.KTOLoss(losses.KTOConfig(beta=0.2)), policy, reference, splits=2)
    assert got[0] == pytest.approx(float(expected_loss.detach()), rel=1e-6)
    assert_grads_close(got[2], expected)


def test_reward_model_matches_trl():
    from trl import RewardTrainer

    model = tiny_model(seed=4, classification=True)
    margins = [0.0, 0.5, -0.25, 1.0]
    theirs = copy.deepcopy(model)
    stub = trl_stub(RewardTrainer, theirs)
    stub.args.center_rewards_coefficient = 0.01
    inputs = trl_pair_inputs(PAIRS)
    inputs.pop("completion_mask")
    inputs["margin"] = torch.tensor(margins)
    expected_loss = stub.compute_loss(theirs, inputs)
    expected_loss.backward()
    expected = grads(theirs)

    rm = losses.RewardLoss(losses.RewardConfig(center_rewards_coefficient=0.01))
    total = 0.0
    for k in (0, 2):
        batch = pair_batch(PAIRS[k:k + 2], start=k)
        batch["sequence_meta"]["margin"] = torch.tensor([margins[k], margins[k], margins[k + 1], margins[k + 1]])
        attention = (batch["sequence_ids"] >= 0).long()
        scores = model(input_ids=batch["input_ids"], attention_mask=attention).logits.squeeze(-1)
        out = rm(_scores_only(batch, scores), context(batch, 4))
        out.loss.backward()
        total += float(out.loss.detach())
    assert total == pytest.approx(float(expected_loss.detach()), rel=1e-6)
    assert_grads_close(grads(model), expected)


def _scores_only(batch, scores):
    from toolkit.contracts import TokenLogps

    mask = batch["labels"] != -100
    return TokenLogps(logps=torch.zeros(mask.shape), mask=mask, sequence_ids=batch["sequence_ids"],
                      num_sequences=batch["num_sequences"], sequence_meta=batch["sequence_meta"], scores=scores)
