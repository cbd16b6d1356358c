"""From records to micro-batches: encode, truncate (SFT) or cut into rows (PT), filter, pack, shuffle by seed,
shard over DP ranks.

The order of every epoch is a pure function of (seed, epoch); the epochs' units are laid end to end and each
optimizer step takes a fixed slice of them (an epoch's last step completed by the next epoch's first units, so
nothing is left out), so resuming at step N continues at exactly the sample it stopped at.
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from toolkit.contracts import IGNORE_INDEX, Example, StepContext
from toolkit.data.reading import read_records
from toolkit.data.template import ChatTemplate
from toolkit.errors import ConfigError, DataError


@dataclass
class DataStats:
    records: int = 0
    examples: int = 0
    truncated: int = 0
    dropped_no_labels: int = 0
    documents: int = 0
    """PT: documents joined into the token stream that full rows are cut from (0 when not PT)."""
    tokens: int = 0
    """Real tokens of all examples (or rows); ``trained_tokens`` of them have a label."""
    trained_tokens: int = 0
    rows: int = 0
    """Rows of epoch 0 and the share of their capacity that real tokens fill (set by the runner)."""
    row_fill: float = 0.0
    stream_window: int = 0
    """``--streaming``: records per window; the other figures are then those of the windows read so far (the
    first one at start-up), as a stream is not read ahead."""
    stream_mix: str = ""
    """``--streaming`` with ``--dataset-ratios``: the ratios, as the summary names them."""
    per_file: dict[str, int] = field(default_factory=dict)

    def summary(self) -> str:
        once = "each trained once per pass" if self.stream_window else "each trained once per epoch"
        if self.documents:
            text = (f"{self.examples} rows of --seq-len cut from {self.documents} documents ({self.tokens} tokens, {once}) "
                    f"from {self.records} records")
        else:
            text = f"{self.examples} examples from {self.records} records"
        if self.stream_window:
            mixed = f" drawn from the datasets by --dataset-ratios {self.stream_mix}" if self.stream_mix else ""
            text = f"streaming in windows of {self.stream_window} records{mixed}; the first window: {text}"
        if self.rows:
            text += (f"; {self.rows} rows {'in it' if self.stream_window else 'per epoch'}, {self.row_fill:.1%} filled "
                     f"with real tokens, {self.trained_tokens} trained tokens")
        if self.truncated:
            text += f"; {self.truncated} sequences truncated to --seq-len"
        if self.dropped_no_labels:
            text += f"; {self.dropped_no_labels} examples dropped (no trainable tokens left)"
        return text


def pick_format(name: str, columns: list[str], where: str, manager: Any, recipe_options: dict[str, Any] | None = None) -> Any:
    registry = manager.registry("dataset_format")
    if name != "auto":
        cls = registry.get(name)
        return cls(cls.Config(**(recipe_options or {}).get(cls.name, {})))
    for _, cls in registry.items():
        fmt = cls(cls.Config(**(recipe_options or {}).get(cls.name, {})))
        if fmt.detect(columns):
            return fmt
    raise DataError(f"{where}: cannot tell the record format from its columns ({', '.join(columns) or 'none'}). "
                    f"Pass --dataset-format (one of {', '.join(registry.names())}) or --columns OURS=THEIRS to rename.")


def truncate(example: Example, seq_len: int, stats: DataStats, packing_share: bool = False) -> Example:
    """Cut sequences to ``seq_len`` (or an equal share of it when an example's sequences must share a packed row)."""
    limit = seq_len // len(example.sequences) if packing_share else seq_len
    for seq in example.sequences:
        if len(seq.input_ids) > limit:
            stats.truncated += 1
            seq.input_ids = seq.input_ids[:limit]
            seq.labels = seq.labels[: limit - 1] + [IGNORE_INDEX]
    return example


def load_examples(datasets: list[str], tokenizer: Any, *, dataset_format: str = "auto", columns: dict[str, str] | None = None,
                  train_on: str = "assistant", seq_len: int = 512, max_samples: int = 0, example_kinds: tuple[str, ...] = ("lm",),
                  manager: Any = None, options: dict[str, Any] | None = None, packing: bool = False,
                  isolate_documents: bool = False, ratios: list[float] | None = None, seed: int = 0) -> tuple[list[Example], DataStats]:
    """Read and encode every dataset (through the tokenized cache); report problems with file and line.

    SFT-style examples longer than ``seq_len`` are truncated (and counted). With ``train_on="all"`` (PT)
    documents are not truncated: they are joined and cut into rows of ``seq_len``
    (:func:`toolkit.data.packing.stream_rows`), so every token trains once per epoch. ``ratios`` (one per
    dataset) mix the datasets in those proportions (:func:`mix`).
    """
    from toolkit.plugins import get_plugin_manager

    manager = manager or get_plugin_manager()
    stats = DataStats()
    if ratios:
        check_ratios(ratios, len(datasets))
    parts = []
    for reference in datasets:
        path, encoded, records = encode_dataset(reference, tokenizer, dataset_format=dataset_format, columns=columns,
                                                train_on=train_on, max_samples=max_samples, example_kinds=example_kinds,
                                                manager=manager, options=options)
        parts.append(fit(encoded, train_on, seq_len, stats, packing))
        stats.records += records
        stats.per_file[str(path)] = records
    examples = pt_rows(mix(parts, ratios, seed) if ratios else [e for part in parts for e in part], train_on, seq_len,
                       isolate_documents, stats)
    stats.examples = len(examples)
    stats.tokens = sum(len(s.input_ids) for e in examples for s in e.sequences)
    stats.trained_tokens = sum(1 for e in examples for s in e.sequences for label in s.labels if label != IGNORE_INDEX)
    if not examples:
        raise DataError(f"no trainable examples left in {', '.join(datasets)} after encoding and filtering "
                        f"({stats.records} records; {stats.dropped_no_labels} had no trainable tokens within --seq-len {seq_len})")
    return examples, stats


def encode_dataset(reference: str, tokenizer: Any, *, dataset_format: str, columns: dict[str, str] | None, train_on: str,
                   max_samples: int, example_kinds: tuple[str, ...], manager: Any,
                   options: dict[str, Any] | None) -> tuple[Any, list[Example], int]:
    """``(path, examples, records)`` of one dataset, before truncation: from the tokenized cache
    (:mod:`toolkit.data.cache`) when an entry matches, else read, encoded and stored there."""
    from toolkit.data import cache
    from toolkit.data.reading import resolve_dataset_path

    path = resolve_dataset_path(reference)
    # the format as asked for (auto included) and every option section: what can change the encoding
    encoding = {"dataset_format": dataset_format, "options": options or {}, "kinds": list(example_kinds),
                "columns": columns or {}, "train_on": train_on, "limit": max_samples}
    key = cache.entry_key(path, encoding, tokenizer)
    hit = cache.load(key)
    if hit is not None:
        return path, hit[0], hit[1]
    path, records = read_records(reference, limit=max_samples)
    if not records:
        raise DataError(f"{path} holds no records")
    rename = {theirs: ours for ours, theirs in (columns or {}).items()}
    first = {rename.get(k, k): v for k, v in records[0].items() if k != "__line__"}
    fmt = pick_format(dataset_format, list(first), str(path), manager, options)
    if fmt.example_kind not in example_kinds:
        raise ConfigError(f"{path} is in format {fmt.name!r} ({fmt.example_kind} examples), but the loss needs "
                          f"{' or '.join(example_kinds)} examples. Pick a matching --dataset or loss.")
    template = ChatTemplate(tokenizer, train_on=train_on)
    unit = "row" if path.is_dir() or path.suffix.lower() == ".parquet" else "line"  # tables have rows, not lines
    examples = [encode_record(fmt, {k: v for k, v in record.items() if k != "__line__"}, rename, tokenizer, template,
                              f"{path}, {unit} {record.get('__line__', index + 1)}") for index, record in enumerate(records)]
    cache.store(key, examples, len(records))
    return path, examples, len(records)


def encode_record(fmt: Any, record: dict[str, Any], rename: dict[str, str], tokenizer: Any, template: ChatTemplate,
                  where: str) -> Example:
    """One record (columns renamed) as an Example whose source is ``where``; every problem names ``where``."""
    record = {rename.get(k, k): v for k, v in record.items()}
    try:
        example = fmt.encode(record, tokenizer, template, where=where)
    except DataError as exc:
        if where in str(exc):
            raise
        raise DataError(f"{where}: {exc}") from exc
    example.source = where
    return example


def fit(examples: list[Example], train_on: str, seq_len: int, stats: DataStats, packing: bool) -> list[Example]:
    """Examples truncated to ``seq_len`` (not PT documents: :func:`pt_rows` cuts those), without those left with
    no trainable token; both counted in ``stats``."""
    kept = []
    for example in examples:
        if not (train_on == "all" and len(example.sequences) == 1):
            example = truncate(example, seq_len, stats, packing)
        if any(all(label == IGNORE_INDEX for label in seq.labels) for seq in example.sequences):
            stats.dropped_no_labels += 1
            continue
        kept.append(example)
    return kept


def pt_rows(examples: list[Example], train_on: str, seq_len: int, isolate_documents: bool, stats: DataStats) -> list[Example]:
    """PT documents joined and cut into full rows (:func:`toolkit.data.packing.stream_rows`); other examples as they are."""
    if not (train_on == "all" and examples and all(len(e.sequences) == 1 for e in examples)):
        return examples
    from toolkit.data.packing import stream_rows

    stats.documents += len(examples)
    return stream_rows(examples, seq_len, isolate_documents)


def stream_encoder(tokenizer: Any, *, dataset_format: str, columns: dict[str, str] | None, train_on: str, seq_len: int,
                   example_kinds: tuple[str, ...], options: dict[str, Any] | None, packing: bool, isolate_documents: bool,
                   stats: DataStats, manager: Any = None) -> Any:
    """For ``--streaming`` (:class:`toolkit.data.streaming.StreamBatches`): a function from one window's
    ``(where, record)`` pairs to its examples, by the same rules as :func:`load_examples` (the format of each
    stream, several with ``--dataset-ratios``, is picked from its first record)."""
    from toolkit.plugins import get_plugin_manager

    manager = manager or get_plugin_manager()
    template = ChatTemplate(tokenizer, train_on=train_on)
    rename = {theirs: ours for ours, theirs in (columns or {}).items()}
    chosen: dict[str, Any] = {}  # the format of each stream ("file, record N" less the record), from its first record

    def format_of(where: str, record: dict[str, Any]) -> Any:
        stream = where.rsplit(", ", 1)[0]
        if stream not in chosen:
            fmt = pick_format(dataset_format, [rename.get(k, k) for k in record], where, manager, options)
            if fmt.example_kind not in example_kinds:
                raise ConfigError(f"{where}: the stream is in format {fmt.name!r} ({fmt.example_kind} examples), but the "
                                  f"loss needs {' or '.join(example_kinds)} examples")
            chosen[stream] = fmt
        return chosen[stream]

    def encode(window: list[tuple[str, dict[str, Any]]]) -> list[Example]:
        examples = [encode_record(format_of(where, record), record, rename, tokenizer, template, where)
                    for where, record in window]
        stats.records += len(window)
        rows = pt_rows(fit(examples, train_on, seq_len, stats, packing), train_on, seq_len, isolate_documents, stats)
        stats.examples += len(rows)
        stats.tokens += sum(len(s.input_ids) for e in rows for s in e.sequences)
        stats.trained_tokens += sum(1 for e in rows for s in e.sequences for label in s.labels if label != IGNORE_INDEX)
        return rows

    return encode


def check_ratios(ratios: list[float], datasets: int) -> None:
    """``--dataset-ratios``: one per dataset, 0 or more, not all 0."""
    if len(ratios) != datasets:
        raise ConfigError(f"--dataset-ratios gives {len(ratios)} ratios for {datasets} datasets; give one per --dataset")
    if any(not r >= 0 for r in ratios) or not sum(ratios) > 0:
        raise ConfigError(f"--dataset-ratios {','.join(map(str, ratios))}: ratios must be 0 or more and not all 0")


def mix(parts: list[list[Example]], ratios: list[float], seed: int) -> list[Example]:
    """The datasets mixed in proportion to ``ratios``, as many examples as they hold together: dataset ``i``
    gives ``ratio_i / sum(ratios)`` of them, drawn without replacement (seeded) while it has enough, and
    repeated whole (then drawn) where its share is larger than it is."""
    check_ratios(ratios, len(parts))
    total = sum(len(p) for p in parts)
    rng = random.Random(seed * 7_368_787 + 17)
    mixed: list[Example] = []
    for part, ratio in zip(parts, ratios):
        want = round(total * ratio / sum(ratios))
        if want and not part:
            raise DataError("a dataset given a ratio above 0 holds no trainable examples")
        whole, rest = divmod(want, len(part)) if part else (0, 0)
        mixed.extend(part * whole)
        mixed.extend(rng.sample(part, rest))
    return mixed


def build_units(examples: list[Example], order: list[int], seq_len: int, packing: bool, group: int = 0) -> list[list[int]]:
    """Group example indices into units: rows packed by best-fit decreasing (``packing``), else one example
    each, length-grouped in runs of ``group`` (a global batch) when ``group`` is set."""
    from toolkit.data.packing import group_by_length, pack_rows

    if packing:
        return pack_rows(examples, order, seq_len)
    if group > 1:
        return group_by_length(examples, order, group)
    return [[i] for i in order]


def batch_rows(examples: list[Example], units: list[list[int]], packing: bool) -> list[list[tuple[int, int]]]:
    """The rows of a micro-batch as (example index, sequence index) pairs: a packed unit's sequences
    share one row, otherwise every sequence has its own."""
    if packing:
        return [[(i, j) for i in unit for j in range(len(examples[i].sequences))] for unit in units]
    return [[(i, j)] for unit in units for i in unit for j in range(len(examples[i].sequences))]


def row_lengths(examples: list[Example], rows: list[list[tuple[int, int]]]) -> list[int]:
    return [sum(len(examples[i].sequences[j].input_ids) for i, j in row) for row in rows]


def padded_width(lengths: list[int], pad_multiple: int = 1, max_width: int = 0) -> int:
    """The width a micro-batch's rows are padded to: the longest row, rounded up to ``pad_multiple`` (at most
    ``max_width``, never below the longest row)."""
    width = max(lengths)
    if pad_multiple > 1:
        rounded = -(-width // pad_multiple) * pad_multiple
        width = max(width, min(rounded, max_width or rounded))
    return width


def row_fill(examples: list[Example], steps: list[list[list[int]]], micro_batch_size: int, packing: bool,
             seq_len: int, pad_multiple: int = 1) -> tuple[int, float]:
    """Rows of the steps' micro-batches and the share of their capacity real tokens fill, the capacity being the
    width :func:`collate` pads them to (what the engine computes over, as ``row_fill`` in metrics.jsonl counts it)."""
    rows = capacity = real = 0
    for units in steps:
        for k in range(0, len(units), micro_batch_size):
            lengths = row_lengths(examples, batch_rows(examples, units[k:k + micro_batch_size], packing))
            width = padded_width(lengths, pad_multiple, seq_len)
            rows, capacity, real = rows + len(lengths), capacity + width * len(lengths), real + sum(lengths)
    return rows, (real / capacity if capacity else 0.0)


def step_context(units: list[list[Example]], step: int) -> StepContext:
    """What a loss needs to know of a whole step's global batch (its units' examples): label tokens, counts."""
    seqs = [s for unit in units for e in unit for s in e.sequences]
    counted = [(s.role, sum(1 for label in s.labels if label != IGNORE_INDEX)) for s in seqs]
    return StepContext(label_tokens=sum(n for _, n in counted), sequences=len(seqs), examples=sum(len(u) for u in units),
                       step=step, counts={"chosen_label_tokens": sum(n for role, n in counted if role == 0)})


def collate(examples: list[Example], units: list[list[int]], pad_id: int, packing: bool, pad_multiple: int = 1,
            max_width: int = 0) -> dict[str, Any]:
    """Make one micro-batch (see the contract in toolkit.contracts) from units of example indices.

    Rows are right-padded to the longest one, rounded up to ``pad_multiple`` (at most ``max_width``):
    fewer distinct shapes for compiled kernels on a GPU.
    """
    import torch

    rows = batch_rows(examples, units, packing)
    width = padded_width(row_lengths(examples, rows), pad_multiple, max_width)
    shape = (len(rows), width)
    input_ids = torch.full(shape, pad_id, dtype=torch.long)
    labels = torch.full(shape, IGNORE_INDEX, dtype=torch.long)
    position_ids = torch.zeros(shape, dtype=torch.long)
    sequence_ids = torch.full(shape, -1, dtype=torch.long)
    example_ids, roles, meta_rows = [], [], []
    local_example = {}
    for r, row in enumerate(rows):
        offset = 0
        for i, j in row:
            seq = examples[i].sequences[j]
            n = len(seq.input_ids)
            s = len(example_ids)
            input_ids[r, offset:offset + n] = torch.tensor(seq.input_ids)
            labels[r, offset:offset + n] = torch.tensor(seq.labels)
            position_ids[r, offset:offset + n] = torch.arange(n)
            sequence_ids[r, offset:offset + n] = s
            example_ids.append(local_example.setdefault(i, len(local_example)))
            roles.append(seq.role)
            meta_rows.append(seq.meta)
            offset += n
    meta = {"example_ids": torch.tensor(example_ids), "roles": torch.tensor(roles)}
    for key in sorted({k for m in meta_rows for k in m}):
        meta[key] = torch.tensor([float(m.get(key, 0.0)) for m in meta_rows])
    meta["dataset_index"] = torch.tensor([i for row in rows for i, _ in row])
    return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids, "sequence_ids": sequence_ids,
            "sequence_meta": meta, "num_sequences": len(example_ids)}


class Batches:
    """Deterministic per-step micro-batches for one data-parallel rank."""

    def __init__(self, examples: list[Example], *, seed: int, seq_len: int, packing: bool, micro_batch_size: int,
                 global_batch_size: int, dp_rank: int, dp_world_size: int, pad_id: int, group_by_length: bool = False,
                 pad_multiple: int = 1):
        """``group_by_length`` (without packing): micro-batches of similar lengths; ``pad_multiple``: rows padded
        to a multiple of it (at most ``seq_len``)."""
        self.examples = examples
        self.seed, self.seq_len, self.packing = seed, seq_len, packing
        self.pad_multiple = pad_multiple
        # the grouping depends on the global batch only, so accumulation and DP still see the same steps
        self.group = 0 if packing or not group_by_length else global_batch_size or micro_batch_size * dp_world_size
        self.micro_batch_size, self.dp_rank, self.dp_world_size = micro_batch_size, dp_rank, dp_world_size
        self.global_batch_size = global_batch_size or micro_batch_size * dp_world_size
        self.pad_id = pad_id
        per_step = micro_batch_size * dp_world_size
        if self.global_batch_size % per_step:
            raise ConfigError(f"--global-batch-size {self.global_batch_size} must be a multiple of --micro-batch-size "
                              f"{micro_batch_size} x data-parallel ranks {dp_world_size} = {per_step}")
        self.accumulation = self.global_batch_size // per_step
        self._epoch_cache: OrderedDict[int, list[list[int]]] = OrderedDict()  # the two epochs a step may span
        self._epoch_starts = [0]  # where each epoch's units begin in the sequence of all epochs (as far as counted)
        if len(self.units(0)) < self.global_batch_size:
            raise DataError(f"the dataset gives {len(self.units(0))} {'packed rows' if packing else 'examples'}, fewer than one "
                            f"global batch ({self.global_batch_size}); lower --global-batch-size or add data")
        # steps that train every unit of epoch 0 (the last one completed by the first units of epoch 1)
        self.steps_per_epoch = -(-len(self.units(0)) // self.global_batch_size)

    def units(self, epoch: int) -> list[list[int]]:
        if epoch not in self._epoch_cache:
            order = list(range(len(self.examples)))
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
            self._epoch_cache[epoch] = build_units(self.examples, order, self.seq_len, self.packing, self.group)
            while len(self._epoch_cache) > 2:
                self._epoch_cache.popitem(last=False)
        return self._epoch_cache[epoch]

    def _epoch_start(self, epoch: int) -> int:
        """Units of all epochs before ``epoch`` (packing gives each epoch's order its own number of rows)."""
        while len(self._epoch_starts) <= epoch:
            count = len(self.examples) if not self.packing else len(self.units(len(self._epoch_starts) - 1))
            self._epoch_starts.append(self._epoch_starts[-1] + count)
        return self._epoch_starts[epoch]

    def _locate(self, position: int) -> tuple[int, int]:
        """(epoch, unit within it) of unit ``position`` of the epochs' units laid end to end."""
        if not self.packing:
            return divmod(position, len(self.examples))
        epoch = 0
        while self._epoch_start(epoch + 1) <= position:
            epoch += 1
        return epoch, position - self._epoch_start(epoch)

    def steps_for(self, epochs: float) -> int:
        """Optimizer steps that train ``epochs`` epochs: every unit of each whole epoch (the step that ends an
        epoch takes the first units of the next one to stay a full global batch), a fraction of the last."""
        whole = int(epochs)
        units = self._epoch_start(whole) + (epochs - whole) * (self._epoch_start(whole + 1) - self._epoch_start(whole))
        return max(1, math.ceil(units / self.global_batch_size - 1e-9))

    def step_units(self, step: int) -> list[list[int]]:
        """The units of a (0-based) step's global batch: the epochs' units laid end to end, ``global_batch_size``
        a step, so no unit is left out at an epoch's end; an epoch's last step is completed with the first units of
        the next epoch (whose own steps then continue after them)."""
        units = []
        position, end = step * self.global_batch_size, (step + 1) * self.global_batch_size
        while position < end:
            epoch, index = self._locate(position)
            taken = self.units(epoch)[index:index + end - position]
            units.extend(taken)
            position += len(taken)
        return units

    def context(self, step: int) -> StepContext:
        units = self.step_units(step)
        return step_context([[self.examples[i] for i in u] for u in units], step)

    def micro_batches(self, step: int) -> list[dict[str, Any]]:
        units = self.step_units(step)
        per_rank = self.micro_batch_size * self.accumulation
        mine = units[self.dp_rank * per_rank:(self.dp_rank + 1) * per_rank]
        return [collate(self.examples, mine[k:k + self.micro_batch_size], self.pad_id, self.packing, self.pad_multiple,
                        self.seq_len) for k in range(0, len(mine), self.micro_batch_size)]

    def step_sources(self, step: int) -> list[str]:
        """Where the examples of a (0-based) step's global batch came from ("file, line N")."""
        return [self.examples[i].source or f"example {i}" for unit in self.step_units(step) for i in unit]

    def state(self) -> dict[str, Any]:
        """What a checkpoint must keep to continue this order (nothing: it is a function of the seed)."""
        return {}

    def restore(self, state: dict[str, Any]) -> None:
        """The order is a pure function of the seed and epoch: nothing to restore."""

    def epoch_fill(self, epoch: int = 0) -> tuple[int, float]:
        """Rows of the epoch's steps and the share of their padded width (:func:`row_fill`) that real tokens fill."""
        steps = range(epoch * self.steps_per_epoch, (epoch + 1) * self.steps_per_epoch)
        return row_fill(self.examples, [self.step_units(step) for step in steps], self.micro_batch_size, self.packing,
                        self.seq_len, self.pad_multiple)
