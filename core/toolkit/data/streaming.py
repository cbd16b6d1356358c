"""``--streaming``: datasets too large to hold in memory, read through ``datasets``' streaming mode a window at a time.

The stream is cut into windows of ``window`` records, in file order (datasets one after another). Each window is
encoded, truncated or cut into PT rows, and grouped into units (best-fit packed rows, length-grouped or single
examples) with a seed of its own, then its units are shuffled; the units of all windows, pass after pass over the
data, form one sequence, and step ``s`` takes units ``[s * G, (s + 1) * G)`` of it, as :class:`Batches` does for
one epoch. Nothing depends on what was read before a window except the count of units each earlier window gave;
those counts go into every checkpoint (:meth:`StreamBatches.state`), so a resume skips straight to the window it
needs (``IterableDataset.skip``, which parses but does not tokenize) and continues at exactly the same row.
Only two windows are held at a time. Written here because ``datasets``' own shuffle buffer and
``state_dict`` resume per record, not per packed row of a seeded window.

With ``--dataset-ratios`` each dataset is its own stream and the windows are drawn from them: record ``k`` of
window ``w`` comes from dataset ``i`` with probability ``ratio_i / sum(ratios)``, the draws a pure function of
(seed, w), so where each dataset stands at any window is known without reading. Each dataset restarts when it is
used up (``interleave_datasets``' "all_exhausted" with probabilities, without its end: the mix is an endless stream
that ``--max-steps`` cuts). Not ``interleave_datasets`` itself: it needs one schema, where mixed sets may differ in
format, and its resume is per record; here a resume re-reads one window per dataset with ``IterableDataset.skip``.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from typing import Any

from toolkit.contracts import Example, StepContext
from toolkit.errors import ConfigError, DataError

STREAM_WINDOW = 4096
"""Records per window (the unit of reading, packing and resuming)."""


class StreamBatches:
    """Per-step micro-batches for one data-parallel rank from a stream (the interface of :class:`Batches`)."""

    def __init__(self, datasets: list[str], encode: Any, *, seed: int, seq_len: int, packing: bool, micro_batch_size: int,
                 global_batch_size: int, dp_rank: int, dp_world_size: int, pad_id: int, max_steps: int,
                 group_by_length: bool = True, pad_multiple: int = 1, window: int = 0, ratios: list[float] | None = None):
        """``encode(records, where)``: encoded, truncated examples of a list of records (the pipeline's rules);
        ``ratios`` (one per dataset): draw the stream from the datasets in these proportions."""
        if not max_steps:
            raise ConfigError("--streaming needs --max-steps: a stream's length is not known before it is read",
                              source="--streaming")
        if ratios:
            from toolkit.data.pipeline import check_ratios

            check_ratios(ratios, len(datasets))
        self.datasets, self.encode, self.ratios = datasets, encode, list(ratios or [])
        self.dataset_lengths: dict[int, int] = {}  # records of each mixed dataset, once it has been read to its end
        self._draw_offsets: list[list[int]] = []  # where each mixed dataset stands at the start of each window
        self.seed, self.seq_len, self.packing, self.window = seed, seq_len, packing, window or STREAM_WINDOW
        self.micro_batch_size, self.dp_rank, self.dp_world_size = micro_batch_size, dp_rank, dp_world_size
        self.global_batch_size = global_batch_size or micro_batch_size * dp_world_size
        per_step = micro_batch_size * dp_world_size
        if self.global_batch_size % per_step:
            raise ConfigError(f"--global-batch-size {self.global_batch_size} must be a multiple of --micro-batch-size "
                              f"{micro_batch_size} x data-parallel ranks {dp_world_size} = {per_step}")
        self.accumulation = self.global_batch_size // per_step
        self.group = 0 if packing or not group_by_length else self.global_batch_size
        self.pad_id, self.pad_multiple = pad_id, pad_multiple
        self.steps_per_epoch = max_steps  # unknown for a stream: "epoch" in the metrics is the run's fraction
        self.window_units: list[int] = []  # units each window gave, in stream order (pass after pass)
        self.windows_per_pass: int | None = None
        self._held: OrderedDict[int, tuple[list[Example], list[list[int]]]] = OrderedDict()

    # ------------------------------------------------------------------ the stream
    def _window(self, number: int) -> tuple[list[Example], list[list[int]]]:
        """Window ``number`` of the stream (counting over passes): its examples and shuffled units."""
        if number in self._held:
            return self._held[number]
        passes, local = divmod(number, self.windows_per_pass) if self.windows_per_pass else (0, number)
        from toolkit.data.reading import stream_records

        records = []
        if self.ratios:
            records = self._mixed_window(number)
        else:
            for where, record in stream_records(self.datasets, skip=local * self.window):
                records.append((where, record))
                if len(records) == self.window:
                    break
        if not records:
            if local == 0:
                raise DataError(f"{', '.join(self.datasets)} holds no records")
            self.windows_per_pass = local
            return self._window(number)
        examples = self.encode(records)
        if not examples:
            raise DataError(f"window {local} of the stream ({records[0][0]} on) gave no trainable examples")
        from toolkit.data.pipeline import build_units

        order = list(range(len(examples)))
        rng = random.Random((self.seed * 1_000_003 + passes) * 7_919 + local)
        rng.shuffle(order)
        units = build_units(examples, order, self.seq_len, self.packing, self.group)
        if self.group:  # keep whole global batches together when grouped; shuffle otherwise
            runs = [units[k:k + self.group] for k in range(0, len(units), self.group)]
            rng.shuffle(runs)
            units = [u for run in runs for u in run]
        else:
            rng.shuffle(units)
        if len(records) < self.window and self.windows_per_pass is None:
            self.windows_per_pass = local + 1
        self._held[number] = (examples, units)
        while len(self._held) > 2:
            self._held.popitem(last=False)
        return examples, units

    # ------------------------------------------------------------------ --dataset-ratios
    def _draws(self, number: int) -> list[int]:
        """The dataset each record of window ``number`` of the mix comes from (seeded by the window alone)."""
        rng = random.Random((self.seed * 1_000_003 + number) * 6_700_417 + 31)
        return rng.choices(range(len(self.datasets)), weights=self.ratios, k=self.window)

    def _offsets(self, number: int) -> list[int]:
        """Records each mixed dataset gave before window ``number`` (counted over its restarts)."""
        if not self._draw_offsets:
            self._draw_offsets.append([0] * len(self.datasets))
        while len(self._draw_offsets) <= number:
            counts = list(self._draw_offsets[-1])
            for i in self._draws(len(self._draw_offsets) - 1):
                counts[i] += 1
            self._draw_offsets.append(counts)
        return self._draw_offsets[number]

    def _cycle(self, i: int, start: int, count: int) -> list[tuple[str, dict[str, Any]]]:
        """Records ``[start, start + count)`` of dataset ``i`` repeated end to end (its length learnt when first
        read to the end: a dataset's reads never pass its end unnoticed, and the lengths go into checkpoints)."""
        from toolkit.data.reading import stream_records

        taken: list[tuple[str, dict[str, Any]]] = []
        while len(taken) < count:
            length = self.dataset_lengths.get(i)
            position = start % length if length else start
            got = 0
            for item in stream_records([self.datasets[i]], skip=position):
                taken.append(item)
                got += 1
                if len(taken) == count:
                    break
            else:
                if length is None:
                    self.dataset_lengths[i] = position + got
                if not self.dataset_lengths[i]:
                    raise DataError(f"{self.datasets[i]} holds no records (given ratio {self.ratios[i]} in --dataset-ratios)")
            start += got
        return taken

    def _mixed_window(self, number: int) -> list[tuple[str, dict[str, Any]]]:
        """Window ``number`` of the ``--dataset-ratios`` mix: each record from the dataset its draw names."""
        draws, offsets = self._draws(number), self._offsets(number)
        per_dataset = {i: iter(self._cycle(i, offsets[i], draws.count(i))) for i in sorted(set(draws))}
        return [next(per_dataset[i]) for i in draws]

    def _locate(self, position: int) -> tuple[int, int]:
        """(window number, unit within it) of unit ``position`` of the whole stream."""
        number, start = 0, 0
        while True:
            if number == len(self.window_units):
                self.window_units.append(len(self._window(number)[1]))
            if position < start + self.window_units[number]:
                return number, position - start
            start += self.window_units[number]
            number += 1

    def step_items(self, step: int) -> list[tuple[Example, ...]]:
        """The examples of each unit of the step's global batch."""
        items = []
        for position in range(step * self.global_batch_size, (step + 1) * self.global_batch_size):
            number, index = self._locate(position)
            examples, units = self._window(number)
            items.append(tuple(examples[i] for i in units[index]))
        return items

    # ------------------------------------------------------------------ what the runner asks
    def micro_batches(self, step: int) -> list[dict[str, Any]]:
        from toolkit.data.pipeline import collate

        items = self.step_items(step)
        per_rank = self.micro_batch_size * self.accumulation
        mine = items[self.dp_rank * per_rank:(self.dp_rank + 1) * per_rank]
        batches = []
        for k in range(0, len(mine), self.micro_batch_size):
            examples = [e for unit in mine[k:k + self.micro_batch_size] for e in unit]
            units, start = [], 0
            for unit in mine[k:k + self.micro_batch_size]:
                units.append(list(range(start, start + len(unit))))
                start += len(unit)
            batches.append(collate(examples, units, self.pad_id, self.packing, self.pad_multiple, self.seq_len))
        return batches

    def context(self, step: int) -> StepContext:
        from toolkit.data.pipeline import step_context

        return step_context([list(unit) for unit in self.step_items(step)], step)

    def step_sources(self, step: int) -> list[str]:
        return [e.source for unit in self.step_items(step) for e in unit]

    def steps_for(self, epochs: float) -> int:
        """A stream's length is unknown before it is read: ``--max-steps`` is the run's length."""
        return self.steps_per_epoch

    def epoch_fill(self, epoch: int = 0) -> tuple[int, float]:
        """Rows and fill of the first window's units (a stream is not read ahead)."""
        from toolkit.data.pipeline import row_fill

        examples, units = self._window(0)
        return row_fill(examples, [units], self.micro_batch_size, self.packing, self.seq_len, self.pad_multiple)

    def state(self) -> dict[str, Any]:
        return {"stream_window_units": list(self.window_units), "stream_windows_per_pass": self.windows_per_pass,
                "stream_dataset_lengths": {str(i): n for i, n in self.dataset_lengths.items()}}

    def restore(self, state: dict[str, Any]) -> None:
        self.window_units = list(state.get("stream_window_units", []))
        self.windows_per_pass = state.get("stream_windows_per_pass")
        self.dataset_lengths = {int(i): n for i, n in state.get("stream_dataset_lengths", {}).items()}
