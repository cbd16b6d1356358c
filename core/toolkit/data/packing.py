"""How examples become rows: best-fit-decreasing packing, length-grouped micro-batches, PT rows cut from a token stream.

Every function here is a pure function of its inputs (the epoch's seeded order among them), so the
rows of any step can be rebuilt on resume. Written by hand because no maintained library packs
*within a bounded window of a seeded order* (TRL's ``pack_dataset(strategy="bfd")`` packs a whole
``datasets.Dataset`` at once and keeps no order to resume into).
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Sequence as Seq

from toolkit.contracts import IGNORE_INDEX, Example, Sequence

PACKING_WINDOW = 8192
"""Examples considered together by best-fit decreasing: large enough that the packer finds partners for
long samples (about 98% fill on long-tailed chat sets), small enough that it stays a local reordering."""

GROUP_WINDOW_BATCHES = 64
"""Length grouping sorts this many global batches' worth of examples at a time."""


def example_size(example: Example) -> int:
    return sum(len(s.input_ids) for s in example.sequences)


def best_fit_decreasing(sizes: Seq[int], indices: list[int], capacity: int) -> list[list[int]]:
    """Bins of ``indices`` (each bin's sizes summing to at most ``capacity``), longest first, each into the
    fullest bin it still fits (a new one if none): the classic BFD heuristic, ``O(n log n)`` with the
    bins' free space kept sorted."""
    order = sorted(indices, key=lambda i: (-sizes[i], i))
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (free space, bin number), ascending
    for i in order:
        size = min(sizes[i], capacity)
        slot = bisect.bisect_left(free, (size, -1))
        if slot == len(free):
            bins.append([i])
            bisect.insort(free, (capacity - size, len(bins) - 1))
            continue
        space, number = free.pop(slot)
        bins[number].append(i)
        bisect.insort(free, (space - size, number))
    return bins


def pack_rows(examples: list[Example], order: list[int], seq_len: int, window: int = PACKING_WINDOW) -> list[list[int]]:
    """Rows of packed examples: best-fit decreasing within consecutive windows of the seeded ``order``,
    then the rows of each window in a seeded order of their own (so long rows do not all come first)."""
    sizes = [example_size(e) for e in examples]
    rows: list[list[int]] = []
    for start in range(0, len(order), window):
        part = order[start:start + window]
        packed = best_fit_decreasing(sizes, part, seq_len)
        random.Random(part[0] * 7919 + len(part)).shuffle(packed)
        rows.extend(packed)
    return rows


LENGTH_BUCKET = 64
"""Tokens per length bucket of the grouping: samples within one bucket pad to the same GPU row width anyway
(rows are padded to a multiple of 64 there), so their order inside it is left random."""


def group_by_length(examples: list[Example], order: list[int], group: int) -> list[list[int]]:
    """One example per unit, with units of similar length next to each other: windows of
    ``GROUP_WINDOW_BATCHES * group`` examples of ``order`` are sorted by length bucket (ties keep the seeded
    ``order``, so which samples share a batch changes every epoch) and cut into runs of ``group`` (one global
    batch), and those runs are shuffled (seeded by the window), so each micro-batch pads to a near-equal
    length while batches still come in a random order."""
    sizes = [example_size(e) for e in examples]
    units: list[list[int]] = []
    span = GROUP_WINDOW_BATCHES * group
    for start in range(0, len(order), span):
        part = order[start:start + span]
        rank = {i: k for k, i in enumerate(part)}
        part = sorted(part, key=lambda i: (-(sizes[i] // LENGTH_BUCKET), rank[i]))
        runs = [part[k:k + group] for k in range(0, len(part), group)]
        full, rest = [r for r in runs if len(r) == group], [r for r in runs if len(r) < group]
        random.Random(part[0] * 104729 + len(part)).shuffle(full)
        units.extend([i] for run in full + rest for i in run)
    return units


def stream_rows(examples: list[Example], seq_len: int, isolate_documents: bool) -> list[Example]:
    """PT rows cut from the documents joined in order into one token stream: every row holds ``seq_len``
    tokens (the last one what is left), and every token of the corpus is a label exactly once.

    A document's own last label (after its EOS) becomes the next document's first token, as in Megatron's
    GPT pretraining, unless ``isolate_documents``: then each row keeps one sequence per document piece
    (attention and positions restart at each document, the block-causal mask of packed rows) and no label
    crosses a document boundary. Labels are already shifted, so a cut anywhere keeps them right: the
    label at a row's last position is the first token of the next row.
    """
    ids: list[int] = []
    labels: list[int] = []
    starts: list[int] = []  # where each document begins in the stream
    for example in examples:
        seq = example.sequences[0]
        if ids and not isolate_documents and labels[-1] == IGNORE_INDEX and seq.input_ids:
            labels[-1] = seq.input_ids[0]
        starts.append(len(ids))
        ids.extend(seq.input_ids)
        labels.extend(seq.labels)
    rows = []
    boundaries = set(starts)
    for begin in range(0, len(ids), seq_len):
        end = min(begin + seq_len, len(ids))
        cuts = [begin] + [b for b in range(begin + 1, end) if b in boundaries] + [end] if isolate_documents else [begin, end]
        first = bisect.bisect_right(starts, begin) - 1
        source = examples[first].source + (f" and {len(cuts) - 2} more documents" if len(cuts) > 2 else "")
        rows.append(Example([Sequence(ids[a:b], labels[a:b]) for a, b in zip(cuts, cuts[1:])], kind="lm", source=source))
    return rows
