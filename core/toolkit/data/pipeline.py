"""From records to micro-batches: encode, truncate, filter, pack, shuffle by seed, shard over DP ranks.

The order of every epoch is a pure function of (seed, epoch), and each optimizer step takes a
fixed slice of it, so resuming at step N continues at exactly the sample it stopped at.
"""

from __future__ import annotations

import random
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
    left_over_per_epoch: int = 0
    """Examples of each epoch after its last full global batch (set by the runner; different ones each epoch)."""
    per_file: dict[str, int] = field(default_factory=dict)

    def summary(self) -> str:
        text = f"{self.examples} examples from {self.records} records"
        if self.truncated:
            text += f"; {self.truncated} sequences truncated to --seq-len"
        if self.dropped_no_labels:
            text += f"; {self.dropped_no_labels} examples dropped (no trainable tokens left)"
        if self.left_over_per_epoch:
            text += (f"; {self.left_over_per_epoch} examples per epoch left over after the last full global batch "
                     "(other ones each epoch)")
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
                  manager: Any = None, options: dict[str, Any] | None = None, packing: bool = False) -> tuple[list[Example], DataStats]:
    """Read and encode every dataset; report problems with file and line."""
    from toolkit.plugins import get_plugin_manager

    manager = manager or get_plugin_manager()
    template = ChatTemplate(tokenizer, train_on=train_on)
    stats = DataStats()
    examples: list[Example] = []
    for reference in datasets:
        path, records = read_records(reference, limit=max_samples)
        if not records:
            raise DataError(f"{path} holds no records")
        rename = {theirs: ours for ours, theirs in (columns or {}).items()}
        first = {rename.get(k, k): v for k, v in records[0].items() if k != "__line__"}
        fmt = pick_format(dataset_format, list(first), str(path), manager, options)
        if fmt.example_kind not in example_kinds:
            raise ConfigError(f"{path} is in format {fmt.name!r} ({fmt.example_kind} examples), but the loss needs "
                              f"{' or '.join(example_kinds)} examples. Pick a matching --dataset or loss.")
        for index, record in enumerate(records):
            where = f"{path}, line {record.get('__line__', index + 1)}"
            record = {rename.get(k, k): v for k, v in record.items() if k != "__line__"}
            try:
                example = truncate(fmt.encode(record, tokenizer, template, where=where), seq_len, stats, packing)
            except DataError as exc:  # every record-level problem names the file and line
                if where in str(exc):
                    raise
                raise DataError(f"{where}: {exc}") from exc
            example.source = where
            if any(all(label == IGNORE_INDEX for label in seq.labels) for seq in example.sequences):
                stats.dropped_no_labels += 1
                continue
            examples.append(example)
        stats.records += len(records)
        stats.per_file[str(path)] = len(records)
    stats.examples = len(examples)
    if not examples:
        raise DataError(f"no trainable examples left in {', '.join(datasets)} after encoding and filtering "
                        f"({stats.records} records; {stats.dropped_no_labels} had no trainable tokens within --seq-len {seq_len})")
    return examples, stats


def build_units(examples: list[Example], order: list[int], seq_len: int, packing: bool) -> list[list[int]]:
    """Group example indices into units: one example each, or greedily packed rows of <= seq_len tokens."""
    if not packing:
        return [[i] for i in order]
    units: list[list[int]] = []
    current: list[int] = []
    used = 0
    for i in order:
        size = sum(len(s.input_ids) for s in examples[i].sequences)
        if current and used + size > seq_len:
            units.append(current)
            current, used = [], 0
        current.append(i)
        used += size
    if current:
        units.append(current)
    return units


def collate(examples: list[Example], units: list[list[int]], pad_id: int, packing: bool) -> dict[str, Any]:
    """Make one micro-batch (see the contract in toolkit.contracts) from units of example indices."""
    import torch

    rows: list[list[tuple[int, int]]] = []  # (example index, sequence index within example)
    for unit in units:
        if packing:
            rows.append([(i, j) for i in unit for j in range(len(examples[i].sequences))])
        else:
            rows.extend([(i, j)] for i in unit for j in range(len(examples[i].sequences)))
    width = max(sum(len(examples[i].sequences[j].input_ids) for i, j in row) for row in rows)
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
                 global_batch_size: int, dp_rank: int, dp_world_size: int, pad_id: int):
        self.examples = examples
        self.seed, self.seq_len, self.packing = seed, seq_len, packing
        self.micro_batch_size, self.dp_rank, self.dp_world_size = micro_batch_size, dp_rank, dp_world_size
        self.global_batch_size = global_batch_size or micro_batch_size * dp_world_size
        self.pad_id = pad_id
        per_step = micro_batch_size * dp_world_size
        if self.global_batch_size % per_step:
            raise ConfigError(f"--global-batch-size {self.global_batch_size} must be a multiple of --micro-batch-size "
                              f"{micro_batch_size} x data-parallel ranks {dp_world_size} = {per_step}")
        self.accumulation = self.global_batch_size // per_step
        self._epoch_cache: tuple[int, list[list[int]]] | None = None
        self.steps_per_epoch = len(self.units(0)) // self.global_batch_size
        if self.steps_per_epoch == 0:
            raise DataError(f"the dataset gives {len(self.units(0))} {'packed rows' if packing else 'examples'}, fewer than one "
                            f"global batch ({self.global_batch_size}); lower --global-batch-size or add data")

    def units(self, epoch: int) -> list[list[int]]:
        if self._epoch_cache is None or self._epoch_cache[0] != epoch:
            order = list(range(len(self.examples)))
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
            self._epoch_cache = (epoch, build_units(self.examples, order, self.seq_len, self.packing))
        return self._epoch_cache[1]

    def left_over_examples(self, epoch: int) -> int:
        """Examples of an epoch that no step takes: those after its last full global batch."""
        return sum(len(unit) for unit in self.units(epoch)[self.steps_per_epoch * self.global_batch_size:])

    def step_units(self, step: int) -> list[list[int]]:
        epoch, index = divmod(step, self.steps_per_epoch)
        start = index * self.global_batch_size
        return self.units(epoch)[start:start + self.global_batch_size]

    def context(self, step: int) -> StepContext:
        units = self.step_units(step)
        seqs = [s for u in units for i in u for s in self.examples[i].sequences]
        counted = [(s.role, sum(1 for label in s.labels if label != IGNORE_INDEX)) for s in seqs]
        tokens = sum(n for _, n in counted)
        chosen = sum(n for role, n in counted if role == 0)
        return StepContext(label_tokens=tokens, sequences=len(seqs), examples=sum(len(u) for u in units), step=step,
                           counts={"chosen_label_tokens": chosen})

    def micro_batches(self, step: int) -> list[dict[str, Any]]:
        units = self.step_units(step)
        per_rank = self.micro_batch_size * self.accumulation
        mine = units[self.dp_rank * per_rank:(self.dp_rank + 1) * per_rank]
        return [collate(self.examples, mine[k:k + self.micro_batch_size], self.pad_id, self.packing)
                for k in range(0, len(mine), self.micro_batch_size)]
