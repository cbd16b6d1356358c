"""Reading datasets into lists of records through Hugging Face ``datasets``: local JSONL/JSON/CSV/Parquet files
(``load_dataset``, whose Arrow cache makes a second read fast), directories written by ``save_to_disk``
(``load_from_disk``) and bundled names.

``datasets`` says little about *where* a file is broken, so when it cannot read one, the line-by-line readers
below (kept for that reason) name the line and what is wrong; when those read the file fine (records
valid JSON but of types Arrow cannot unify into one schema) their records are used as they are. Records
read through Arrow lose the difference between a missing key and a null: nulls are dropped from them
(Arrow fills every key any record has into all of them), so formats see the keys each record had.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from toolkit.contracts import member
from toolkit.errors import DataError

BUNDLED = Path(__file__).resolve().parents[1] / "assets" / "datasets"


def bundled_names() -> list[str]:
    names = {p.stem for p in BUNDLED.glob("*.jsonl")}
    from toolkit.plugins import get_plugin_manager

    for _, cls in get_plugin_manager().registry("dataset_format").items():
        names.update(member(cls, "dataset_format", "bundled_datasets") or {})
    return sorted(names)


def resolve_dataset_path(reference: str) -> Path:
    path = Path(reference)
    if path.exists():
        return path
    bundled = BUNDLED / f"{reference}.jsonl"
    if bundled.is_file():
        return bundled
    from toolkit.plugins import get_plugin_manager

    for _, cls in get_plugin_manager().registry("dataset_format").items():
        extra = member(cls, "dataset_format", "bundled_datasets") or {}
        if reference in extra:
            return Path(extra[reference])
    raise DataError(f"dataset {reference!r} is neither a file nor a bundled dataset; bundled: {', '.join(bundled_names())}")


BUILDERS = {".jsonl": "json", ".ndjson": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}


def read_records(reference: str, limit: int = 0) -> tuple[Path, list[dict[str, Any]]]:
    """Read every record of a dataset (file, ``save_to_disk`` directory or bundled name); each record carries
    ``__line__`` (its line in the file, or its row), and errors name the file and line."""
    path = resolve_dataset_path(reference)
    if path.is_dir():
        return path, _read_saved(path, limit)
    suffix = path.suffix.lower()
    if suffix not in BUILDERS:
        raise DataError(f"{path}: unsupported file type {suffix!r}; use .jsonl, .json, .parquet or .csv, or a directory "
                        "written by datasets' save_to_disk")
    table = _load_file(path, suffix)
    if table is None:  # datasets could not read it, but the file is sound: records as the line readers give them
        return path, _read_by_hand(path, suffix, limit)
    lines = _line_numbers(path, suffix, len(table) if not limit else min(limit, len(table)))
    rows = table.select(range(min(limit, len(table)))) if limit else table
    try:
        return path, [{**drop_nulls(row), "__line__": line} for row, line in zip(rows, lines)]
    except (UnicodeError, ValueError):  # Arrow kept bytes that are no text (bad UTF-8, lone surrogates): name the line
        return path, _read_by_hand(path, suffix, limit)


def _load_file(path: Path, suffix: str) -> Any:
    """The file as a ``datasets.Dataset``; ``None`` when only the line readers can read it. A broken file is
    refused by them with its line."""
    import datasets

    try:
        options = csv_options([path]) if suffix == ".csv" else {}
        with quiet_datasets():
            return datasets.load_dataset(BUILDERS[suffix], data_files=str(path), split="train", **options)
    except Exception as exc:  # noqa: BLE001 - datasets raises many kinds; the line readers say which line is wrong
        _read_by_hand(path, suffix, 0)
        if suffix == ".parquet":
            raise DataError(f"cannot read {path} as Parquet: {exc}") from None
        return None


def _read_saved(path: Path, limit: int) -> list[dict[str, Any]]:
    """The records of a directory written by ``save_to_disk`` (:func:`_load_saved`)."""
    table = _load_saved(path)
    rows = table.select(range(min(limit, len(table)))) if limit else table
    return [{**drop_nulls(row), "__line__": index + 1} for index, row in enumerate(rows)]


def _load_saved(path: Path) -> Any:
    """A directory written by ``Dataset.save_to_disk`` (or a ``DatasetDict``'s, using its ``train`` split) as a
    memory-mapped ``datasets.Dataset``."""
    import datasets

    try:
        with quiet_datasets():
            table = datasets.load_from_disk(str(path))
    except FileNotFoundError as exc:
        raise DataError(f"{path} is a directory but not one written by datasets' save_to_disk ({exc}); pass a "
                        ".jsonl, .json, .parquet or .csv file, or such a directory") from None
    if isinstance(table, datasets.DatasetDict):
        if "train" not in table:
            raise DataError(f"{path} holds the splits {', '.join(table)} and no 'train'; pass the split's own "
                            f"directory ({path / next(iter(table))})")
        table = table["train"]
    return table


def _stream_saved(paths: list[Path], skip: int) -> Any:
    """``(where, record)`` of ``save_to_disk`` directories one after another, from record ``skip`` on: their Arrow
    files are memory-mapped and read a batch at a time, and a resume starts at its row without reading the rest."""
    before = 0  # records of the directories already passed
    for path in paths:
        table = _load_saved(path)
        start = max(0, skip - before)
        if start < len(table):
            for row_number, row in enumerate(table.select(range(start, len(table))), start=start + 1):
                yield f"{path}, row {row_number}", drop_nulls(row)
        before += len(table)


def stream_records(references: list[str], skip: int = 0) -> Any:
    """``(where, record)`` of the datasets read as one stream (``datasets``' streaming mode), from record ``skip`` on
    (skipped records are parsed, not kept). Files of one kind only (all JSON/JSONL, all CSV or all Parquet), or
    directories written by ``save_to_disk``."""
    import datasets

    paths = [resolve_dataset_path(r) for r in references]
    if all(p.is_dir() for p in paths):
        yield from _stream_saved(paths, skip)
        return
    kinds = {BUILDERS.get(p.suffix.lower()) for p in paths}
    if any(p.is_dir() for p in paths) or None in kinds or len(kinds) > 1:
        raise DataError(f"--streaming reads .jsonl/.json, .csv or .parquet files of one kind, or save_to_disk directories; "
                        f"got {', '.join(map(str, paths))}. Convert the odd ones out (Dataset.to_json), or drop --streaming")
    builder = kinds.pop()
    options = csv_options(paths) if builder == "csv" else {}
    label = str(paths[0]) if len(paths) == 1 else f"{paths[0]} (+{len(paths) - 1} more files)"
    with quiet_datasets():
        stream = datasets.load_dataset(builder, data_files=[str(p) for p in paths], split="train", streaming=True, **options)
    index = skip
    try:
        for row in stream.skip(skip) if skip else stream:
            index += 1
            yield f"{label}, record {index}", drop_nulls(row)
    except DataError:
        raise
    except Exception as exc:  # noqa: BLE001 - datasets' many error kinds; the record number is what helps
        raise DataError(f"{label}: cannot read record {index + 1} of the stream ({type(exc).__name__}: {exc}); "
                        "run without --streaming to have the line named") from None


def csv_options(paths: list[Path]) -> dict[str, Any]:
    """``load_dataset("csv")`` options that keep every cell the text it holds: each header column typed as a
    string (no type guessing: "0.10" stays "0.10"), "NA" and "null" text, an empty cell an empty string. The
    header is the first file's; a file whose header differs fails in ``datasets`` and the line readers name it."""
    import csv

    import datasets

    try:
        with paths[0].open(encoding="utf-8-sig", newline="") as handle:
            header = next(csv.reader(handle), [])
    except (UnicodeDecodeError, csv.Error) as exc:
        raise DataError(f"{paths[0]}, line 1: cannot read the CSV header ({exc}); save the file as UTF-8 CSV") from None
    features = datasets.Features({name: datasets.Value("string") for name in header})
    return {"features": features, "keep_default_na": False, "na_filter": False}


def drop_nulls(value: Any) -> Any:
    """``value`` without the null entries of its dicts, at any depth (what Arrow added for keys a record lacked)."""
    if isinstance(value, dict):
        return {k: drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [drop_nulls(v) for v in value]
    return value


def _line_numbers(path: Path, suffix: str, count: int) -> list[int]:
    """The file line each of the first ``count`` records starts on (rows for Parquet and for JSON that is not
    one top-level array)."""
    if suffix == ".json":
        numbers = json_array_lines(path.read_text(encoding="utf-8-sig", errors="replace"), count)
        if len(numbers) == count:
            return numbers
    if suffix in (".jsonl", ".ndjson"):
        with path.open("rb") as handle:
            numbers = [n for n, raw in enumerate(handle, start=1) if raw.strip()]
        if len(numbers) >= count:
            return numbers[:count]
    if suffix == ".csv":
        import csv

        with path.open(encoding="utf-8-sig", newline="") as handle:
            reader = csv.reader(handle)
            next(reader, None)
            numbers = []
            for row in reader:
                if not row:  # a blank line is no record (datasets and DictReader skip it too)
                    continue
                numbers.append(reader.line_num)
                if len(numbers) == count:
                    break
        if len(numbers) == count:
            return numbers
    return list(range(1, count + 1))


class quiet_datasets:
    """datasets' progress bars and logs off while it reads (the toolkit prints its own summary and errors)."""

    def __enter__(self) -> None:
        import datasets

        self.bars = datasets.utils.logging.is_progress_bar_enabled()
        self.level = datasets.utils.logging.get_verbosity()
        datasets.utils.logging.disable_progress_bar()
        datasets.utils.logging.set_verbosity(datasets.utils.logging.CRITICAL)  # its own error lines too: ours name the line

    def __exit__(self, *exc: Any) -> None:
        import datasets

        if self.bars:
            datasets.utils.logging.enable_progress_bar()
        datasets.utils.logging.set_verbosity(self.level)


def _read_by_hand(path: Path, suffix: str, limit: int) -> list[dict[str, Any]]:
    """The line readers: every record, or a DataError naming the line that is wrong."""
    if suffix in (".jsonl", ".ndjson"):
        records = _read_jsonl(path, limit)
    elif suffix == ".json":
        records = _read_json(path)
    elif suffix == ".csv":
        records = _read_csv(path)
    else:
        records = _read_parquet(path)
    return records[:limit] if limit else records


def json_type(value: Any) -> str:
    """The JSON name of a parsed value's type (``null``, not ``NoneType``)."""
    names = {type(None): "null", bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "an array"}
    return names.get(type(value), type(value).__name__)


LONE_SURROGATE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def _decode(raw: bytes, path: Path, number: int) -> str:
    try:
        return raw.decode("utf-8-sig" if number == 1 else "utf-8")  # a byte-order mark may open the file
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}, line {number}: not valid UTF-8 (byte {exc.start + 1}: {raw[exc.start:exc.start + 1]!r}); "
                        "save the file as UTF-8") from None


def json_array_lines(text: str, count: int) -> list[int]:
    """The line each of the first ``count`` elements of the top-level JSON array ``text`` starts on; fewer when
    ``text`` is no such array or two elements start on one line (a line would not tell them apart)."""
    index = len(text) - len(text.lstrip())
    if not text.startswith("[", index):
        return []
    decoder, numbers = json.JSONDecoder(), []
    index += 1
    line, counted = 1 + text.count("\n", 0, index), index
    while len(numbers) < count:
        while index < len(text) and text[index] in " \t\r\n,":
            index += 1
        if index >= len(text) or text[index] == "]":
            break
        line, counted = line + text.count("\n", counted, index), index
        if numbers and line == numbers[-1]:
            return []
        numbers.append(line)
        try:
            _, index = decoder.raw_decode(text, index)
        except json.JSONDecodeError:
            break
    return numbers


def _check_characters(record: Any, text: str, path: Path, number: int) -> None:
    """JSON may escape a lone UTF-16 surrogate (``\\ud800``): not a character, and tokenizers reject it."""
    if not LONE_SURROGATE.search(text):
        return
    try:
        json.dumps(record, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise DataError(f"{path}, line {number}: a string holds a lone UTF-16 surrogate escape (such as \\ud800), "
                        "which is not a character; fix or remove it") from None


def _read_jsonl(path: Path, limit: int) -> list[dict[str, Any]]:
    records = []
    with path.open("rb") as handle:
        for number, raw in enumerate(handle, start=1):
            line = _decode(raw, path, number)
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}, line {number}: not valid JSON ({exc.msg} at column {exc.colno}). "
                                "Each line of a .jsonl file must be one JSON object.") from None
            if not isinstance(record, dict):
                raise DataError(f"{path}, line {number}: expected a JSON object, got {json_type(record)}")
            _check_characters(record, line, path, number)
            record["__line__"] = number
            records.append(record)
            if limit and len(records) >= limit:
                break
    return records


def _read_json(path: Path) -> list[dict[str, Any]]:
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw[:exc.start].count(b"\n") + 1
        raise DataError(f"{path}, line {line}: not valid UTF-8 ({raw[exc.start:exc.start + 1]!r}); save the file as UTF-8") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise DataError(f"{path}, line {exc.lineno}: not valid JSON ({exc.msg})") from None
    if isinstance(data, dict):
        data = next((v for v in data.values() if isinstance(v, list)), None)
    if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
        raise DataError(f"{path}: expected a list of JSON objects (or an object holding one)")
    lines = json_array_lines(text, len(data))
    lines = lines if len(lines) == len(data) else list(range(1, len(data) + 1))
    if LONE_SURROGATE.search(text):
        for line, record in zip(lines, data):
            _check_characters(record, text, path, line)
    return [{**record, "__line__": line} for record, line in zip(data, lines)]


def _read_csv(path: Path) -> list[dict[str, Any]]:
    """Every cell as the text it holds: no type guessing ("0.10" stays "0.10", "NA" and "null" stay
    text), an empty cell is an empty string, and errors name the physical line."""
    import csv

    csv.field_size_limit(2**31 - 1)  # long documents are legitimate cells
    records = []
    try:
        with path.open(encoding="utf-8-sig", newline="") as handle:
            reader = csv.DictReader(handle)
            for row in reader:
                extra = row.pop(None, None)
                if extra:
                    raise DataError(f"{path}, line {reader.line_num}: {len(extra)} more cells than the header has columns")
                row = {k: ("" if v is None else v) for k, v in row.items()}
                row["__line__"] = reader.line_num
                records.append(row)
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: not valid UTF-8 ({exc.object[exc.start:exc.start + 1]!r} at byte {exc.start}); "
                        "save the file as UTF-8") from None
    except csv.Error as exc:
        raise DataError(f"{path}: not a readable CSV file ({exc})") from None
    return records


def _read_parquet(path: Path) -> list[dict[str, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as exc:
        raise DataError(f"cannot read {path} as Parquet: {exc}") from None
    return [{**row, "__line__": index + 1} for index, row in enumerate(table.to_pylist())]
