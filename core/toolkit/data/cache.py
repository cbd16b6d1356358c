"""The tokenized cache: a dataset's encoded examples saved as Arrow (``datasets.Dataset.save_to_disk``), so the
second run on a large set starts in seconds instead of tokenizing it again.

An entry is keyed by everything that decides the encoding: the file (resolved path, size, modification
time), the record format and its options, the column renames, what trains (``train_on``), the record
limit and the tokenizer (its vocabulary, special tokens and chat template). Truncation and packing happen
after the cache, so changing ``--seq-len`` or ``--packing`` reuses it. Entries are written to a temporary
directory and renamed into place (complete or absent); one that cannot be read is named and ignored.
``TOOLKIT_CACHE`` moves the cache (default ``~/.cache/toolkit``); ``TOOLKIT_CACHE=off`` turns it off.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from toolkit.contracts import Example, Sequence
from toolkit.data.reading import quiet_datasets

ENCODING_VERSION = 3
"""Bumped whenever an encoding change would make old entries wrong (2: null content, non-text fields and
parts refused; tool calls, tools and system columns rendered; 3: a template without end-of-turn markers,
GLM-4's, trains the next turn's role token or an appended EOS as each reply's stop)."""


def cache_root() -> Path | None:
    setting = os.environ.get("TOOLKIT_CACHE", "")
    if setting.lower() in ("off", "0", "none"):
        return None
    return Path(setting).expanduser() if setting else Path.home() / ".cache" / "toolkit"


def tokenizer_fingerprint(tokenizer: Any) -> str:
    fast = getattr(tokenizer, "backend_tokenizer", None)  # the Rust tokenizer of a fast tokenizer
    vocabulary = fast.to_str() if fast is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    parts = [vocabulary, str(tokenizer.chat_template), json.dumps(tokenizer.special_tokens_map, sort_keys=True, default=str)]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def entry_key(path: Path, encoding: dict[str, Any], tokenizer: Any) -> str | None:
    """The cache key of ``path`` encoded as ``encoding`` says (format, options, columns, what trains, limit)
    by ``tokenizer``; ``None`` for a directory (a ``save_to_disk`` set reads fast already)."""
    if not path.is_file():
        return None
    stat = path.stat()
    described = {"version": ENCODING_VERSION, "path": str(path.resolve()), "size": stat.st_size, "mtime": stat.st_mtime_ns,
                 "encoding": encoding, "tokenizer": tokenizer_fingerprint(tokenizer), "code": code_versions()}
    return hashlib.sha256(json.dumps(described, sort_keys=True, default=str).encode()).hexdigest()[:32]


def code_versions() -> list[str]:
    """The toolkit's plugins (their formats encode) and transformers (it renders chat templates), with versions:
    an upgrade of any of them starts new entries."""
    from importlib import metadata

    import transformers

    plugins = {f"{ep.dist.name}=={ep.dist.version}" for ep in metadata.entry_points(group="toolkit") if ep.dist}
    return sorted(plugins | {f"transformers=={transformers.__version__}"})


def load(key: str | None) -> tuple[list[Example], int] | None:
    """The examples and record count of an entry; ``None`` when absent, off or unreadable (which is said)."""
    root = cache_root()
    if key is None or root is None or not (root / "tokenized" / key / "toolkit.json").is_file():
        return None
    directory = root / "tokenized" / key
    try:
        import datasets

        meta = json.loads((directory / "toolkit.json").read_text())
        with quiet_datasets():
            table = datasets.load_from_disk(str(directory / "examples"))
        # whole columns out of Arrow at once: about twice as fast as iterating the rows
        columns = {name: table.data.column(name).to_pylist() for name in ("input_ids", "labels", "roles", "meta", "kind", "source")}
        examples = [Example([Sequence(ids, labels, role, seq_meta) for ids, labels, role, seq_meta in
                             zip(row_ids, row_labels, row_roles, json.loads(meta))], kind=kind, source=source)
                    for row_ids, row_labels, row_roles, meta, kind, source in
                    zip(*(columns[n] for n in ("input_ids", "labels", "roles", "meta", "kind", "source")))]
        return examples, int(meta["records"])
    except Exception as exc:  # noqa: BLE001 - a damaged entry costs a re-tokenization, never the run
        print(f"toolkit: ignoring the damaged tokenized cache entry {directory} ({type(exc).__name__}: {exc})", file=sys.stderr)
        return None


def store(key: str | None, examples: list[Example], records: int) -> None:
    """Save an entry (written aside, renamed into place); a full disk or a read-only cache is said, not fatal."""
    root = cache_root()
    if key is None or root is None:
        return
    final = root / "tokenized" / key
    staging = root / "tokenized" / f".{key}.{os.getpid()}"
    try:
        import datasets

        columns: dict[str, list[Any]] = {"input_ids": [], "labels": [], "roles": [], "meta": [], "kind": [], "source": []}
        for example in examples:
            columns["input_ids"].append([s.input_ids for s in example.sequences])
            columns["labels"].append([s.labels for s in example.sequences])
            columns["roles"].append([s.role for s in example.sequences])
            columns["meta"].append(json.dumps([s.meta for s in example.sequences]))
            columns["kind"].append(example.kind)
            columns["source"].append(example.source)
        staging.mkdir(parents=True, exist_ok=True)
        with quiet_datasets():
            datasets.Dataset.from_dict(columns).save_to_disk(str(staging / "examples"))
        (staging / "toolkit.json").write_text(json.dumps({"records": records, "examples": len(examples)}))
        try:
            staging.rename(final)
        except OSError:
            if not (final / "toolkit.json").is_file():
                raise
            shutil.rmtree(staging, ignore_errors=True)  # another process (rank) stored the same entry first
    except Exception as exc:  # noqa: BLE001 - the cache is an optimisation: the run goes on without it
        shutil.rmtree(staging, ignore_errors=True)
        print(f"toolkit: could not write the tokenized cache to {final} ({type(exc).__name__}: {exc}); "
              "set TOOLKIT_CACHE to another directory or TOOLKIT_CACHE=off", file=sys.stderr)
