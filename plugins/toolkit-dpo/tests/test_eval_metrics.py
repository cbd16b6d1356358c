"""Evaluation during DPO training: the eval/ metrics are DPO's implicit-reward formulas (Rafailov et al. 2023)
over the held-out pairs, computed from the exported policy and the untouched base model."""

from __future__ import annotations

import json
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def test_dpo_eval_metrics_are_the_implicit_rewards_of_the_trained_policy(tmp_path):
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from toolkit.builtins.loaders import materialize_preset
    from toolkit.data.reading import read_records
    from toolkit.recipe import resolve_recipe
    from toolkit.testing import write_jsonl
    from toolkit.train.runner import run_training
    from toolkit_dpo.evaluation import pair_logps

    beta = 0.5
    records = [{k: v for k, v in r.items() if k != "__line__"} for r in read_records("parity-prefs-eval", limit=9)[1]]
    held_out = write_jsonl(tmp_path / "held-out.jsonl", records)  # 9 pairs: not a multiple of any batch
    recipe = resolve_recipe({"model": "tiny-llama", "dataset": ["parity-prefs"], "loss": "dpo", "max_steps": 3,
                             "max_samples": 48, "micro_batch_size": 4, "global_batch_size": 8, "lr": 1e-3,
                             "eval_dataset": [held_out], "output": str(tmp_path / "run"), "export": "hf",
                             "dpo": {"beta": beta}})
    run = run_training(recipe)
    last = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][-1]

    base = materialize_preset("tiny-llama")
    tokenizer = AutoTokenizer.from_pretrained(base)
    with torch.no_grad():
        chosen, rejected = pair_logps(AutoModelForCausalLM.from_pretrained(run / "export"), tokenizer, held_out)
        ref_chosen, ref_rejected = pair_logps(AutoModelForCausalLM.from_pretrained(base), tokenizer, held_out)
    chosen_rewards, rejected_rewards = beta * (chosen - ref_chosen), beta * (rejected - ref_rejected)
    margins = chosen_rewards - rejected_rewards
    assert last["eval/examples"] == 9
    assert last["eval/loss"] == pytest.approx(float(-F.logsigmoid(margins).mean()), rel=1e-4)
    assert last["eval/rewards/margins"] == pytest.approx(float(margins.mean()), rel=1e-3, abs=1e-5)
    assert last["eval/rewards/chosen"] == pytest.approx(float(chosen_rewards.mean()), rel=1e-3, abs=1e-5)
    assert last["eval/rewards/accuracies"] == pytest.approx(float((margins > 0).float().mean()))
    assert float(margins.abs().max()) > 0  # the policy moved: the check compares something
