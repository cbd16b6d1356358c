"""Figures of the GPU benchmark results in bench/results/: tokens/s and peak memory per configuration.

    pip install -e '.[bench]'                  # matplotlib, outside the toolkit's own dependencies
    python bench/plot_results.py               # newest file of each kind -> docs/img/<kind>.png
    python bench/plot_results.py bench/results/speed-h200-2026-11-30.json --out /tmp/img

Reads ``speed-*.json`` (bench/speed.py), ``fsdp_2gpu-*.json`` (bench/fsdp_2gpu.py), ``moe-*.json``
(bench/moe.py) and ``megatron_speed-*.json`` (bench/scaling.py's speed cases); file names are
``<kind>-<gpu>-<date>.json``. Each figure has two panels side by side, tokens/s and peak GiB
(``torch.cuda.max_memory_allocated``, per GPU), one bar per configuration; the baseline of each group
is grey, with a dashed line at its value across the group, and every other bar says its ratio to it.
"""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
IMAGES = HERE.parent / "docs" / "img"
KINDS = ("speed", "fsdp_2gpu", "moe", "megatron_speed")


@dataclass
class Bar:
    label: str
    tokens_per_s: float
    peak_gib: float
    group: str
    """Configurations compared with the same baseline (full SFT against HF, LoRA against HF + PEFT, packed rows
    against HF's own packed handling)."""
    baseline: bool = False
    default: bool = False
    """The toolkit's own defaults (no speed flags), drawn in their own colour."""


@dataclass
class Figure:
    kind: str
    title: str
    tokens_label: str
    bars: list[Bar]


def file_facts(path: Path) -> tuple[str, str, str]:
    """(kind, gpu, date) from ``<kind>-<gpu>-<YYYY-MM-DD>.json``; a script's own output (``speed.json``)
    gives its kind only."""
    match = re.fullmatch(r"(?P<kind>[a-z0-9_]+)-(?P<gpu>.+?)-(?P<date>\d{4}-\d{2}-\d{2})", path.stem)
    if not match:
        return path.stem.split("-", 1)[0], "?", "date ?"
    return match["kind"], match["gpu"], match["date"]


def speed_bars(data: dict) -> list[Bar]:
    bars = []
    for row in data["rows"]:
        if row.get("failed") or row["tokens_per_s"] != row["tokens_per_s"]:
            continue
        name = row["run"]
        label = f"{name.removeprefix('best:')} ({data.get('long_steps', '?')}-step run)" if name.startswith("best:") else name
        group = "lora" if row["kind"] in ("lora", "hf-peft") else "packed" if "packed" in row["kind"] else "full"
        bars.append(Bar(label, row["tokens_per_s"], row["peak_gib"], group,
                        baseline=row["kind"] in ("hf", "hf-peft", "hf-packed") and not row["options"],
                        default=row["kind"] in ("full", "lora", "packed") and "defaults" in name))
    return bars


def figure_of(path: Path) -> Figure:
    kind, gpu, date = file_facts(path)
    data = json.loads(path.read_text())
    if kind == "speed":
        device = next((r.get("device") for r in data["rows"] if r.get("device")), gpu)
        return Figure(kind, f"local engine speed levers vs HF (+ PEFT): {data['shape']}, batch {data['batch']} x seq "
                            f"{data['seq']} - {device}, {data['date']}", "tokens/s", speed_bars(data))
    if kind == "fsdp_2gpu":
        args = data["args"]
        bars = [Bar(r["run"], r["tokens_per_s"], r["peak_gib"], "all", baseline=r["case"] == "ddp") for r in data["rows"]]
        return Figure(kind, f"2-GPU data parallel, 1.24B Llama, {args['batch']} x seq {args['seq']} per GPU, "
                            f"{args['precision']} - {gpu}, {date}", "tokens/s (both GPUs)", bars)
    if kind == "moe":
        meta = data["meta"]
        bars = [Bar(r["case"], r["tokens_per_s"], r["peak_gib"], "all", baseline=r["case"] == "hf")
                for r in data["results"] if r.get("tokens_per_s")]
        return Figure(kind, f"MoE full SFT, Qwen3-30B-A3B layers x {meta['layers']}, batch {meta['batch_per_gpu']} x seq "
                            f"{meta['seq']} - {meta['device']}, {date}", "tokens/s", bars)
    if kind == "megatron_speed":
        bars = [Bar(c["case"].split("/", 1)[-1], c["tokens_per_s"], c["peak_gib"], "all", baseline=c["layout"] == "hf")
                for c in data["cases"] if c.get("status") == "ok"]
        shape = next(iter(data["shapes"].values()))
        return Figure(kind, f"megatron strategy (TP1) vs HF, 1.24B Llama, batch {shape['micro_batch']} x seq {shape['seq']} "
                            f"- {gpu}, {data['gpus']} GPU, {date}", "tokens/s", bars)
    raise SystemExit(f"{path}: no figure for result kind {kind!r} (known: {', '.join(KINDS)})")


def draw(figure: Figure, target: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:
        raise SystemExit("plotting needs matplotlib, which the toolkit does not depend on: "
                         "pip install -e '.[bench]' (or pip install matplotlib)") from None
    groups = list(dict.fromkeys(b.group for b in figure.bars))
    bars = sorted(figure.bars, key=lambda b: (groups.index(b.group), not b.baseline))  # each baseline heads its group
    colours = ["#9e9e9e" if b.baseline else "#2ca02c" if b.default else "#1f77b4" for b in bars]
    labels = [b.label + (" (baseline)" if b.baseline else "") for b in bars]
    fig, panels = plt.subplots(1, 2, figsize=(14, 0.5 * len(bars) + 2.2), sharey=True)
    for panel, field, unit in ((panels[0], "tokens_per_s", figure.tokens_label),
                               (panels[1], "peak_gib", "peak GiB per GPU (max_memory_allocated)")):
        values = [getattr(b, field) for b in bars]
        panel.barh(range(len(bars)), values, color=colours)
        for group in dict.fromkeys(b.group for b in bars):
            rows = [i for i, b in enumerate(bars) if b.group == group]
            base = next((bars[i] for i in rows if bars[i].baseline), None)
            if base is None:
                continue
            reference = getattr(base, field)
            panel.vlines(reference, min(rows) - 0.45, max(rows) + 0.45, colors="#555555", linestyles="dashed", linewidth=1)
            for i in rows:
                value = getattr(bars[i], field)
                if value != value:  # not measured (a CPU run has no peak)
                    panel.text(0, i, " n/a", va="center", fontsize=8)
                    continue
                text = f"{value / 1000:,.1f}k" if field == "tokens_per_s" else f"{value:.1f}"
                ratio = "" if bars[i].baseline or reference != reference else f"  {value / reference:.2f}x"
                panel.text(value, i, f" {text}{ratio}", va="center", fontsize=8)
        panel.set_xlabel(unit)
        panel.set_xlim(0, 1.3 * max([v for v in values if v == v] or [1]))
        panel.grid(axis="x", alpha=0.3)
    panels[0].set_yticks(range(len(bars)), labels, fontsize=9)
    panels[0].invert_yaxis()
    legend = [Patch(color="#9e9e9e", label="baseline (dashed line: its value)"), Patch(color="#1f77b4", label="toolkit")]
    if any(b.default for b in bars):
        legend.append(Patch(color="#2ca02c", label="toolkit defaults (no speed flags)"))
    fig.legend(handles=legend, loc="lower center", ncol=len(legend), fontsize=8, frameon=False)
    fig.suptitle(figure.title, fontsize=10)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    target.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(target, dpi=110, metadata={"Software": None})
    plt.close(fig)
    print(f"wrote {target} ({len(bars)} configurations)")


def newest_per_kind(directory: Path) -> list[Path]:
    """The newest result file of each kind (by the date in its name)."""
    newest: dict[str, Path] = {}
    for path in sorted(directory.glob("*.json"), key=lambda p: file_facts(p)[2]):
        kind = path.stem.split("-", 1)[0]
        if kind in KINDS:
            newest[kind] = path
    return [newest[k] for k in KINDS if k in newest]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("files", nargs="*", type=Path, help=f"result files (default: the newest of each kind in {RESULTS})")
    parser.add_argument("--out", type=Path, default=IMAGES, help="directory for <kind>.png (default: docs/img)")
    args = parser.parse_args(argv)
    files = args.files or newest_per_kind(RESULTS)
    if not files:
        raise SystemExit(f"no result files of the kinds {', '.join(KINDS)} in {RESULTS}")
    for path in files:
        figure = figure_of(path)
        draw(figure, args.out / f"{figure.kind}.png")


if __name__ == "__main__":
    main()
