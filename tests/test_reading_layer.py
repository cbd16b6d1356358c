"""The reading layer on Hugging Face datasets: save_to_disk directories, Arrow's nulls, the tokenized cache, mixing."""

from __future__ import annotations

import pytest

from toolkit.data import cache
from toolkit.data.pipeline import load_examples
from toolkit.data.reading import read_records
from toolkit.errors import ConfigError, DataError
from toolkit.testing import write_jsonl

CHATS = [{"messages": [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"answer {i} " * (i % 5 + 1)}]}
         for i in range(12)]



@pytest.fixture
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TOOLKIT_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"



def token_ids(examples):
    return [[s.input_ids for s in e.sequences] for e in examples]


def test_a_save_to_disk_directory_reads_like_its_jsonl(tokenizer, tmp_path):
    import datasets

    datasets.Dataset.from_list(CHATS).save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(CHATS)}).save_to_disk(str(tmp_path / "dict"))
    from_file, _ = load_examples([write_jsonl(tmp_path / "c.jsonl", CHATS)], tokenizer)
    for directory in ("saved", "dict"):
        from_disk, _ = load_examples([str(tmp_path / directory)], tokenizer)
        assert token_ids(from_disk) == token_ids(from_file)
    datasets.DatasetDict({"validation": datasets.Dataset.from_list(CHATS)}).save_to_disk(str(tmp_path / "nosplit"))
    with pytest.raises(DataError, match="splits validation and no 'train'"):
        read_records(str(tmp_path / "nosplit"))
    (tmp_path / "plain").mkdir()
    with pytest.raises(DataError, match="not one written by datasets' save_to_disk"):
        read_records(str(tmp_path / "plain"))


def test_keys_a_record_lacked_do_not_appear_as_nulls(tmp_path):
    records = [{"messages": [{"role": "user", "content": "hi", "name": "ann"}, {"role": "assistant", "content": "yo"}]},
               {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}], "extra": 1},
               {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}]
    _, read = read_records(write_jsonl(tmp_path / "m.jsonl", records))
    assert [{k: v for k, v in r.items() if k != "__line__"} for r in read] == records
    assert [r["__line__"] for r in read] == [1, 2, 3]


def test_line_numbers_survive_blank_lines_and_csv_cells_stay_text(tmp_path):
    path = tmp_path / "gaps.jsonl"
    path.write_text('{"text": "a"}\n\n{"text": "b"}\n')
    assert [r["__line__"] for r in read_records(str(path))[1]] == [1, 3]
    csv = tmp_path / "t.csv"
    csv.write_text('instruction,output\n"two\nlines",0.10\n\nNA,null\n')
    rows = read_records(str(csv))[1]
    assert [(r["instruction"], r["output"], r["__line__"]) for r in rows] == [("two\nlines", "0.10", 3), ("NA", "null", 5)]


def test_the_tokenized_cache_serves_the_second_run(tokenizer, tmp_path, own_cache, monkeypatch):
    path = write_jsonl(tmp_path / "c.jsonl", CHATS)
    first, stats = load_examples([path], tokenizer, seq_len=64)
    assert list((own_cache / "tokenized").iterdir())

    def no_reading(*args, **kwargs):
        raise AssertionError("the file was read again")

    monkeypatch.setattr("toolkit.data.pipeline.read_records", no_reading)
    second, again = load_examples([path], tokenizer, seq_len=64)
    assert token_ids(second) == token_ids(first) and [e.source for e in second] == [e.source for e in first]
    assert [[s.labels for s in e.sequences] for e in second] == [[s.labels for s in e.sequences] for e in first]
    assert again.records == stats.records
    shorter, _ = load_examples([path], tokenizer, seq_len=16)  # truncation comes after the cache
    assert all(len(e.sequences[0].input_ids) <= 16 for e in shorter)
    with pytest.raises(AssertionError, match="read again"):  # what trains changes the encoding: a new entry
        load_examples([path], tokenizer, seq_len=64, train_on="all")


def test_a_changed_file_or_a_damaged_entry_is_encoded_again(tokenizer, tmp_path, own_cache, capsys):
    path = tmp_path / "c.jsonl"
    write_jsonl(path, CHATS)
    load_examples([str(path)], tokenizer)
    write_jsonl(path, CHATS[:5])
    assert len(load_examples([str(path)], tokenizer)[0]) == 5
    for entry in (own_cache / "tokenized").iterdir():
        for arrow in entry.glob("examples/*.arrow"):
            arrow.write_bytes(b"broken")
    assert len(load_examples([str(path)], tokenizer)[0]) == 5
    assert "ignoring the damaged tokenized cache entry" in capsys.readouterr().err


def test_mixing_follows_the_ratios_and_the_seed(tokenizer, tmp_path):
    small = write_jsonl(tmp_path / "small.jsonl", CHATS[:4])
    large = write_jsonl(tmp_path / "large.jsonl", CHATS * 3)
    mixed, _ = load_examples([small, large], tokenizer, ratios=[1.0, 1.0], seed=3)
    origin = [e.source.split(",")[0].rsplit("/", 1)[-1] for e in mixed]
    assert len(mixed) == 40 and origin.count("small.jsonl") == 20 and origin.count("large.jsonl") == 20
    assert [e.source for e in load_examples([small, large], tokenizer, ratios=[1.0, 1.0], seed=3)[0]] == [e.source for e in mixed]
    assert [e.source for e in load_examples([small, large], tokenizer, ratios=[1.0, 1.0], seed=4)[0]] != [e.source for e in mixed]
    only_large, _ = load_examples([small, large], tokenizer, ratios=[0.0, 1.0])
    assert all("large" in e.source for e in only_large) and len(only_large) == 40
    with pytest.raises(ConfigError, match="2 ratios for 1 datasets"):
        load_examples([small], tokenizer, ratios=[1.0, 2.0])


def test_cache_keys_follow_the_tokenizer(tokenizer, tmp_path):
    import copy

    path = tmp_path / "c.jsonl"
    write_jsonl(path, CHATS)
    other = copy.deepcopy(tokenizer)
    other.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    encoding = {"dataset_format": "auto"}
    assert cache.entry_key(path, encoding, tokenizer) != cache.entry_key(path, encoding, other)
    assert cache.entry_key(path, encoding, tokenizer) == cache.entry_key(path, dict(encoding), copy.deepcopy(tokenizer))


def test_json_parquet_and_csv_files_read_through_datasets_like_their_jsonl(tokenizer, tmp_path, monkeypatch):
    import json

    import datasets

    alpaca = [{"instruction": f"say {i}", "input": "" if i % 2 else f"x{i}", "output": f"said {i} " * (i % 3 + 1)}
              for i in range(9)]
    files = {"chats": write_jsonl(tmp_path / "chats.jsonl", CHATS), "alpaca": write_jsonl(tmp_path / "alpaca.jsonl", alpaca)}
    (tmp_path / "chats.json").write_text(json.dumps(CHATS))
    datasets.Dataset.from_list(CHATS).to_parquet(str(tmp_path / "chats.parquet"))
    datasets.Dataset.from_list(alpaca).to_csv(str(tmp_path / "alpaca.csv"), index=False)
    expected = {kind: token_ids(load_examples([path], tokenizer)[0]) for kind, path in files.items()}

    def no_hand_reading(*args, **kwargs):
        raise AssertionError("read by the line readers, not datasets")

    monkeypatch.setattr("toolkit.data.reading._read_by_hand", no_hand_reading)
    for name, kind in (("chats.json", "chats"), ("chats.parquet", "chats"), ("alpaca.csv", "alpaca")):
        examples, stats = load_examples([str(tmp_path / name)], tokenizer)
        assert token_ids(examples) == expected[kind] and stats.records == len(expected[kind]), name
    assert [r["__line__"] for r in read_records(str(tmp_path / "alpaca.csv"))[1]][:3] == [2, 3, 4]  # the header is line 1


@pytest.mark.parametrize("content", ["robot", 5], ids=["through-datasets", "by-hand"])  # 5: Arrow cannot unify the types
def test_a_bad_record_of_a_json_array_is_named_by_its_line(tokenizer, tmp_path, content):
    import json

    bad = ({"role": "robot", "content": "a"} if content == "robot" else {"role": "assistant", "content": content})
    records = CHATS[:2] + [{"messages": [{"role": "user", "content": "q"}, bad]}]
    path = tmp_path / "pretty.json"
    path.write_text(json.dumps(records, indent=2))
    starts = [n for n, line in enumerate(path.read_text().splitlines(), start=1) if line == "  {"]
    assert [r["__line__"] for r in read_records(str(path))[1]] == starts
    with pytest.raises(DataError, match=f"pretty.json, line {starts[2]}: message 1"):
        load_examples([str(path)], tokenizer)
    path.write_text(json.dumps(records))  # one line: records are told apart by their number
    assert [r["__line__"] for r in read_records(str(path))[1]] == [1, 2, 3]


def test_a_bad_parquet_record_is_named_by_its_row(tokenizer, tmp_path):
    import datasets

    records = CHATS[:2] + [{"messages": [{"role": "user", "content": "q"}, {"role": "robot", "content": "a"}]}]
    datasets.Dataset.from_list(records).to_parquet(str(tmp_path / "t.parquet"))
    with pytest.raises(DataError, match="t.parquet, row 3: message 1"):
        load_examples([str(tmp_path / "t.parquet")], tokenizer)
