"""Evaluation during training: eval loss against an independent transformers forward, the seeded split,
--save-best, early stopping (and its patience across a resume), 2 DDP or FSDP ranks against 1."""

from __future__ import annotations

import json
import math

import pytest
import torch

from toolkit.errors import ConfigError
from toolkit.recipe import resolve_recipe
from toolkit.testing import write_jsonl

EVAL_RECORDS = [{"instruction": f"Name the colour number {i}.", "output": f"Colour {i} is {c}."}
                for i, c in enumerate(["red", "green", "blue", "amber", "violet"])]


def train(tmp_path, name, **values):
    from toolkit.train.runner import run_training

    recipe = {"model": "tiny-llama", "dataset": ["demo"], "seq_len": 64, "max_steps": 4, "lr": 1e-3,
              "output": str(tmp_path / name), **values}
    return run_training(resolve_recipe(recipe))


def metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def evals(run_dir, key="eval/loss"):
    return [(m["step"], m[key]) for m in metrics(run_dir) if key in m]


def hf_mean_nll(model_dir, dataset):
    """Token-mean cross-entropy of ``dataset`` under the model in ``model_dir``, by transformers' own loss."""
    from transformers import AutoModelForCausalLM

    from toolkit.data.pipeline import load_examples
    from toolkit.models import resolve_model

    examples, _ = load_examples([dataset], resolve_model("tiny-llama").tokenizer, seq_len=64)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    total = tokens = 0.0
    with torch.no_grad():
        for example in examples:
            seq = example.sequences[0]
            count = sum(1 for label in seq.labels if label != -100)
            # transformers shifts labels itself: its labels[t + 1] is our (already shifted) labels[t]
            labels = torch.tensor([[-100, *seq.labels[:-1]]])
            out = model(torch.tensor([seq.input_ids]), labels=labels)
            total, tokens = total + float(out.loss) * count, tokens + count
    return total / tokens


def test_eval_loss_equals_transformers_on_the_same_rows_in_eval_mode(tmp_path):
    dataset = write_jsonl(tmp_path / "eval.jsonl", EVAL_RECORDS)
    run = train(tmp_path, "run", eval_dataset=[dataset], eval_every=2, export="hf")
    logged = dict(evals(run))
    assert sorted(logged) == [2, 4]
    assert logged[4] == pytest.approx(hf_mean_nll(run / "export", dataset), rel=1e-5)
    last = metrics(run)[-1]
    assert last["eval/perplexity"] == pytest.approx(math.exp(last["eval/loss"]), rel=1e-9)
    assert last["eval/examples"] == len(EVAL_RECORDS) and last["loss"] > 0  # beside the training metrics


def test_eval_split_is_seeded_disjoint_and_sized():
    from toolkit.contracts import Example, Sequence
    from toolkit.train.evaluation import split_held_out

    examples = [Example([Sequence([i], [-100])]) for i in range(40)]
    recipe = resolve_recipe({"eval_split": 0.1, "seed": 3})
    train_set, held = split_held_out(examples, recipe)
    assert len(held) == 4 and len(train_set) == 36
    assert {id(e) for e in held}.isdisjoint(id(e) for e in train_set)
    assert [e.sequences[0].input_ids for e in split_held_out(examples, recipe)[1]] == [e.sequences[0].input_ids for e in held]
    other = split_held_out(examples, resolve_recipe({"eval_split": 0.1, "seed": 4}))[1]
    assert [e.sequences[0].input_ids for e in other] != [e.sequences[0].input_ids for e in held]
    with pytest.raises(ConfigError, match="--eval-split 0.99 holds out every example"):
        split_held_out(examples[:1] * 2, resolve_recipe({"eval_split": 0.99}))


def test_flags_that_need_evaluation_data_are_refused_before_anything_loads():
    with pytest.raises(ConfigError) as error:
        resolve_recipe({"save_best": "eval/loss", "early_stopping_patience": 2, "eval_split": 1.5})
    text = str(error.value)
    assert "eval_split must be a fraction in [0, 1)" in text and "--early-stopping-patience counts evaluations" in text
    with pytest.raises(ConfigError, match="--save-best needs evaluation data"):
        resolve_recipe({"save_best": "eval/loss"})
    with pytest.raises(ConfigError, match="name an eval metric"):
        resolve_recipe({"save_best": "loss", "eval_split": 0.1})


def expected_stop(values, patience, threshold):
    """Where early stopping must stop, replayed from the logged eval losses of a run that did not stop."""
    best, bad = math.inf, 0
    for step, value in values:
        if value < best - threshold:
            best, bad = value, 0
        else:
            bad += 1
            if bad >= patience:
                return step
    return values[-1][0]


def test_early_stopping_stops_at_the_step_the_patience_says(tmp_path, capsys):
    common = {"eval_split": 0.1, "eval_every": 1, "max_steps": 10, "lr": 3e-3}
    free = train(tmp_path, "free", **common)
    want = expected_stop(evals(free), patience=2, threshold=0.3)
    assert want < 10, evals(free)  # the tiny model improves by less than 0.3 twice in a row before step 10
    stopped = train(tmp_path, "stopped", **common, early_stopping_patience=2, early_stopping_threshold=0.3)
    assert metrics(stopped)[-1]["step"] == want
    assert [v for _, v in evals(stopped)] == pytest.approx([v for _, v in evals(free)[:want]])
    assert f"early stopping at step {want}: eval/loss has not improved by more than 0.3" in capsys.readouterr().err
    assert (stopped / f"checkpoints/step-{want}").is_dir()


def test_resume_keeps_the_patience_count_and_stays_bit_identical(tmp_path):
    from safetensors.torch import load_file

    from toolkit.errors import RunStopped
    from toolkit.train.checkpoint import read_state
    from toolkit.train.runner import run_training

    # a threshold no step can beat: every evaluation after the first counts against the patience
    values = {"model": "tiny-llama", "dataset": ["demo"], "seq_len": 64, "max_steps": 20, "lr": 1e-3, "eval_split": 0.05,
              "eval_every": 1, "early_stopping_patience": 3, "early_stopping_threshold": 1e9, "save_best": "eval/loss"}
    straight = run_training(resolve_recipe({**values, "output": str(tmp_path / "straight")}))
    with pytest.raises(RunStopped):
        run_training(resolve_recipe({**values, "output": str(tmp_path / "run"), "stop_after": 2}), raise_if_stopped=True)
    assert read_state(tmp_path / "run/checkpoints/step-2")["best"]["bad_evals"] == 1
    run = run_training(resolve_recipe({**values, "output": str(tmp_path / "run"), "resume": "auto"}))
    # evaluations at 1 (best), 2, 3, 4: the third without improvement ends the run at 4 (not 6, had it restarted)
    assert metrics(run)[-1]["step"] == metrics(straight)[-1]["step"] == 4
    assert evals(run) == evals(straight)  # evaluating changes nothing a resume depends on
    a, b = (load_file(str(r / "checkpoints/step-4/model.safetensors")) for r in (straight, run))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((run / "best.json").read_text())["step"] == 1  # kept from before the resume


def test_save_best_keeps_the_best_checkpoint_past_keep_last(tmp_path):
    run = train(tmp_path, "run", eval_split=0.1, eval_every=1, max_steps=6, lr=2e-2, save_best="eval/loss", keep_last=1)
    logged = evals(run)
    step, value = min(logged, key=lambda sv: sv[1])
    best = json.loads((run / "best.json").read_text())
    assert best["step"] == step and best["value"] == pytest.approx(value) and best["mode"] == "min"
    kept = sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("step-"))
    assert kept == sorted({f"step-{step}", "step-6"})


def test_eval_pads_ranks_to_equal_forwards_and_zeroes_the_copies():
    from toolkit.contracts import Example, Sequence
    from toolkit.train.evaluation import PAD_KEY, EvalSet

    examples = [Example([Sequence(list(range(n)), [*range(1, n), -100])]) for n in (3, 4, 5)]
    sets = [EvalSet(examples, micro_batch_size=1, dp_rank=r, dp_world_size=2, pad_id=0, seq_len=8) for r in (0, 1)]
    batches = [[mb for chunk in s.chunks() for mb in chunk] for s in sets]
    assert [len(b) for b in batches] == [2, 2]
    pads = [float(mb["sequence_meta"].get(PAD_KEY, torch.zeros(1)).max()) for b in batches for mb in b]
    assert sorted(pads) == [0.0, 0.0, 0.0, 1.0]
    assert sets[0].context.examples == 3 and sets[0].context.label_tokens == 2 + 3 + 4


def test_pipeline_stages_get_micro_batches_of_one_shape_and_virtual_stages_multiples_of_pp():
    from toolkit.contracts import Example, Sequence
    from toolkit.train.evaluation import PAD_KEY, EvalSet

    examples = [Example([Sequence(list(range(n)), [*range(1, n), -100])]) for n in (3, 4, 5, 6, 7)]
    for virtual, per_rank in ((1, 3), (2, 4)):  # 5 examples over 2 data-parallel ranks; pp 2
        sets = [EvalSet(examples, micro_batch_size=2, dp_rank=r, dp_world_size=2, pad_id=0, seq_len=8,
                        pipeline_stages=2, virtual_stages=virtual) for r in (0, 1)]
        for eval_set in sets:
            calls = list(eval_set.chunks())
            batches = [mb for chunk in calls for mb in chunk]
            assert len(batches) == per_rank and all(mb["input_ids"].shape[0] == 1 for mb in batches)
            assert virtual == 1 or all(len(chunk) % 2 == 0 for chunk in calls)
        real = [mb for s in sets for chunk in s.chunks() for mb in chunk if PAD_KEY not in mb["sequence_meta"]]
        assert len(real) == 5  # every example once, the rest zeroed copies


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["local", "fsdp"])
def test_two_ranks_evaluate_like_one(tmp_path, run_distributed, strategy):
    dataset = write_jsonl(tmp_path / "eval.jsonl", EVAL_RECORDS)  # 5 examples: one rank runs a padding copy
    flags = ["--model", "tiny-llama", "--dataset", "demo", "--seq-len", "64", "--max-steps", "2", "--lr", "1e-3",
             "--global-batch-size", "4", "--eval-dataset", dataset, "--eval-every", "1", "--strategy", strategy]
    train(tmp_path, "one", max_steps=2, global_batch_size=4, eval_dataset=[dataset], eval_every=1)
    run_distributed(["-m", "toolkit", "sft", *flags, "--output", str(tmp_path / "two")], nproc=2)
    one, two = metrics(tmp_path / "one"), metrics(tmp_path / "two")
    for a, b in zip(one, two, strict=True):
        for key in ("loss", "eval/loss", "eval/perplexity", "eval/examples"):
            assert a[key] == pytest.approx(b[key], rel=1e-5), key

