"""Rows that waste nothing: best-fit packing fill, length grouping, PT rows where every token trains once."""

from __future__ import annotations

import random

import pytest

from toolkit.contracts import IGNORE_INDEX, Example, Sequence
from toolkit.data.packing import best_fit_decreasing, stream_rows
from toolkit.data.pipeline import Batches, load_examples
from toolkit.testing import write_jsonl


def long_tailed_lengths(count: int, seed: int = 0) -> list[int]:
    """Lengths like public instruction sets: log-normal, most 100-1500 tokens, a tail to 3500."""
    rng = random.Random(seed)
    return [max(50, min(3500, int(rng.lognormvariate(6.2, 0.8)))) for _ in range(count)]


def make_examples(lengths: list[int]) -> list[Example]:
    return [Example([Sequence(list(range(n)), [1] * (n - 1) + [IGNORE_INDEX])]) for n in lengths]


def next_fit(sizes: list[int], capacity: int) -> int:
    """Rows that packing in order (a new row whenever the next sample does not fit) needs: the old packer."""
    rows, used = 0, capacity
    for size in sizes:
        if used + size > capacity:
            rows, used = rows + 1, 0
        used += size
    return rows


def test_best_fit_decreasing_fills_rows_of_a_long_tailed_mix():
    lengths = long_tailed_lengths(3000)
    examples = make_examples(lengths)
    batches = Batches(examples, seed=1, seq_len=4096, packing=True, micro_batch_size=4, global_batch_size=4,
                      dp_rank=0, dp_world_size=1, pad_id=0)
    units = batches.units(0)
    assert sorted(i for u in units for i in u) == list(range(len(examples)))  # every example once
    assert all(sum(lengths[i] for i in u) <= 4096 for u in units)
    fill = sum(lengths) / (len(units) * 4096)
    in_order = sum(lengths) / (next_fit(lengths, 4096) * 4096)
    assert fill >= 0.95 and fill > in_order + 0.1, (fill, in_order)
    rows, measured = batches.epoch_fill(0)
    assert rows == batches.steps_per_epoch * 4 and measured >= 0.95


def test_best_fit_decreasing_is_never_worse_than_the_lower_bound_by_much():
    rng = random.Random(5)
    for _ in range(20):
        sizes = [rng.randint(1, 100) for _ in range(rng.randint(1, 200))]
        bins = best_fit_decreasing(sizes, list(range(len(sizes))), 100)
        assert sorted(i for b in bins for i in b) == list(range(len(sizes)))
        assert all(sum(sizes[i] for i in b) <= 100 for b in bins)
        lower = -(-sum(sizes) // 100)
        assert len(bins) <= 11 * lower / 9 + 1  # BFD's proven bound (Johnson 1973: 11/9 OPT + 6/9)


def test_packing_order_depends_on_the_seed_and_is_reproducible():
    examples = make_examples(long_tailed_lengths(500, seed=2))
    kwargs = dict(seq_len=4096, packing=True, micro_batch_size=2, global_batch_size=4, dp_rank=0, dp_world_size=1, pad_id=0)
    assert Batches(examples, seed=3, **kwargs).step_units(7) == Batches(examples, seed=3, **kwargs).step_units(7)
    assert Batches(examples, seed=3, **kwargs).units(0) != Batches(examples, seed=4, **kwargs).units(0)
    assert Batches(examples, seed=3, **kwargs).units(0) != Batches(examples, seed=3, **kwargs).units(1)


def test_length_grouping_pads_less_and_keeps_every_example_once():
    examples = make_examples(long_tailed_lengths(2048, seed=3))
    kwargs = dict(seed=0, seq_len=4096, packing=False, micro_batch_size=8, global_batch_size=16, dp_rank=0,
                  dp_world_size=1, pad_id=0)
    grouped, plain = Batches(examples, group_by_length=True, **kwargs), Batches(examples, group_by_length=False, **kwargs)
    taken = [i for step in range(grouped.steps_per_epoch) for u in grouped.step_units(step) for i in u]
    assert len(taken) == len(set(taken)) == grouped.steps_per_epoch * 16
    assert grouped.epoch_fill(0)[1] > 0.9 > plain.epoch_fill(0)[1]
    # batches of long and of short samples still come in a mixed order, not sorted
    longest = [max(len(examples[i].sequences[0].input_ids) for u in grouped.step_units(s) for i in u) for s in range(40)]
    assert longest != sorted(longest) and longest != sorted(longest, reverse=True)
    # DP ranks and accumulation split the same steps
    split = [Batches(examples, group_by_length=True, **{**kwargs, "micro_batch_size": 4, "dp_rank": r, "dp_world_size": 2})
             for r in range(2)]
    assert grouped.step_units(3) == split[0].step_units(3) == split[1].step_units(3)


DOCS = [{"text": "alpha beta gamma " * n} for n in (1, 40, 3, 90, 7, 2, 55)]


@pytest.mark.parametrize("isolate", [False, True])
def test_pt_rows_train_every_token_of_the_corpus_once(tokenizer, tmp_path, isolate):
    path = write_jsonl(tmp_path / "docs.jsonl", DOCS)
    documents = [tokenizer(d["text"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for d in DOCS]
    stream = [t for d in documents for t in d]
    ends = {sum(len(d) for d in documents[:k + 1]) - 1 for k in range(len(documents))}  # each document's EOS
    rows, stats = load_examples([path], tokenizer, seq_len=32, train_on="all", isolate_documents=isolate)
    assert stats.truncated == 0 and stats.documents == len(DOCS) and stats.tokens == len(stream)
    assert all(sum(len(s.input_ids) for s in r.sequences) == 32 for r in rows[:-1])  # full rows
    ids = [t for r in rows for s in r.sequences for t in s.input_ids]
    labels = [t for r in rows for s in r.sequences for t in s.labels]
    assert ids == stream
    # the label of position t is the next token of the corpus, except where a document ends (isolated) or the corpus does
    expected = [IGNORE_INDEX if t == len(stream) - 1 or (isolate and t in ends) else stream[t + 1] for t in range(len(stream))]
    assert labels == expected
    if isolate:  # no sequence crosses a document boundary
        starts = {0} | {e + 1 for e in ends}
        offset = 0
        for r in rows:
            for s in r.sequences:
                assert offset in starts or offset % 32 == 0
                assert not any(offset + k in starts for k in range(1, len(s.input_ids)))
                offset += len(s.input_ids)


def trained_labels(per_rank: list[Batches], steps: range) -> dict[tuple[int, int], int]:
    """(example, sequence) -> label tokens trained, summed over the steps' micro-batches of every DP rank (an
    example's sequences come in order, so the k-th sequence of example i seen is its sequence k mod their count)."""
    trained: dict[tuple[int, int], int] = {}
    seen: dict[int, int] = {}
    for step in steps:
        for batches in per_rank:
            for mb in batches.micro_batches(step):
                labelled = mb["labels"] != IGNORE_INDEX
                for s, example in enumerate(mb["sequence_meta"]["dataset_index"].tolist()):
                    key = (example, seen.get(example, 0) % len(batches.examples[example].sequences))
                    seen[example] = seen.get(example, 0) + 1
                    trained[key] = trained.get(key, 0) + int((labelled & (mb["sequence_ids"] == s)).sum())
    return trained


@pytest.mark.parametrize("isolate", [False, True])
def test_pt_rows_through_batches_train_every_token_once_per_epoch(tokenizer, tmp_path, isolate):
    """A corpus whose rows are not a multiple of the global batch, over 2 DP ranks with accumulation: the steps of
    one epoch train every label position of the corpus (none left after the last full global batch), the steps of
    two epochs each twice, and a fresh object (a resumed run) rebuilds any step alike."""
    path = write_jsonl(tmp_path / "docs.jsonl", DOCS)
    corpus = sum(len(tokenizer(d["text"], add_special_tokens=False)["input_ids"]) + 1 for d in DOCS)
    rows, _ = load_examples([path], tokenizer, seq_len=16, train_on="all", isolate_documents=isolate)
    kwargs = dict(seed=0, seq_len=16, packing=isolate, micro_batch_size=2, global_batch_size=8, dp_world_size=2, pad_id=0)
    per_rank = [Batches(rows, dp_rank=r, **kwargs) for r in range(2)]
    assert len(rows) % 8 and per_rank[0].steps_for(1) == -(-len(rows) // 8) == per_rank[0].steps_per_epoch
    one = trained_labels(per_rank, range(per_rank[0].steps_for(1)))
    labels = {(i, j): sum(1 for t in s.labels if t != IGNORE_INDEX) for i, e in enumerate(rows) for j, s in enumerate(e.sequences)}
    assert set(one) == set(labels)  # every row, every piece of a document
    # every token of the corpus is a label once (not the corpus' last; with isolation not a document's EOS either)
    assert sum(labels.values()) == corpus - (len(DOCS) if isolate else 1)
    assert all(one[k] >= labels[k] for k in labels)  # the last step's extra rows are the next epoch's first ones
    two = trained_labels(per_rank, range(per_rank[0].steps_for(2)))
    assert all(two[k] >= 2 * labels[k] for k in labels)
    resumed = Batches(rows, dp_rank=1, **kwargs)
    last = per_rank[0].steps_for(1) - 1
    assert resumed.step_units(last) == per_rank[1].step_units(last) and len(resumed.step_units(last)) == 8
    assert [b["input_ids"].tolist() for b in resumed.micro_batches(last)] == \
        [b["input_ids"].tolist() for b in per_rank[1].micro_batches(last)]


def test_stream_rows_name_where_each_row_begins():
    docs = [Example([Sequence([1, 2, 3], [2, 3, IGNORE_INDEX])], source=f"d.jsonl, line {k + 1}") for k in range(4)]
    rows = stream_rows(docs, seq_len=5, isolate_documents=True)
    assert [r.source.split(" and ")[0] for r in rows] == ["d.jsonl, line 1", "d.jsonl, line 2", "d.jsonl, line 4"]


@pytest.mark.parametrize("packing", [False, True])
@pytest.mark.parametrize("pad_multiple", [1, 64])
def test_the_reported_fill_is_what_the_collated_micro_batches_hold(packing, pad_multiple):
    """The start-up summary's fill (epoch_fill) against the tensors the engine gets: real tokens over their width."""
    examples = make_examples(long_tailed_lengths(300, seed=7))
    batches = Batches(examples, seed=2, seq_len=4096, packing=packing, micro_batch_size=2, global_batch_size=8, dp_rank=0,
                      dp_world_size=1, pad_id=0, pad_multiple=pad_multiple)
    real = capacity = rows = 0
    for step in range(batches.steps_per_epoch):
        for batch in batches.micro_batches(step):
            real += int((batch["sequence_ids"] >= 0).sum())
            capacity += batch["sequence_ids"].numel()
            rows += batch["sequence_ids"].shape[0]
    assert batches.epoch_fill(0) == (rows, pytest.approx(real / capacity, abs=1e-12))


@pytest.mark.parametrize("packing", [False, True])
def test_metrics_count_real_tokens_fill_and_trained_tokens_across_a_resume(tmp_path, packing):
    """metrics.jsonl against the micro-batches rebuilt outside the runner: tokens/s counts real tokens only (its
    ratio to trained tokens/s is the step's real/trained ratio), row_fill is real over padded width, and
    trained_tokens adds up every label trained so far, also after a resume."""
    import json

    from toolkit.models import resolve_model
    from toolkit.recipe import resolve_recipe
    from toolkit.train.runner import run_training

    def train(**values):
        recipe = resolve_recipe({"model": "tiny-llama", "dataset": ["demo"], "output": str(tmp_path / "run"), "seq_len": 128,
                                 "micro_batch_size": 2, "global_batch_size": 4, "max_steps": 6, "log_every": 1,
                                 "packing": packing, **values})
        run_dir = run_training(recipe)
        return recipe, [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]

    train(stop_after=3)
    recipe, metrics = train(resume="auto")
    assert [m["step"] for m in metrics] == list(range(1, 7))
    tokenizer = resolve_model("tiny-llama").tokenizer
    examples, _ = load_examples(["demo"], tokenizer, seq_len=128, packing=packing)
    batches = Batches(examples, seed=recipe.seed, seq_len=128, packing=packing, micro_batch_size=2, global_batch_size=4,
                      dp_rank=0, dp_world_size=1, pad_id=tokenizer.pad_token_id, group_by_length=recipe.group_by_length)
    trained_so_far = 0
    for step, line in enumerate(metrics):
        micro = batches.micro_batches(step)
        real = sum(int((mb["sequence_ids"] >= 0).sum()) for mb in micro)
        width = sum(mb["sequence_ids"].numel() for mb in micro)
        trained = sum(int((mb["labels"] != IGNORE_INDEX).sum()) for mb in micro)
        trained_so_far += trained
        assert line["row_fill"] == pytest.approx(real / width)
        assert line["tokens_per_s"] / line["trained_tokens_per_s"] == pytest.approx(real / trained, rel=1e-6)
        assert line["trained_tokens"] == trained_so_far
    assert any(line["row_fill"] < 1 for line in metrics) or packing  # padding exists and is not counted as real


@pytest.mark.parametrize(("command", "config", "says"), [
    ("sft", "data-mix-packing.yaml", "filled with real tokens"),
    ("pt", "pt-long-documents.yaml", "rows of --seq-len cut from 48 documents"),
])
def test_the_data_path_examples_run(cli_runner, tmp_path, command, config, says):
    from pathlib import Path

    example = Path(__file__).resolve().parents[1] / "examples" / config
    result = cli_runner.invoke(command, "--config", str(example), "--max-steps", "2", "--output", str(tmp_path / "run"))
    assert result.exit_code == 0, result.output
    assert says in result.stderr and "truncated" not in result.stderr


def test_a_pt_epoch_trains_its_last_partial_global_batch_and_resumes_across_it(tmp_path):
    """`toolkit pt --epochs 1` on a corpus whose rows are not a multiple of the global batch: the run takes
    ceil(rows / global batch) steps, its trained_tokens are those of every row (plus the next epoch's first rows
    that complete the last step), and a run stopped before that last step and resumed ends bit-identical."""
    import json

    import torch
    from safetensors.torch import load_file

    from toolkit.models import resolve_model
    from toolkit.recipe import resolve_recipe
    from toolkit.train.runner import run_training

    path = write_jsonl(tmp_path / "docs.jsonl", DOCS)
    tokenizer = resolve_model("tiny-llama").tokenizer
    rows, stats = load_examples([path], tokenizer, seq_len=64, train_on="all")
    assert len(rows) % 8

    def train(name, **values):
        recipe = resolve_recipe({"model": "tiny-llama", "loss": "pt", "dataset": [path], "output": str(tmp_path / name),
                                 "seq_len": 64, "micro_batch_size": 4, "global_batch_size": 8, "epochs": 1, "lr": 1e-3,
                                 "log_every": 1, **values})
        run_dir = run_training(recipe)
        newest = sorted((run_dir / "checkpoints").iterdir(), key=lambda p: int(p.name.split("-")[1]))[-1]
        metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        return metrics, load_file(str(newest / "model.safetensors"))

    metrics, straight = train("straight")
    steps = -(-len(rows) // 8)
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))
    batches = Batches(rows, seed=42, seq_len=64, packing=False, micro_batch_size=4, global_batch_size=8, dp_rank=0,
                      dp_world_size=1, pad_id=0)
    trained = trained_labels([batches], range(steps))
    assert {i for i, _ in trained} == set(range(len(rows)))
    assert metrics[-1]["trained_tokens"] == sum(trained.values()) > stats.trained_tokens
    train("resumed", stop_after=steps - 1)
    _, resumed = train("resumed", resume="auto")
    assert straight.keys() == resumed.keys() and all(torch.equal(straight[k], resumed[k]) for k in straight)
