"""The user's path on one GPU: the real CLI commands on realistic data, each in its own process with its own time
limit, beside HF transformers and TRL (SFTTrainer, DPOTrainer) on the same data, in one table.

    python bench/userpath.py                         # every case (about 15 minutes on one H200)
    python bench/userpath.py --cases sft-pack,trl-sft-bfd --steps 12 --case-timeout 150
    python bench/userpath.py --tiny                  # the same code path on a CPU with tiny models (nox -s bench)
    python bench/userpath.py --list                  # the cases and their commands
    python bench/userpath.py --tiny --jobs 4         # every case at once on tiny models (does each run? not timings)

Data comes from bench/userdata.py (long-tailed chats, long documents, preference pairs). Models: a 1.24B
Llama and a 2-layer Qwen3-MoE with the 30B-A3B layer shape, random bf16 weights written once to --work.
Every toolkit case is ``python -m toolkit <task> ...`` (``torchrun`` where a user would use it); its
figures are read from the run's metrics.jsonl: tokens/s counts real tokens (not padding), trained
tokens/s the tokens with a label, row fill real tokens over row capacity, peak GiB the allocator's
high-water mark. The first --warmup steps are left out (compilation). Baselines run through
``--baseline NAME`` in a process of their own and count the same way. Writes
$OUT/userpath-<gpu>-<date>.json (a ``results`` list, one object per case) when OUT is set.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

LLAMA_1B = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                intermediate_size=8192, vocab_size=128256, max_position_embeddings=8192, head_dim=64)
LLAMA_TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, vocab_size=768, max_position_embeddings=4096, head_dim=16)
MOE = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
           num_experts_per_tok=8, num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
           norm_topk_prob=True, max_position_embeddings=40960, rope_theta=1e6)
# Gemma 2 at the 2B width with 6 of its 26 layers (sliding window 1024, so a 4096 row crosses it; soft-capped
# attention and logits) and Gemma 3 1B whole (5 windowed layers to 1 global, QK norm): the families whose attention
# the megatron bridge runs through FlexAttention score/mask functions on a GPU
GEMMA2 = dict(vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=6, num_attention_heads=8,
              num_key_value_heads=4, head_dim=256, sliding_window=1024, max_position_embeddings=8192)
GEMMA2_TINY = dict(vocab_size=768, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, sliding_window=64, max_position_embeddings=4096)
GEMMA3 = dict(vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4,
              num_key_value_heads=1, head_dim=256, sliding_window=512, max_position_embeddings=32768)
GEMMA3_TINY = dict(vocab_size=768, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, sliding_window=64, max_position_embeddings=4096)
MOE_TINY = dict(vocab_size=768, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
                num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                norm_topk_prob=True, max_position_embeddings=4096)


# ---------------------------------------------------------------------------------------------- the cases
def cases(args: argparse.Namespace) -> dict[str, dict]:
    """Every case: ``cmd`` (argv after ``python -m toolkit``, or a baseline name), its model and data."""
    seq, mb = args.seq_len, args.micro_batch
    common = ["--precision", "bf16", "--seq-len", str(seq), "--micro-batch-size", str(mb), "--max-steps", str(args.steps),
              "--log-every", "1", "--lr", "1e-5", "--overwrite"]
    sft = ["sft", "--dataset", "{chats}", *common]
    pref = ["--dataset", "{prefs}", "--precision", "bf16", "--seq-len", "2048", "--micro-batch-size", str(mb),
            "--max-steps", str(args.steps), "--log-every", "1", "--lr", "1e-6", "--overwrite"]
    moe_lora = ["--tuner", "lora", "--lr", "1e-4"]  # the default targets (all-linear): the router too
    table = {
        "pt": {"cmd": ["pt", "--dataset", "{docs}", *common]},
        "pt-isolated": {"cmd": ["pt", "--dataset", "{docs}", *common, "--isolate-documents"]},
        "sft-pack": {"cmd": [*sft, "--packing"]},
        "sft-nopack": {"cmd": sft},
        "sft-nopack-ungrouped": {"cmd": [*sft, "--no-group-by-length"]},
        # the same padded micro-batches, 4 per optimizer step: how much of sft-nopack's gap to sft-pack is the
        # per-step cost (optimizer, clipping) over few tokens, not the micro-batches themselves
        "sft-nopack-gb16": {"cmd": [*sft, "--global-batch-size", str(4 * mb)]},
        "sft-lora": {"cmd": [*sft, "--packing", "--tuner", "lora", "--lr", "1e-4"]},
        "sft-dora": {"cmd": [*sft, "--packing", "--tuner", "dora", "--lr", "1e-4"]},
        "sft-qlora": {"cmd": [*sft, "--packing", "--tuner", "qlora", "--lr", "1e-4"], "needs": "bitsandbytes"},
        "sft-fsdp": {"cmd": [*sft, "--packing", "--strategy", "fsdp"]},
        "sft-deepspeed": {"cmd": [*sft, "--packing", "--strategy", "deepspeed", "--zero", "2"], "needs": "deepspeed"},
        "sft-megatron": {"cmd": [*sft, "--packing", "--strategy", "megatron"], "needs": "megatron.core"},
        "sft-megatron-torchrun": {"cmd": [*sft, "--packing", "--strategy", "megatron"], "torchrun": 1, "needs": "megatron.core"},
        "dpo": {"cmd": ["dpo", *pref]},
        # bf16 weights, gradients and AdamW states: the precision and optimizer of TRL's DPOTrainer (trl-dpo)
        "dpo-pure": {"cmd": ["dpo", *pref, "--local-bf16-mode", "pure"]},
        "rm": {"cmd": ["rm", *pref]},
        "moe-sft": {"cmd": [*sft, "--packing"], "model": "moe"},
        "moe-megatron": {"cmd": [*sft, "--packing", "--strategy", "megatron"], "model": "moe", "needs": "megatron.core"},
        # LoRA on attention, the router and every expert: toolkit-peft on the HF model vs the megatron bridge's
        # per-expert adapters and its adapted router
        "moe-lora": {"cmd": [*sft, "--packing", *moe_lora], "model": "moe"},
        "moe-megatron-lora": {"cmd": [*sft, "--packing", "--strategy", "megatron", *moe_lora], "model": "moe",
                              "needs": "megatron.core"},
        "gemma2-sft": {"cmd": [*sft, "--packing"], "model": "gemma2"},
        "gemma2-sft-flex": {"cmd": [*sft, "--packing", "--local-packed-attention", "flex"], "model": "gemma2"},
        "gemma2-megatron": {"cmd": [*sft, "--packing", "--strategy", "megatron"], "model": "gemma2", "needs": "megatron.core"},
        "gemma3-sft": {"cmd": [*sft, "--packing"], "model": "gemma3"},
        "gemma3-megatron": {"cmd": [*sft, "--packing", "--strategy", "megatron"], "model": "gemma3", "needs": "megatron.core"},
        "export-infer": {"cmd": [*sft, "--packing", "--tuner", "lora", "--export", "hf"], "then_infer": True},
        "hf-sft": {"baseline": "hf-sft"},
        "trl-sft-bfd": {"baseline": "trl-sft-bfd"},
        "trl-sft-padded": {"baseline": "trl-sft-padded"},
        "trl-dpo": {"baseline": "trl-dpo"},
    }
    for name, case in table.items():
        case.setdefault("model", "dense")
        case["name"] = name
    return table


# ---------------------------------------------------------------------------------------------- set-up
def prepare(args: argparse.Namespace, needed: set[str]) -> dict[str, Path]:
    """The ``needed`` models and the data under ``args.work`` (written once)."""
    from userdata import write

    work = args.work
    paths = {}
    shapes = {"dense": (LLAMA_TINY, LLAMA_1B), "moe": (MOE_TINY, MOE), "gemma2": (GEMMA2_TINY, GEMMA2),
              "gemma3": (GEMMA3_TINY, GEMMA3)}
    for kind in sorted(needed):
        directory = work / f"model-{kind}"
        if not (directory / "config.json").is_file():
            write_model(directory, kind, shapes[kind][0 if args.tiny else 1])
        paths[kind] = directory
    data = work / "data"
    if not (data / "prefs.jsonl").is_file():
        sizes = dict(chats=300, docs=40, pairs=200) if args.tiny else dict(chats=1500, docs=200, pairs=600)
        write(data, **sizes, max_chat=min(8000, args.seq_len))
    paths.update({name: data / f"{name}.jsonl" for name in ("chats", "docs", "prefs")})
    return paths


def write_model(directory: Path, kind: str, shape: dict) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Gemma2Config, Gemma3TextConfig, LlamaConfig, Qwen3MoeConfig

    from toolkit.models import TOKENIZER_DIR

    config_cls = {"dense": LlamaConfig, "moe": Qwen3MoeConfig, "gemma2": Gemma2Config, "gemma3": Gemma3TextConfig}[kind]
    # Gemma ties its head to the embedding, as the released checkpoints do
    config = config_cls(**shape, tie_word_embeddings=kind.startswith("gemma"))
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    tmp = directory.with_suffix(".tmp")
    model.save_pretrained(tmp, safe_serialization=True)
    AutoTokenizer.from_pretrained(TOKENIZER_DIR).save_pretrained(tmp)
    tmp.rename(directory)
    print(f"userpath: wrote the {kind} model to {directory}", file=sys.stderr)


def missing(module: str) -> str | None:
    import importlib.util

    try:
        return None if importlib.util.find_spec(module) else f"{module} is not installed"
    except ModuleNotFoundError:
        return f"{module} is not installed"


# ---------------------------------------------------------------------------------------------- running
def run_case(case: dict, paths: dict[str, Path], args: argparse.Namespace) -> dict:
    """One case in its own process (its own limit); its figures from its metrics.jsonl or baseline JSON."""
    result = {"case": case["name"], "status": "ok"}
    reason = missing(case["needs"]) if case.get("needs") else None
    if reason:
        return {**result, "status": f"skipped: {reason}"}
    run_dir = args.work / "runs" / case["name"]
    if "baseline" in case:
        out = run_dir.with_suffix(".json")
        out.unlink(missing_ok=True)
        argv = [sys.executable, __file__, "--baseline", case["baseline"], "--work", str(args.work), "--steps", str(args.steps),
                "--seq-len", str(args.seq_len), "--micro-batch", str(args.micro_batch), "--baseline-out", str(out)]
        argv += ["--tiny"] if args.tiny else []
    else:
        fill = {"chats": paths["chats"], "docs": paths["docs"], "prefs": paths["prefs"]}
        tail = [part.format(**fill) for part in case["cmd"]]
        prefix = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(case["torchrun"]), "-m", "toolkit"]
                  if case.get("torchrun") else [sys.executable, "-m", "toolkit"])
        argv = [*prefix, *tail, "--model", str(paths[case["model"]]), "--output", str(run_dir)]
    result["command"] = shlex.join(argv)
    started = time.perf_counter()
    status, log = execute(argv, args.case_timeout)
    result["wall_s"] = round(time.perf_counter() - started, 1)
    if status != "ok":
        return {**result, "status": status, "log_tail": log[-1500:]}
    figures = read_baseline(run_dir.with_suffix(".json")) if "baseline" in case else read_metrics(run_dir / "metrics.jsonl", args.warmup)
    result.update(figures)
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # 1B-parameter checkpoints fill a 64 GiB disk in three cases
    if case.get("then_infer"):
        argv = [sys.executable, "-m", "toolkit", "infer", str(run_dir), "--prompt", "What is the capital of France?",
                "--max-new-tokens", "8"]
        status, log = execute(argv, 120)
        result["infer"] = status if status != "ok" else log.strip().splitlines()[-1][:80] if log.strip() else "empty"
        if status != "ok":
            result.update(status=f"infer: {status}", log_tail=log[-1500:])
    return result


def execute(argv: list[str], limit: float) -> tuple[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=limit, env=env)
    except subprocess.TimeoutExpired as exc:
        tail = (exc.stderr or b"")
        return f"timeout after {limit:.0f}s", tail.decode(errors="replace") if isinstance(tail, bytes) else tail
    log = done.stdout + done.stderr
    return ("ok" if done.returncode == 0 else f"exit {done.returncode}"), log


def read_metrics(path: Path, warmup: int) -> dict:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
    if not rows:
        return {"status": "no metrics"}
    timed = [r for r in rows if r["step"] > warmup] or rows
    return {"steps": len(rows), "tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
            "trained_tokens_per_s": statistics.median(r.get("trained_tokens_per_s", 0.0) for r in timed),
            "row_fill": statistics.mean(r.get("row_fill", 0.0) for r in timed),
            "peak_gib": max((r.get("peak_gib", 0.0) for r in rows), default=0.0),
            "first_loss": rows[0]["loss"], "last_loss": rows[-1]["loss"]}


def read_baseline(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {"status": "no result"}


def print_table(results: list[dict]) -> None:
    print(f"\n{'case':24s} {'tokens/s':>9s} {'trained/s':>9s} {'fill':>5s} {'GiB':>6s} {'loss first->last':>17s}  status")
    for r in results:
        if "tokens_per_s" not in r:
            print(f"{r['case']:24s} {'':>9s} {'':>9s} {'':>5s} {'':>6s} {'':>17s}  {r['status']}")
            continue
        losses = f"{r['first_loss']:.3f}->{r['last_loss']:.3f}"
        print(f"{r['case']:24s} {r['tokens_per_s']:9.0f} {r['trained_tokens_per_s']:9.0f} {r['row_fill']:5.3f} "
              f"{r['peak_gib']:6.1f} {losses:>17s}  {r['status']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true",
                        help="tiny models and data: the CPU path of nox -s bench; on a GPU, every case's CUDA path in seconds")
    parser.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--prepare-only", action="store_true", help="write the models and data to --work, run nothing")
    parser.add_argument("--steps", type=int, default=0)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--seq-len", type=int, default=0)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--case-timeout", type=float, default=240)
    parser.add_argument("--jobs", type=int, default=1,
                        help="cases run at once; above 1 they share the GPU, so the figures say whether each case "
                        "runs, not how fast (each result is marked 'concurrent')")
    parser.add_argument("--work", type=Path, default=Path("/tmp/userpath"))
    parser.add_argument("--baseline", default="", help=argparse.SUPPRESS)
    parser.add_argument("--baseline-out", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.steps = args.steps or (4 if args.tiny else 12)
    args.seq_len = args.seq_len or (256 if args.tiny else 4096)
    args.warmup = min(args.warmup, args.steps - 1)
    if args.baseline:
        from userpath_baselines import run_baseline

        paths = prepare(args, {"dense"})  # the baselines train the Llama
        args.baseline_out.write_text(json.dumps(run_baseline(args.baseline, paths, args)))
        return
    table = cases(args)
    chosen = [c.strip() for c in args.cases.split(",") if c.strip()] or list(table)
    unknown = [c for c in chosen if c not in table]
    if unknown:
        parser.error(f"unknown case(s) {', '.join(unknown)}; known: {', '.join(table)}")
    if args.list:
        for name in chosen:
            print(f"{name:24s} {' '.join(table[name].get('cmd', [table[name].get('baseline', '')]))}")
        return
    paths = prepare(args, {table[name]["model"] for name in chosen})
    if args.prepare_only:
        return
    results: list[dict] = []

    def one(name: str) -> dict:
        print(f"userpath: {name} ({datetime.datetime.now(datetime.UTC):%H:%M:%S})", file=sys.stderr, flush=True)
        result = run_case(table[name], paths, args)
        return {**result, "concurrent": args.jobs} if args.jobs > 1 else result

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        for result in pool.map(one, chosen):  # in the order asked, each as soon as it and those before it end
            results.append(result)
            print_table(results[-1:])
            save(results, args)  # after every case: a run cut short keeps what it measured
    print_table(results)


def save(results: list[dict], args: argparse.Namespace) -> None:
    """$OUT/userpath-<gpu>-<date>.json with the run's settings and a ``results`` list (when OUT is set)."""
    if not os.environ.get("OUT"):
        return
    import torch

    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    date = datetime.date.today().isoformat()
    meta = {"date": date, "gpu": name, "command": shlex.join([sys.executable, *sys.argv]), "steps": args.steps,
            "warmup": args.warmup, "seq_len": args.seq_len, "micro_batch": args.micro_batch}
    stem = "userpath-tiny" if args.tiny else "userpath"
    path = Path(os.environ["OUT"], f"{stem}-{name.split()[-1].lower()}-{date}.json")
    path.write_text(json.dumps({**meta, "results": results}, indent=2))


if __name__ == "__main__":
    main()
