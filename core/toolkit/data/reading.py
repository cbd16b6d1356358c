"""Reading dataset files (JSONL, JSON, Parquet, CSV) and bundled names into lists of records."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from toolkit.errors import DataError

BUNDLED = Path(__file__).resolve().parents[1] / "assets" / "datasets"


def bundled_names() -> list[str]:
    names = {p.stem for p in BUNDLED.glob("*.jsonl")}
    from toolkit.plugins import get_plugin_manager

    for _, cls in get_plugin_manager().registry("dataset_format").items():
        names.update(getattr(cls, "bundled_datasets", {}) or {})
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
        extra = getattr(cls, "bundled_datasets", {}) or {}
        if reference in extra:
            return Path(extra[reference])
    raise DataError(f"dataset {reference!r} is neither a file nor a bundled dataset; bundled: {', '.join(bundled_names())}")


def read_records(reference: str, limit: int = 0) -> tuple[Path, list[dict[str, Any]]]:
    """Read every record of a dataset file, with errors naming the file and line."""
    path = resolve_dataset_path(reference)
    suffix = path.suffix.lower()
    if path.is_dir():
        raise DataError(f"{path} is a directory; pass a .jsonl, .json, .parquet or .csv file")
    if suffix in (".jsonl", ".ndjson"):
        records = _read_jsonl(path, limit)
    elif suffix == ".json":
        records = _read_json(path)
    elif suffix == ".csv":
        records = _read_csv(path)
    elif suffix == ".parquet":
        records = _read_parquet(path)
    else:
        raise DataError(f"{path}: unsupported file type {suffix!r}; use .jsonl, .json, .parquet or .csv")
    if limit:
        records = records[:limit]
    return path, records


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
    if LONE_SURROGATE.search(text):
        for index, record in enumerate(data):
            _check_characters(record, text, path, index + 1)
    return data


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
