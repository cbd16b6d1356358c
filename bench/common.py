"""Pieces the benchmark scripts share: a micro-batch of full rows and the results table."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch


def full_rows(ids: torch.Tensor) -> dict:
    """A micro-batch (the core's contract) where each row is one sequence and every token trains."""
    b, t = ids.shape
    labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)
    return {"input_ids": ids, "labels": labels, "position_ids": torch.arange(t, device=ids.device).expand(b, t),
            "sequence_ids": torch.arange(b, device=ids.device)[:, None].expand(b, t).contiguous(),
            "sequence_meta": {}, "num_sequences": b}


def packed_rows(ids: torch.Tensor, lengths: list[list[int]]) -> dict:
    """A micro-batch where row ``r`` holds samples of ``lengths[r]`` tokens (summing to the row): positions restart
    and labels are next tokens within each sample."""
    labels = torch.full_like(ids, -100)
    positions, sequence_ids = torch.zeros_like(ids), torch.zeros_like(ids)
    count = 0
    for r, row in enumerate(lengths):
        offset = 0
        for n in row:
            labels[r, offset:offset + n - 1] = ids[r, offset + 1:offset + n]
            positions[r, offset:offset + n] = torch.arange(n)
            sequence_ids[r, offset:offset + n] = count
            count, offset = count + 1, offset + n
    return {"input_ids": ids, "labels": labels, "position_ids": positions, "sequence_ids": sequence_ids,
            "sequence_meta": {}, "num_sequences": count}


def report(title: str, rows: list[dict], out_name: str) -> None:
    """Print ``rows`` (run, tokens_per_s, peak_gib) as a table; write them to $OUT/<out_name> when OUT is set."""
    print(f"\n{title}")
    print(f"{'run':62s} {'tokens/s':>10s} {'peak GiB':>9s}")
    for row in rows:
        print(f"{row['run']:62s} {row['tokens_per_s']:10.0f} {row['peak_gib']:9.1f}")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], out_name).write_text(json.dumps(rows, indent=2))


def run_all(runs: list, device: str, **fields) -> list[dict]:
    """Run each ``(name, fn -> (tokens_per_s, peak_gib))`` in turn, freeing memory between runs."""
    import gc

    rows = []
    for name, run in runs:
        tokens_per_s, peak = run()
        rows.append({"run": name, "tokens_per_s": tokens_per_s, "peak_gib": peak, **fields})
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def shape_parser(batch: int | None = 4, seq: int = 4096, steps: int = 8, warmup: int = 3) -> Any:
    """The flags every throughput script takes: --tiny, --batch (unless None), --seq, --steps, --warmup."""
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--tiny", action="store_true")
    if batch is not None:
        parser.add_argument("--batch", type=int, default=batch)
    parser.add_argument("--seq", type=int, default=seq)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--warmup", type=int, default=warmup)
    return parser
