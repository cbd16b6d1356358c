"""--streaming: windows of a stream, every record once per pass, and a resume that continues at the same row."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from toolkit.data.pipeline import DataStats, stream_encoder
from toolkit.data.streaming import StreamBatches
from toolkit.errors import ConfigError, DataError
from toolkit.models import resolve_model
from toolkit.recipe import resolve_recipe
from toolkit.train.runner import run_training

CHATS = [{"messages": [{"role": "user", "content": f"q {i}"}, {"role": "assistant", "content": "word " * (1 + i % 9)}]}
         for i in range(50)]


INSTRUCTIONS = [{"instruction": f"say {i}", "output": "yes " * (1 + i % 5)} for i in range(30)]


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in CHATS))
    return str(path)


@pytest.fixture
def other(tmp_path):
    """A second set in another format (alpaca) to mix with ``data``."""
    path = tmp_path / "instructions.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in INSTRUCTIONS))
    return str(path)


def make(data, packing=False, **kwargs):
    tokenizer = resolve_model("tiny-llama").tokenizer
    encode = stream_encoder(tokenizer, dataset_format="auto", columns=None, train_on="assistant", seq_len=64,
                            example_kinds=("lm",), options=None, packing=packing, isolate_documents=False, stats=DataStats())
    settings = dict(seed=1, seq_len=64, packing=packing, micro_batch_size=2, global_batch_size=4, dp_rank=0,
                    dp_world_size=1, pad_id=0, max_steps=40, window=16)
    return StreamBatches(data if isinstance(data, list) else [data], encode, **{**settings, **kwargs})


def sources(batches, step):
    return [s for s in batches.step_sources(step)]


def test_a_pass_takes_every_record_once_and_the_next_pass_reshuffles(data):
    batches = make(data)
    units = [s for step in range(25) for s in sources(batches, step)]  # 100 units: two passes of 50 records
    first, second = units[:50], units[50:]
    assert sorted(first) == sorted(second) == sorted(f"{data}, record {i}" for i in range(1, 51))
    assert first != second  # each pass its own seeded order
    assert batches.windows_per_pass == 4  # 16 + 16 + 16 + 2 records


def test_packed_stream_rows_hold_each_record_once_per_pass(data):
    batches = make(data, packing=True)
    rows = [list(unit) for step in range(3) for unit in batches.step_items(step)]
    records = [e.source for row in rows for e in row]
    assert len(records) == len(set(records))  # the first 12 packed rows of the first pass repeat nothing
    assert all(sum(len(s.input_ids) for e in row for s in e.sequences) <= 64 for row in rows)


@pytest.mark.parametrize("packing", [False, True])
def test_a_restored_stream_continues_at_the_same_rows(data, packing):
    straight = make(data, packing=packing)
    expected = [straight.micro_batches(step) for step in range(20)]
    state = json.loads(json.dumps(straight.state()))  # through a checkpoint's JSON
    resumed = make(data, packing=packing)
    resumed.restore(state)
    for step in (13, 14, 19):
        for a, b in zip(expected[step], resumed.micro_batches(step)):
            assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["labels"], b["labels"])
    assert len(resumed._held) <= 2  # only the windows in use are held


def test_a_streamed_mix_has_the_in_memory_mixes_proportions_and_restarts_used_up_sets(data, other):
    from toolkit.data.pipeline import load_examples

    tokenizer = resolve_model("tiny-llama").tokenizer
    whole, _ = load_examples([data, other], tokenizer, seq_len=64, ratios=[0.75, 0.25], seed=1)
    in_memory = sum(e.source.startswith(other) for e in whole) / len(whole)
    batches = make([data, other], ratios=[0.75, 0.25])
    units = [s for step in range(50) for s in sources(batches, step)]  # 200 records drawn, 16 a window
    streamed = sum(s.startswith(other) for s in units) / len(units)
    assert in_memory == 0.25 and streamed == pytest.approx(in_memory, abs=0.06)
    # both sets were used up and restarted (50 + 30 records, 200 drawn): every record of each seen, some again
    assert {s for s in units if s.startswith(other)} == {f"{other}, record {i}" for i in range(1, 31)}
    assert {s for s in units if s.startswith(data)} == {f"{data}, record {i}" for i in range(1, 51)}
    assert batches.dataset_lengths == {0: 50, 1: 30}
    assert sources(make([data, other], ratios=[0.75, 0.25], seed=2), 0) != sources(batches, 0)


@pytest.mark.parametrize("packing", [False, True])
def test_a_mix_resumed_after_k_steps_continues_with_the_uninterrupted_rows(data, other, packing):
    uninterrupted = make([data, other], packing=packing, ratios=[0.5, 0.5])
    expected = [uninterrupted.micro_batches(step) for step in range(36)]
    for k, lengths in ((3, {}), (27, {"0": 50, "1": 30})):  # stopped before any set was used up, and after both were
        first = make([data, other], packing=packing, ratios=[0.5, 0.5])
        for step in range(k):  # the stopped run: k steps, then its checkpoint
            first.micro_batches(step)
        state = json.loads(json.dumps(first.state()))
        assert state["stream_dataset_lengths"] == lengths
        resumed = make([data, other], packing=packing, ratios=[0.5, 0.5])
        resumed.restore(state)
        for step in range(k, k + 9):
            for a, b in zip(expected[step], resumed.micro_batches(step), strict=True):
                assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["labels"], b["labels"])


def test_mixed_streams_check_their_ratios(data, other):
    with pytest.raises(ConfigError, match="gives 1 ratios for 2 datasets"):
        make([data, other], ratios=[1.0])
    with pytest.raises(ConfigError, match="ratios must be 0 or more"):
        make([data, other], ratios=[0.0, 0.0])


def test_streaming_needs_max_steps():
    with pytest.raises(ConfigError, match="give --max-steps"):
        resolve_recipe({"dataset": ["demo"], "streaming": True})


@pytest.mark.parametrize("mode", [{"packing": False}, {"packing": True}, {"loss": "pt", "isolate_documents": True, "seq_len": 32},
                                  {"packing": True, "dataset_ratios": [0.6, 0.4]}],
                         ids=["padded", "packed", "pt-rows", "mixed"])
def test_a_streamed_run_resumed_mid_pass_ends_bit_identical(tmp_path, data, other, monkeypatch, mode):
    monkeypatch.setattr("toolkit.data.streaming.STREAM_WINDOW", 16)
    sets = [data, other] if "dataset_ratios" in mode else [data]

    def train(name, **values):
        recipe = resolve_recipe({"model": "tiny-llama", "dataset": sets, "output": str(tmp_path / name), "lr": 1e-3,
                                 "seq_len": 64, "streaming": True, "max_steps": 10, "micro_batch_size": 2, **mode, **values})
        return run_training(recipe)

    def weights(run_dir):
        newest = sorted((run_dir / "checkpoints").iterdir(), key=lambda p: int(p.name.split("-")[1]))[-1]
        return load_file(str(newest / "model.safetensors"))

    straight = train("straight")
    train("resumed", stop_after=7)
    resumed = train("resumed", resume="auto")
    a, b = weights(straight), weights(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("train_on", ["assistant", "all"])
def test_the_start_up_summary_gives_the_first_windows_tokens(tmp_path, data, monkeypatch, capsys, train_on):
    from toolkit.data.pipeline import load_examples

    monkeypatch.setattr("toolkit.data.streaming.STREAM_WINDOW", 16)
    recipe = resolve_recipe({"model": "tiny-llama", "dataset": [data], "output": str(tmp_path / "run"), "seq_len": 64,
                             "streaming": True, "max_steps": 1, "micro_batch_size": 2,
                             "loss": {"assistant": "sft", "all": "pt"}[train_on]})
    run_training(recipe)
    err = capsys.readouterr().err
    # the same 16 records read whole, without --streaming: the figures the summary must give for the first window
    _, first = load_examples([data], resolve_model("tiny-llama").tokenizer, seq_len=64, max_samples=16, train_on=train_on)
    assert "streaming in windows of 16 records; the first window: " in err
    assert "from 16 records" in err and f"{first.trained_tokens} trained tokens" in err and first.trained_tokens > 0
    if train_on == "all":
        assert f"({first.tokens} tokens, each trained once per pass)" in err


def test_a_csv_stream_keeps_every_cell_the_text_it_holds(tmp_path):
    from toolkit.data.reading import read_records, stream_records

    path = tmp_path / "t.csv"
    path.write_text('instruction,input,output\n"two\nlines",,0.10\nNA,x,null\nsay,1e3,007\n')
    streamed = [record for _, record in stream_records([str(path)])]
    whole = [{k: v for k, v in r.items() if k != "__line__"} for r in read_records(str(path))[1]]
    assert streamed == whole == [{"instruction": "two\nlines", "input": "", "output": "0.10"},
                                 {"instruction": "NA", "input": "x", "output": "null"},
                                 {"instruction": "say", "input": "1e3", "output": "007"}]


def test_save_to_disk_directories_stream_in_order_and_resume_at_their_row(tmp_path, data):
    import datasets

    from toolkit.data.reading import stream_records

    first, second = CHATS[:30], CHATS[30:]
    datasets.Dataset.from_list(first).save_to_disk(str(tmp_path / "a"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(second)}).save_to_disk(str(tmp_path / "b"))
    dirs = [str(tmp_path / "a"), str(tmp_path / "b")]
    streamed = list(stream_records(dirs))
    assert [record for _, record in streamed] == CHATS
    assert streamed[0][0] == f"{tmp_path / 'a'}, row 1" and streamed[30][0] == f"{tmp_path / 'b'}, row 1"
    assert list(stream_records(dirs, skip=33)) == streamed[33:]
    assert list(stream_records(dirs, skip=50)) == []
    # the same rows as the JSONL stream of the same records, window after window
    from_dirs, from_file = make(dirs, packing=True), make(data, packing=True)
    for step in (0, 7, 12):
        for a, b in zip(from_dirs.micro_batches(step), from_file.micro_batches(step)):
            assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["labels"], b["labels"])
    with pytest.raises(DataError, match="or save_to_disk directories"):
        list(stream_records([dirs[0], data]))
