"""What the checkpoint manifest costs: time to write a checkpoint (engine files) against time to seal it
(sha256 + fsync of every file, shared over the ranks, then manifest.json), and time to verify it before a resume (sha256, or sizes only).

    python bench/checkpoint_manifest.py                 # a ~100M-parameter llama, fp32: ~1.2 GB checkpoints
    python bench/checkpoint_manifest.py --tiny          # tiny-llama, seconds
    python bench/checkpoint_manifest.py --hidden 2048 --layers 16   # bigger

Trains ``--saves`` steps with a checkpoint after each on the local strategy (CPU, or the GPU when there is
one) and times each phase of every save; prints medians and writes them to $OUT/checkpoint_manifest.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path


def make_model(directory: Path, hidden: int, layers: int) -> Path:
    """A randomly initialised llama of the given shape, with the tiny preset's tokenizer."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    from toolkit.models import preset_config, resolve_model

    tiny = resolve_model("tiny-llama").directory
    config = preset_config("tiny-llama", hidden_size=hidden, intermediate_size=hidden * 11 // 4, num_hidden_layers=layers,
                           num_attention_heads=max(1, hidden // 64), num_key_value_heads=max(1, hidden // 256), head_dim=64)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    for name in os.listdir(tiny):
        if name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(Path(tiny) / name, directory / name)
    return directory


def timed(record: list[float], fn):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            record.append(time.perf_counter() - start)

    return wrapper


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary folder)")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import toolkit.train.checkpoint as ckpt
    from toolkit.recipe import resolve_recipe
    from toolkit.train.runner import run_training

    work = Path(args.dir or tempfile.mkdtemp(prefix="ckpt-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    model = "tiny-llama" if args.tiny else str(make_model(work / "model", args.hidden, args.layers))
    writes, shares, seals, saves = [], [], [], []
    ckpt.write_rank_files = timed(writes, ckpt.write_rank_files)
    ckpt.hash_share = timed(shares, ckpt.hash_share)
    ckpt.write_manifest = timed(seals, ckpt.write_manifest)
    ckpt.save_checkpoint = timed(saves, ckpt.save_checkpoint)
    recipe = resolve_recipe({"model": model, "dataset": ["demo"], "output": str(work / "run"), "seq_len": 64,
                             "max_steps": args.saves, "save_every": 1, "keep_last": 1, "overwrite": True})
    run_dir = run_training(recipe)
    checkpoint = ckpt.list_checkpoints(run_dir)[-1]
    names = [p.relative_to(checkpoint).as_posix() for p in checkpoint.rglob("*") if p.is_file()]
    size = sum((checkpoint / n).stat().st_size for n in names)
    hash_only = _best(lambda: ckpt.hash_files(checkpoint, names))
    verify_sha = _best(lambda: ckpt.checkpoint_problem(checkpoint, "sha256"))
    verify_size = _best(lambda: ckpt.checkpoint_problem(checkpoint, "size"))
    median = statistics.median
    row = {"model": model if args.tiny else f"llama hidden {args.hidden} x {args.layers} layers", "files": len(names),
           "checkpoint_gib": size / 2**30, "engine_write_s": median(writes),
           "seal_s": median(a + b for a, b in zip(shares, seals)),
           "hash_only_s": hash_only, "save_total_s": median(saves), "verify_sha256_s": verify_sha,
           "verify_size_s": verify_size, "saves": len(saves)}
    row["seal_over_write"] = row["seal_s"] / row["engine_write_s"]
    print(f"checkpoint of {row['model']}: {row['checkpoint_gib']:.2f} GiB in {row['files']} files (median of {row['saves']} saves)")
    for key, label in (("engine_write_s", "engine writes its files (no fsync)"), ("seal_s", "manifest: sha256 + fsync of every file"),
                       ("hash_only_s", "  of which sha256 alone (page cache)"), ("save_total_s", "whole save_checkpoint"),
                       ("verify_sha256_s", "resume check, sha256 (page cache)"), ("verify_size_s", "resume check, sizes only")):
        print(f"  {label:42s} {row[key]:8.3f} s")
    print(f"  manifest / engine write: {row['seal_over_write']:.2f}x")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "checkpoint_manifest.json").write_text(json.dumps(row, indent=2))
    if args.dir is None:
        import shutil

        shutil.rmtree(work, ignore_errors=True)


def _best(fn, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


if __name__ == "__main__":
    main()
