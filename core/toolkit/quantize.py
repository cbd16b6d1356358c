"""``toolkit export --to hf --quantize NAME``: the unquantized HF export, a registered quantizer over it,
and the report beside the result (size on disk, perplexity on held-out text against the unquantized model).

The quantizers (toolkit-quantize: bitsandbytes, llm-compressor) only turn one HF directory into another;
reading the user's calibration and held-out files, the staging folder and the report live here, so every
method is measured the same way.
"""

from __future__ import annotations

import json
import math
import sys
import tempfile
from pathlib import Path
from typing import Any

from toolkit.errors import ConfigError

REPORT = "quantization.json"
CALIBRATION_SEQ_LEN = 512
HELD_OUT_SHARE = 0.1


def check_request(quantizer: Any, exporter: str, calibration: str | None, eval_dataset: str | None) -> None:
    """Everything that can be refused before a model loads: the exporter, the files, the backend."""
    problems = []
    if exporter != "hf":
        problems.append(f"--quantize writes a Hugging Face directory: use it with --to hf, not --to {exporter}")
    from toolkit.data.reading import resolve_dataset_path
    from toolkit.errors import DataError

    for flag, path in (("--calibration-dataset", calibration), ("--eval-dataset", eval_dataset)):
        try:
            if path:
                resolve_dataset_path(path)  # what --dataset takes: a file, a save_to_disk folder, a bundled name
        except DataError:
            problems.append(f"{flag} {path}: no such file (give a jsonl/json/parquet/csv file of text or chat records, "
                            "a save_to_disk folder or a bundled dataset name)")
    if quantizer.needs_calibration and not calibration:
        problems.append(f"--quantize {quantizer.name} calibrates on your data: give --calibration-dataset FILE "
                        "(a few hundred records like those the model will see)")
    if not calibration and not eval_dataset:
        problems.append("the report beside the export measures perplexity on held-out text: give --eval-dataset FILE "
                        "(or --calibration-dataset FILE, whose last 10% of records are then held out)")
    problems += quantizer.validate()
    if problems:
        raise ConfigError(problems, source=f"toolkit export --quantize {quantizer.name}")


def token_rows(path: str, tokenizer: Any, seq_len: int) -> list[tuple[list[int], list[int]]]:
    """``(input_ids, labels)`` of each record of a file, as ``sft`` encodes it (text records: every token and the
    end-of-text; chat records: the labels are the assistant's tokens), truncated at ``seq_len``. Each record is
    its own row: perplexity per document, never across two."""
    from toolkit.data.pipeline import load_examples

    examples, _ = load_examples([path], tokenizer, seq_len=seq_len)
    return [(s.input_ids, s.labels) for e in examples for s in e.sequences]


def split_rows(calibration: str | None, eval_dataset: str | None, tokenizer: Any) -> tuple[list, list]:
    """Calibration rows and held-out rows; without --eval-dataset the last 10% of the calibration rows are held out."""
    cal = token_rows(calibration, tokenizer, CALIBRATION_SEQ_LEN) if calibration else []
    if eval_dataset:
        return cal, token_rows(eval_dataset, tokenizer, CALIBRATION_SEQ_LEN)
    held = max(1, round(len(cal) * HELD_OUT_SHARE))
    if len(cal) < 2:
        raise ConfigError(f"--calibration-dataset {calibration} gives {len(cal)} row(s) of text: too few to hold some out "
                          "for the perplexity report; give --eval-dataset FILE or more records")
    return cal[:-held], cal[-held:]


def perplexity(model_dir: Path, rows: list[tuple[list[int], list[int]]]) -> tuple[float, int]:
    """exp(mean negative log-likelihood) of the labels of ``rows`` under the model in ``model_dir``; label count."""
    import torch
    from transformers import AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(model_dir, device_map=device).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for input_ids, labels in rows:
            ids = torch.tensor([input_ids], device=model.device)
            target = torch.tensor([labels], device=model.device)
            logps = model(input_ids=ids).logits.float().log_softmax(-1)
            mask = target != -100
            total -= float(logps.gather(-1, target.clamp(min=0)[..., None])[..., 0][mask].sum())
            count += int(mask.sum())
    del model
    return math.exp(total / max(count, 1)), count


def weight_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.glob("*.safetensors"))


def write_report(method: str, full: Path, quantized: Path, held_out: list, eval_source: str) -> dict[str, Any]:
    ppl_full, tokens = perplexity(full, held_out)
    ppl_quantized, _ = perplexity(quantized, held_out)
    report = {"method": method, "size_bytes": weight_bytes(quantized), "unquantized_size_bytes": weight_bytes(full),
              "perplexity": ppl_quantized, "unquantized_perplexity": ppl_full, "eval_tokens": tokens,
              "eval_dataset": eval_source}
    report["size_ratio"] = report["size_bytes"] / max(report["unquantized_size_bytes"], 1)
    (quantized / REPORT).write_text(json.dumps(report, indent=2) + "\n")
    return report


def run_quantized_export(reference: str, output: str, method: str, *, exporter: str = "hf", calibration: str | None = None,
                         eval_dataset: str | None = None, extra: tuple[str, ...] = (),
                         overwrite: bool = False, trust_remote_code: bool = False) -> Path:
    from toolkit.export import atomic_dir, check_output, parse_options, resolve_export_source
    from toolkit.plugins import get_plugin_manager

    manager = get_plugin_manager()
    quantizer_cls = manager.get("quantizer", method)
    quantizer = quantizer_cls(quantizer_cls.Config())
    check_request(quantizer, exporter, calibration, eval_dataset)
    exporter_cls = manager.get("exporter", "hf")
    options = parse_options(exporter_cls, extra)
    target = Path(output)
    check_output(target, overwrite)
    model = resolve_export_source(reference, False, trust_remote_code)
    cal_rows, held_out = split_rows(calibration, eval_dataset, model.source.tokenizer)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{target.name}-full-", dir=target.parent) as tmp:
        full = Path(tmp)
        exporter_cls(options).export(model, full, options)

        def write(staging: Path) -> None:
            quantizer.quantize(full, staging, [ids for ids, _ in cal_rows] if quantizer.needs_calibration else None)
            report = write_report(method, full, staging, held_out, eval_dataset or f"{calibration} (last 10%)")
            print(f"toolkit: {method}: {report['size_bytes'] / 2**20:.1f} MiB ({report['size_ratio']:.2f} of "
                  f"{report['unquantized_size_bytes'] / 2**20:.1f} MiB); perplexity {report['perplexity']:.3f} vs "
                  f"{report['unquantized_perplexity']:.3f} unquantized over {report['eval_tokens']} held-out tokens",
                  file=sys.stderr)

        path = atomic_dir(target, write)
    print(f"exported {model.description} with 'hf' quantized by {method!r} to {path}")
    return path
