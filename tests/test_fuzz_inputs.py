"""Property-based tests (hypothesis) over dataset records and recipes: bad input always gets a clear
ToolkitError naming the file/line or key, or a correct result in which every record is either an
example or counted as dropped; never a crash with a traceback.

``TOOLKIT_FUZZ_EXAMPLES`` sets the inputs per test (CI default below; docs/reliability.md records a long run).
"""

from __future__ import annotations

import csv
import json
import os
import re
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, reject, settings
from hypothesis import strategies as st

from toolkit.errors import ConfigError, ToolkitError

EXAMPLES = int(os.environ.get("TOOLKIT_FUZZ_EXAMPLES", "40"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=not os.environ.get("TOOLKIT_FUZZ_RANDOM"),
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example])
TRIED: dict[str, dict[str, int]] = {}


def tally(test: str, outcome: str) -> None:
    TRIED.setdefault(test, {}).setdefault(outcome, 0)
    TRIED[test][outcome] += 1


@pytest.fixture(scope="module", autouse=True)
def report_counts():
    yield
    if os.environ.get("TOOLKIT_FUZZ_REPORT"):
        with open(os.environ["TOOLKIT_FUZZ_REPORT"], "a") as handle:
            handle.write(json.dumps(TRIED) + "\n")


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from toolkit.models import TOKENIZER_DIR

    return AutoTokenizer.from_pretrained(TOKENIZER_DIR)


# ----------------------------------------------------------------------------- record strategies

surrogates = st.text(alphabet=st.characters(categories=["Cs"]), min_size=1, max_size=3)
huge = st.builds(lambda piece, n: piece * n, st.text(min_size=1, max_size=8), st.integers(2_000, 40_000))
special = st.sampled_from(["<|im_end|>", "<|im_start|>assistant", "\x00", "{{ x }}", "{% if %}", "\ufeff", "\r\n", "ａｂｃ", "🙂" * 3])
good_text = st.one_of(st.text(min_size=1, max_size=30), st.text(alphabet=st.characters(codec="utf-8"), min_size=1, max_size=30),
                      huge, special)
clean_texts = st.one_of(good_text, good_text, good_text, st.sampled_from(["", "   "]))
texts = st.one_of(clean_texts, clean_texts, clean_texts, surrogates)
junk = st.one_of(st.none(), st.integers(-10**20, 10**20), st.floats(), st.booleans(), st.lists(st.integers(), max_size=3),
                 st.dictionaries(st.text(max_size=5), st.integers(), max_size=2))
values = st.one_of(texts, texts, texts, junk)
good_roles = st.sampled_from(["system", "user", "assistant", "tool"])
roles = st.one_of(good_roles, good_roles, good_roles, st.sampled_from(["bot", "", "ASSISTANT"]), junk)
message = st.one_of(*[st.fixed_dictionaries({"role": roles, "content": values})] * 4, st.fixed_dictionaries({"role": roles}), junk)
clean_message = st.fixed_dictionaries({"role": good_roles, "content": clean_texts})
turn = st.one_of(*[st.fixed_dictionaries({"from": st.one_of(st.sampled_from(["human", "gpt", "system", "GPT", "robot"]), junk),
                                          "value": values})] * 4, junk)
clean_turn = st.fixed_dictionaries({"from": st.sampled_from(["human", "gpt", "system", "user", "assistant"]), "value": clean_texts})


def maybe_missing(required: dict, optional: dict | None = None):
    """Records with the format's keys, sometimes missing one, sometimes with extra keys."""
    full = st.fixed_dictionaries(required, optional=optional or {"extra": values})
    return st.one_of(full, full, full, full.flatmap(lambda d: st.sampled_from(sorted(d) or [None]).map(
        lambda k: {key: v for key, v in d.items() if key != k})))


records = {
    "alpaca": maybe_missing({"instruction": values, "output": values}, {"input": values}),
    "messages": maybe_missing({"messages": st.one_of(st.lists(message, max_size=4), junk)}),
    "sharegpt": maybe_missing({"conversations": st.one_of(st.lists(turn, max_size=4), junk)}),
    "text": maybe_missing({"text": values}),
}
clean = {  # well-shaped records with any text: what must be accepted unless a value is empty or unusable
    "alpaca": st.fixed_dictionaries({"instruction": clean_texts, "output": clean_texts}, optional={"input": clean_texts}),
    "messages": st.fixed_dictionaries({"messages": st.lists(clean_message, min_size=1, max_size=4).map(
        lambda m: m + [{"role": "assistant", "content": "ok"}])}),
    "sharegpt": st.fixed_dictionaries({"conversations": st.lists(clean_turn, min_size=1, max_size=4).map(
        lambda m: m + [{"from": "gpt", "value": "ok"}])}),
    "text": st.fixed_dictionaries({"text": clean_texts}),
}
any_record = st.one_of(*records.values(), st.dictionaries(st.text(max_size=6), values, max_size=3))
FORMATS = ["alpaca", "messages", "sharegpt", "text"]


def dataset(min_size: int = 0, max_size: int = 6):
    """(format the records mostly follow, records): mostly clean records of one format, some broken or of another."""
    return st.sampled_from(FORMATS).flatmap(lambda fmt: st.tuples(st.just(fmt), st.lists(
        st.one_of(*[clean[fmt]] * 8, records[fmt], any_record), min_size=min_size, max_size=max_size)))


# ----------------------------------------------------------------------------- writers

def _jsonable(value):
    return value if isinstance(value, (str, type(None))) else json.dumps(value)


def write(records_: list[dict], kind: str, directory: Path) -> Path:
    path = directory / f"data.{kind}"
    if kind == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in records_))
    elif kind == "json":
        path.write_text(json.dumps(records_))
    elif kind == "csv":
        columns = sorted({k for r in records_ for k in r})
        with path.open("w", newline="", encoding="utf-8", errors="surrogatepass") as handle:
            writer = csv.DictWriter(handle, fieldnames=columns, restval="")
            writer.writeheader()
            for record in records_:
                writer.writerow({k: _jsonable(v) for k, v in record.items()})
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            table = pa.Table.from_pylist(records_)
        except (pa.ArrowException, OverflowError, TypeError, ValueError):  # mixed types in a column: store JSON text
            try:
                table = pa.Table.from_pylist([{k: _jsonable(v) for k, v in r.items()} for r in records_])
            except (pa.ArrowException, UnicodeError):  # e.g. a lone surrogate: not writable as Parquet at all
                reject()
        try:
            pq.write_table(table, path)
        except pa.ArrowException:  # e.g. an empty struct: Parquet cannot store it
            reject()
    return path


def with_ids(records_: list[dict]) -> list[dict]:
    """An ``id`` column makes every CSV row non-blank (a blank line is no row to a CSV reader)."""
    return [{"id": index, **record} for index, record in enumerate(records_)]


def check_pipeline(path: Path, count: int, dataset_format: str, tokenizer, test: str, last_line: int | None = None) -> None:
    """The property: a ToolkitError naming the file (and a line of it), or every record accounted for."""
    if last_line is None:  # a CSV record's line is its physical line (header first, cells may span lines)
        raw = path.read_bytes()
        last_line = raw.count(b"\n") + raw.count(b"\r") + 1 if path.suffix == ".csv" else count
    from toolkit.data.pipeline import load_examples

    try:
        examples, stats = load_examples([str(path)], tokenizer, dataset_format=dataset_format, seq_len=64)
    except ToolkitError as exc:
        message = str(exc)
        assert str(path) in message, message
        line = re.search(r", (?:line|row) (\d+)", message)
        assert line is None or 1 <= int(line.group(1)) <= max(last_line, 1), message
        tally(test, "clear error")
        tally(test + ": errors", re.sub(r"\d+", "N", message.replace(str(path), "FILE"))[:90])
        return
    assert stats.records == count, (stats.records, count)
    assert len(examples) == stats.examples and stats.examples + stats.dropped_no_labels == stats.records
    lines = [int(re.search(r", (?:line|row) (\d+)$", e.source).group(1)) for e in examples]
    assert len(set(lines)) == len(lines) and all(1 <= n <= last_line for n in lines)
    for example in examples:
        for seq in example.sequences:
            assert len(seq.input_ids) == len(seq.labels) <= 64 and any(label != -100 for label in seq.labels)
    tally(test, "accepted")
    TRIED[test]["records in accepted files"] = TRIED[test].get("records in accepted files", 0) + count
    TRIED[test]["records dropped and counted"] = TRIED[test].get("records dropped and counted", 0) + stats.dropped_no_labels


# ----------------------------------------------------------------------------- dataset properties

@FUZZ
@given(data=dataset(), kind=st.sampled_from(["jsonl", "json"]), named=st.sampled_from(["auto", "auto", "named", "other"]))
def test_json_records_are_encoded_or_rejected_clearly(tokenizer, data, kind, named):
    fmt, rows = data
    dataset_format = {"auto": "auto", "named": fmt, "other": FORMATS[(FORMATS.index(fmt) + 1) % 4]}[named]
    with tempfile.TemporaryDirectory() as tmp:
        check_pipeline(write(rows, kind, Path(tmp)), len(rows), dataset_format, tokenizer, "json records")


@settings(FUZZ, max_examples=max(5, EXAMPLES // 4))
@given(data=dataset(min_size=1, max_size=5), kind=st.sampled_from(["csv", "parquet"]), named=st.booleans())
def test_table_records_are_encoded_or_rejected_clearly(tokenizer, data, kind, named):
    fmt, rows = data
    dataset_format = fmt if named else "auto"
    with tempfile.TemporaryDirectory() as tmp:
        check_pipeline(write(with_ids(rows), kind, Path(tmp)), len(rows), dataset_format, tokenizer, "table records")


csv_text = st.text(alphabet=st.characters(codec="utf-8", exclude_characters="\x00"), min_size=1, max_size=30).filter(str.strip)


@settings(FUZZ, max_examples=max(5, EXAMPLES // 2))
@given(data=st.sampled_from(FORMATS).flatmap(lambda fmt: st.tuples(st.just(fmt), st.lists(clean[fmt], min_size=1, max_size=8))),
       kind=st.sampled_from(["jsonl", "json", "parquet", "csv"]), named=st.booleans(), csv_rows=st.lists(
           st.fixed_dictionaries({"instruction": csv_text, "output": csv_text}), min_size=1, max_size=8))
def test_well_formed_records_are_never_rejected_or_lost(tokenizer, data, kind, named, csv_rows):
    """Every well-shaped record, whatever its text, becomes an example or is counted as dropped."""
    from toolkit.data.pipeline import load_examples

    fmt, rows = ("alpaca", csv_rows) if kind == "csv" else data  # a CSV cell cannot hold a conversation
    with tempfile.TemporaryDirectory() as tmp:
        path = write(rows, kind, Path(tmp))
        try:
            examples, stats = load_examples([str(path)], tokenizer, dataset_format=fmt if named else "auto", seq_len=64)
        except ToolkitError as exc:
            # the one legitimate refusal: nothing at all left to train on (e.g. only empty documents)
            assert "no trainable examples left" in str(exc), str(exc)
            tally("well-formed records", "all dropped, counted")
            return
    assert stats.records == len(rows) and stats.examples + stats.dropped_no_labels == len(rows) == len(examples) + stats.dropped_no_labels
    tally("well-formed records", "accepted")
    TRIED["well-formed records"]["records"] = TRIED["well-formed records"].get("records", 0) + len(rows)
    TRIED["well-formed records"]["dropped and counted"] = TRIED["well-formed records"].get("dropped and counted", 0) + stats.dropped_no_labels


raw_line = st.one_of(*[st.builds(lambda r: json.dumps(r).encode(), clean["messages"])] * 6, st.binary(max_size=20),
                     st.sampled_from([b"", b"   ", b"[1, 2]", b'"text"', b"{", b"\xef\xbb\xbf{\"text\": \"bom\"}",
                                      b'{"text": "\xff\xfe"}', b"null", b'{"text": NaN}']))


@FUZZ
@given(lines=st.lists(raw_line, max_size=6))
def test_raw_jsonl_bytes_never_crash(tokenizer, lines):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "data.jsonl"
        path.write_bytes(b"\n".join(line.replace(b"\n", b" ").replace(b"\r", b" ") for line in lines))
        count = sum(1 for line in lines if line.replace(b"\n", b" ").replace(b"\r", b" ").strip())
        check_pipeline(path, count, "auto", tokenizer, "raw jsonl", last_line=len(lines))


short_chat = st.lists(st.text(min_size=1, max_size=12), min_size=2, max_size=4).map(
    lambda texts_: {"messages": [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(texts_)]})


@FUZZ
@given(rows=st.lists(short_chat, max_size=12), micro=st.integers(1, 4), global_=st.integers(0, 12),
       world=st.integers(1, 4), packing=st.booleans())
def test_batching_uses_every_example_once_per_epoch_or_says_why(tokenizer, rows, micro, global_, world, packing):
    """The steps of one epoch take every example; only the last step's extra units (the next epoch's first ones,
    filling the global batch) repeat one."""
    from toolkit.data.pipeline import Batches, load_examples

    with tempfile.TemporaryDirectory() as tmp:
        try:
            examples, _ = load_examples([str(write(rows, "jsonl", Path(tmp)))], tokenizer, seq_len=64, packing=packing)
            per_rank = [Batches(examples, seed=1, seq_len=64, packing=packing, micro_batch_size=micro, global_batch_size=global_,
                                dp_rank=r, dp_world_size=world, pad_id=0) for r in range(world)]
        except ToolkitError:
            tally("batching", "clear error")
            return
    batches = per_rank[0]
    seen = [int(i) for step in range(batches.steps_for(1)) for b in per_rank for mb in b.micro_batches(step)
            for i in mb["sequence_meta"]["dataset_index"].unique()]
    assert set(seen) == set(range(len(examples)))
    assert len(seen) - len(examples) < batches.global_batch_size * max(len(u) for u in batches.units(1))
    tally("batching", "accepted")


# ----------------------------------------------------------------------------- recipe properties

recipe_keys = st.sampled_from(["model", "dataset", "lr", "max_steps", "micro_batch_size", "global_batch_size", "seq_len",
                               "precision", "tp", "tensor_parallel", "pp", "strategy", "tuner", "loss", "columns", "options",
                               "on_nan", "dist_timeout", "max_nan_steps", "resume", "local", "fsdp", "sft", "full", "alpaca",
                               "messages", "lr_rate", "seed", "epochs", "packing", "zero", "save_every", "export"])
yaml_values = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-5, 10**12), st.floats(allow_nan=True),
                                     st.text(max_size=12), st.sampled_from(["auto", "bf16", "local", "fsdp", "sft", "1e-4", "nan"])),
                           lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=3)),
                           max_leaves=6)
recipes = st.dictionaries(st.one_of(recipe_keys, st.text(max_size=10)), yaml_values, max_size=6)


@FUZZ
@given(values=recipes, world=st.integers(1, 8))
def test_recipes_validate_or_name_the_key(values, world):
    from toolkit.recipe import resolve_recipe
    from toolkit.train.runner import resolve_components

    try:
        recipe = resolve_recipe(values, source="fuzz.yaml")
        resolve_components(recipe, world)
    except ConfigError as exc:
        assert "fuzz.yaml" in str(exc) or exc.problems, str(exc)
        tally("recipes", "clear error")
        return
    except ToolkitError:
        tally("recipes", "clear error")
        return
    assert recipe.lr > 0 and recipe.seq_len >= 1 and recipe.on_nan in ("stop", "skip", "rollback")
    tally("recipes", "accepted")


@settings(FUZZ, max_examples=max(5, EXAMPLES // 2),
          suppress_health_check=[*FUZZ.suppress_health_check, HealthCheck.function_scoped_fixture])
@given(values=recipes)
def test_recipe_files_through_the_cli_never_show_a_traceback(values, cli_runner, captured_runs):
    import yaml

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "recipe.yaml"
        path.write_text(yaml.safe_dump(values, allow_unicode=True))
        result = cli_runner.invoke("train", "--config", str(path))
    assert result.exception is None, (values, result.exception)
    assert "Traceback" not in result.output
    if result.exit_code:
        assert result.output.strip().startswith("Error:") or "Error:" in result.output, result.output
        tally("recipe files", "clear error")
    else:
        assert len(captured_runs) >= 1
        tally("recipe files", "accepted")
