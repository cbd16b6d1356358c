"""Reward modeling end to end: engine scores equal HF sequence classification (packed too), training helps,
and the ``hf-rm`` export loads with ``AutoModelForSequenceClassification``."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def scored_batches(tokenizer, packing: bool, samples: int = 6, dataset: str = "parity-prefs-eval"):
    from toolkit.data.pipeline import Batches, load_examples

    examples, _ = load_examples([dataset], tokenizer, max_samples=samples, example_kinds=("preference",))
    rows = 1 if packing else samples  # packed: one row of several pairs
    batches = Batches(examples, seed=0, seq_len=256, packing=packing, micro_batch_size=rows, global_batch_size=rows,
                      dp_rank=0, dp_world_size=1, pad_id=tokenizer.pad_token_id)
    return examples, batches.micro_batches(0)[0]


def hf_scores(model, examples, batch, pad_id):
    """Each sequence alone through HF's own sequence-classification forward."""
    scores = []
    for index, role in zip(batch["sequence_meta"]["dataset_index"].tolist(), batch["sequence_meta"]["roles"].tolist(),
                           strict=True):
        ids = torch.tensor([examples[index].sequences[role].input_ids])
        scores.append(model(input_ids=ids).logits[0, 0])
    return torch.stack(scores)


@pytest.mark.parametrize("packing", [False, True])
def test_engine_scores_equal_hf_sequence_classification(packing):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from toolkit.models import materialize_preset
    from toolkit.train.logps import CausalLMLogps, token_logps

    directory = materialize_preset("tiny-llama")
    tokenizer = AutoTokenizer.from_pretrained(directory)
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(directory, num_labels=1, pad_token_id=tokenizer.pad_token_id)
    examples, batch = scored_batches(tokenizer, packing)
    if packing:
        assert batch["input_ids"].shape[0] < batch["num_sequences"]  # several sequences share a row
    out = token_logps(CausalLMLogps(model), batch, torch.device("cpu"))
    expected = hf_scores(model, examples, batch, tokenizer.pad_token_id)
    torch.testing.assert_close(out.scores, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_rm_training_and_hf_rm_export(tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from toolkit.models import materialize_preset
    from toolkit.recipe import resolve_recipe
    from toolkit.train.logps import CausalLMLogps, token_logps
    from toolkit_dpo.functional import pair_indices

    # threads as the process has them (OMP_NUM_THREADS=1 in the test sessions): a second thread here spin-waits
    # against the other busy processes of a 2-core CI machine (and set_num_threads would outlive the test)
    base = materialize_preset("tiny-llama")
    tokenizer = AutoTokenizer.from_pretrained(base)
    # Scoring parity needs the answer and the number's last digit combined at the final token, which a
    # 2-layer model does not learn in a CPU-test budget; so the check is that it fits its 16 training pairs.
    recipe = resolve_recipe({"model": "tiny-llama", "dataset": ["parity-prefs"], "loss": "rm", "max_steps": 18,
                             "max_samples": 16, "micro_batch_size": 16, "global_batch_size": 16, "lr": 1e-3,
                             "schedule": "constant", "output": str(tmp_path / "run"), "export": "hf-rm", "log_every": 5})
    from toolkit.train.runner import run_training

    run = run_training(recipe)
    examples, batch = scored_batches(tokenizer, packing=False, samples=16, dataset="parity-prefs")

    def accuracy(model):
        with torch.no_grad():
            out = token_logps(CausalLMLogps(model).eval(), batch, torch.device("cpu"))
        chosen, rejected = pair_indices(out.sequence_meta)
        return float((out.scores[chosen] > out.scores[rejected]).float().mean())

    torch.manual_seed(recipe.seed)  # the engine's seeded value head before training
    before = AutoModelForSequenceClassification.from_pretrained(base, num_labels=1, pad_token_id=tokenizer.pad_token_id)
    exported = AutoModelForSequenceClassification.from_pretrained(run / "export-hf-rm")
    assert type(exported).__name__ == "LlamaForSequenceClassification" and exported.config.num_labels == 1
    accuracies = {"before": accuracy(before), "after": accuracy(exported)}
    print("training-pair reward accuracy", accuracies)
    assert accuracies["after"] >= max(0.9, accuracies["before"] + 0.2), accuracies
    # HF's own forward on the exported model gives the scores the engine trained on.
    few, few_batch = scored_batches(tokenizer, packing=True, samples=4)
    with torch.no_grad():
        engine_scores = token_logps(CausalLMLogps(exported), few_batch, torch.device("cpu")).scores
        torch.testing.assert_close(engine_scores, hf_scores(exported, few, few_batch, 0), rtol=1e-5, atol=1e-5)
    # The language-model exporter refuses it instead of writing a causal-LM config over a value head.
    from toolkit.errors import ToolkitError
    from toolkit.export import export_model, resolve_export_source

    with pytest.raises(ToolkitError, match="--to hf-rm"):
        export_model(resolve_export_source(str(run)), "hf", tmp_path / "wrong")


def test_rm_eval_metrics_are_hf_scores_of_the_held_out_pairs(tmp_path):
    """eval/ metrics of reward modeling: the Bradley-Terry loss, accuracy and margin of the held-out pairs, each
    sequence scored alone by transformers' sequence-classification forward on the exported reward model."""
    import json

    import torch.nn.functional as F
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from toolkit.data.reading import read_records
    from toolkit.models import materialize_preset
    from toolkit.recipe import resolve_recipe
    from toolkit.testing import write_jsonl
    from toolkit.train.runner import run_training
    from toolkit_dpo.functional import pair_indices

    records = [{k: v for k, v in r.items() if k != "__line__"} for r in read_records("parity-prefs-eval", limit=7)[1]]
    held_out = write_jsonl(tmp_path / "held-out.jsonl", records)  # 7 pairs: not a multiple of the micro-batch
    run = run_training(resolve_recipe({"model": "tiny-llama", "dataset": ["parity-prefs"], "loss": "rm", "max_steps": 3,
                                       "max_samples": 24, "micro_batch_size": 2, "global_batch_size": 8, "lr": 1e-3,
                                       "eval_dataset": [held_out], "output": str(tmp_path / "run"), "export": "hf-rm"}))
    last = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][-1]
    tokenizer = AutoTokenizer.from_pretrained(materialize_preset("tiny-llama"))
    examples, batch = scored_batches(tokenizer, packing=False, samples=7, dataset=held_out)
    model = AutoModelForSequenceClassification.from_pretrained(run / "export-hf-rm").eval()
    with torch.no_grad():
        scores = hf_scores(model, examples, batch, tokenizer.pad_token_id)
    chosen, rejected = pair_indices(batch["sequence_meta"])
    margins = scores[chosen] - scores[rejected]
    assert last["eval/examples"] == 7
    assert last["eval/loss"] == pytest.approx(float(-F.logsigmoid(margins).mean()), rel=1e-4)
    assert last["eval/rewards/margins"] == pytest.approx(float(margins.mean()), rel=1e-3, abs=1e-5)
    assert last["eval/rewards/accuracies"] == pytest.approx(float((margins > 0).float().mean()))
    assert float(margins.abs().max()) > 0
