"""Data parallelism on 2 GPUs, 1.24B Llama shape: toolkit fsdp vs deepspeed --zero 3 vs megatron DP2 vs HF + DDP.

    python bench/fsdp_2gpu.py            # 2 GPUs; each case is its own `torchrun --nproc-per-node 2` subprocess
    python bench/fsdp_2gpu.py --tiny     # the same code on the CPU over gloo (a tiny model), to check it runs
    python bench/fsdp_2gpu.py --cases fsdp,ddp --steps 10 --warmup 3 --case-timeout 150

Every case trains the same model (hidden 2048, 16 layers, 32 heads, 8 KV heads, FFN 8192, vocab
128256) from the same weights on the same synthetic rows (seq 4096, micro-batch 4 per GPU, every
token trained), bf16 compute with fp32 master weights, AdamW, clipping at 1.0:

- ``fsdp``: the toolkit's ``fsdp`` engine (FSDP2 per decoder layer, bf16 params, fp32 reduce)
- ``deepspeed``: the toolkit's ``deepspeed`` engine, ZeRO-3 (toolkit-deepspeed)
- ``megatron``: the toolkit's ``megatron`` engine, TP1 PP1 DP2 with the distributed optimizer (toolkit-megatron)
- ``ddp``: the baseline a user writes: HF model in fp32 under bf16 autocast, torch DDP, ``labels=`` loss, fused AdamW
- optional: ``local`` (the toolkit's DDP engine) and ``fsdp-zero2`` (fsdp keeping gathered params after forward)

Reports tokens/s (total and per GPU), peak GiB per GPU (max over ranks, after warm-up) and the first
and last loss, so equal training is visible. A case that exceeds --case-timeout is killed and
reported as such. Writes $OUT/fsdp_2gpu.json when OUT is set. GPU image: `source bench/gpu_setup.sh`
first (installs deepspeed and megatron-core from .whl/ when carried; see bench/wheels.sh).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import full_rows  # noqa: E402
from local_sft import SHAPE_1B, SHAPE_TINY, make_model_dir  # noqa: E402

CASES = ("fsdp", "deepspeed", "megatron", "ddp")
OPTIONAL = ("local", "fsdp-zero2")
TITLES = {"fsdp": "toolkit --strategy fsdp", "fsdp-zero2": "toolkit fsdp, --no-fsdp-reshard-after-forward",
          "deepspeed": "toolkit --strategy deepspeed --zero 3", "megatron": "toolkit megatron DP2, distributed optimizer",
          "ddp": "HF + torch DDP (fp32 params + autocast)", "local": "toolkit --strategy local (DDP)"}


# ----------------------------------------------------------------------------- one case (under torchrun)

def rank_batches(steps: int, batch: int, seq: int, vocab: int, rank: int, device: torch.device) -> list[torch.Tensor]:
    """Rows of this data-parallel rank: the same in every case."""
    generator = torch.Generator().manual_seed(1000 + rank)
    return [torch.randint(0, vocab, (batch, seq), generator=generator).to(device) for _ in range(steps)]


def recipe_for(args: argparse.Namespace, strategy: str, **extra):
    from toolkit.recipe import Recipe

    return Recipe(model=args.model_dir, strategy=strategy, precision=args.precision, lr=1e-5, max_grad_norm=1.0,
                  micro_batch_size=args.batch, seq_len=args.seq, **extra)


def toolkit_step(engine, loss, world_size: int):
    """A step function over the engine's ``train_step`` (one micro-batch per rank); returns the global loss."""
    from toolkit.contracts import StepContext

    def step(ids: torch.Tensor) -> float:
        b, t = ids.shape
        ctx = StepContext(label_tokens=b * (t - 1) * world_size, sequences=b * world_size, examples=b * world_size)
        return engine.train_step([full_rows(ids)], loss, ctx).loss

    return step


def build_case(case: str, args: argparse.Namespace, world_size: int):
    from toolkit.builtins.losses import SFTLoss
    from toolkit.builtins.tuners import FullTuner
    from toolkit.models import load_hf_directory

    if case == "ddp":
        return hf_ddp_step(args)
    source, loss = load_hf_directory(args.model_dir, Path(args.model_dir)), SFTLoss()
    if case in ("fsdp", "fsdp-zero2"):
        from toolkit.builtins.fsdp import FSDPConfig, FSDPStrategy

        strategy = FSDPStrategy(FSDPConfig(reshard_after_forward=case == "fsdp"))
        engine = strategy.build(source, FullTuner(), loss, recipe_for(args, "fsdp"))
    elif case == "local":
        from toolkit.builtins.strategies import LocalStrategy

        engine = LocalStrategy().build(source, FullTuner(), loss, recipe_for(args, "local"))
    elif case == "deepspeed":
        from toolkit_deepspeed.strategy import DeepSpeedStrategy

        engine = DeepSpeedStrategy().build(source, FullTuner(), loss, recipe_for(args, "deepspeed", zero=3))
    elif case == "megatron":
        from toolkit_megatron.strategy import MegatronConfig, MegatronEngine

        engine = MegatronEngine(source, FullTuner(), loss, recipe_for(args, "megatron"),
                                MegatronConfig(attention="sdpa", distributed_optimizer=True))
    else:
        raise SystemExit(f"unknown case {case!r}; choose from {', '.join(CASES + OPTIONAL)}")
    engine.set_total_steps(args.warmup + args.steps)
    return toolkit_step(engine, loss, world_size)


def hf_ddp_step(args: argparse.Namespace):
    """What a user writes by hand: HF model, torch DDP, autocast, ``labels=`` loss, fused AdamW."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from toolkit.train.distributed import init_world

    world = init_world()
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32, attn_implementation="sdpa").to(world.device)
    model.config.use_cache = False
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[world.device.index] if world.device.type == "cuda" else None)
    cuda = world.device.type == "cuda"
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=cuda or None)
    autocast = torch.autocast(world.device.type, dtype=torch.bfloat16, enabled=args.precision == "bf16")

    def step(ids: torch.Tensor) -> torch.Tensor:
        with autocast:
            loss = ddp(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        mean = loss.detach().clone()
        dist.all_reduce(mean)  # asynchronous on the GPU: read after the timed loop
        return mean / dist.get_world_size()

    return step


def run_case(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    if args.case == "deepspeed":
        from toolkit_deepspeed.runtime import init_distributed

        world = init_distributed()
    else:
        from toolkit.train.distributed import init_world

        world = init_world()
    if not dist.is_initialized():
        raise SystemExit("run each case under torchrun (the parent process does that)")
    cuda = world.device.type == "cuda"
    started = time.perf_counter()
    step = build_case(args.case, args, world.world_size)
    build_s = time.perf_counter() - started
    vocab = (SHAPE_TINY if args.tiny else SHAPE_1B)["vocab_size"]
    data = rank_batches(args.warmup + args.steps, args.batch, args.seq, vocab, world.rank, world.device)
    losses = [step(ids) for ids in data[:args.warmup]]
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    dist.barrier()
    start = time.perf_counter()
    losses += [step(ids) for ids in data[args.warmup:]]
    if cuda:
        torch.cuda.synchronize()
    dist.barrier()
    seconds = (time.perf_counter() - start) / args.steps
    losses = [float(x) for x in losses]
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
    peaks: list = [None] * world.world_size
    dist.all_gather_object(peaks, peak)
    tokens = args.batch * args.seq * world.world_size
    if world.is_main:
        row = {"case": args.case, "run": TITLES[args.case], "gpus": world.world_size, "seconds_per_step": seconds,
               "tokens_per_s": tokens / seconds, "tokens_per_s_per_gpu": tokens / seconds / world.world_size,
               "peak_gib_per_gpu": peaks, "peak_gib": max(peaks), "first_loss": losses[0], "last_loss": losses[-1],
               "losses": losses, "build_s": build_s, "batch_per_gpu": args.batch, "seq": args.seq,
               "precision": args.precision}
        Path(args.result).write_text(json.dumps(row, indent=2))
    from toolkit.train.distributed import shutdown

    shutdown(exit_code=0)


# ----------------------------------------------------------------------------- the parent: one subprocess per case

def launch(case: str, args: argparse.Namespace, model_dir: Path, result: Path) -> dict:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
               str(Path(__file__).resolve()), "--case", case, "--model-dir", str(model_dir), "--result", str(result),
               "--batch", str(args.batch), "--seq", str(args.seq), "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--precision", args.precision, *(["--tiny"] if args.tiny else [])]
    log = result.with_suffix(".log")
    started = time.perf_counter()
    with log.open("w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = process.wait(timeout=args.case_timeout)
        except subprocess.TimeoutExpired:
            code = None
            # torchrun starts its ranks in sessions of their own: SIGTERM makes it stop them (TERM, then KILL)
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=45)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
    wall = time.perf_counter() - started
    if code == 0 and result.is_file():
        return {**json.loads(result.read_text()), "wall_s": wall}
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-25:])
    status = f"killed after the {args.case_timeout:.0f}s timeout" if code is None else f"failed (exit {code})"
    print(f"\n--- {case}: {status}; last lines:\n{tail}", file=sys.stderr)
    return {"case": case, "run": TITLES[case], "status": status, "wall_s": wall, "log_tail": tail}


def print_table(rows: list[dict], title: str) -> None:
    print(f"\n{title}")
    print(f"{'run':46s} {'tok/s':>9s} {'tok/s/GPU':>10s} {'peak GiB/GPU':>13s} {'first loss':>10s} {'last loss':>10s} {'wall s':>7s}")
    for row in rows:
        if "status" in row:
            print(f"{row['run']:46s} {row['status']}")
            continue
        peaks = "/".join(f"{p:.1f}" for p in row["peak_gib_per_gpu"])
        print(f"{row['run']:46s} {row['tokens_per_s']:9.0f} {row['tokens_per_s_per_gpu']:10.0f} {peaks:>13s} "
              f"{row['first_loss']:10.4f} {row['last_loss']:10.4f} {row['wall_s']:7.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny model on the CPU over gloo (checks the script runs)")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, from {', '.join(CASES + OPTIONAL)}")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--batch", type=int, default=None, help="micro-batch per GPU (4; tiny: 2)")
    parser.add_argument("--seq", type=int, default=None, help="tokens per row (4096; tiny: 64)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--precision", choices=["bf16", "fp32"], default=None, help="bf16 (tiny: fp32)")
    parser.add_argument("--case-timeout", type=float, default=150.0, help="seconds before a case is killed")
    parser.add_argument("--case", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.batch = args.batch or (2 if args.tiny else 4)
    args.seq = args.seq or (64 if args.tiny else 4096)
    args.precision = args.precision or ("fp32" if args.tiny else "bf16")
    if args.case:
        run_case(args)
        return
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in cases if c not in CASES + OPTIONAL]
    if unknown:
        parser.error(f"unknown case(s) {', '.join(unknown)}; choose from {', '.join(CASES + OPTIONAL)}")
    with tempfile.TemporaryDirectory(prefix="fsdp-bench-") as tmp:
        root = Path(tmp)
        started = time.perf_counter()
        model_dir = make_model_dir(SHAPE_TINY if args.tiny else SHAPE_1B, root / "model")
        print(f"model written in {time.perf_counter() - started:.0f}s", flush=True)
        rows = []
        for case in cases:
            rows.append(launch(case, args, model_dir, root / f"{case}.json"))
            row = rows[-1]
            if "status" not in row:
                print(f"{case}: {row['tokens_per_s_per_gpu']:.0f} tokens/s/GPU, peak {row['peak_gib']:.1f} GiB, "
                      f"loss {row['first_loss']:.4f} -> {row['last_loss']:.4f}, {row['wall_s']:.0f}s", flush=True)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() and not args.tiny else "cpu (gloo)"
    print_table(rows, f"full SFT, {args.nproc} x {device}, {args.precision}, micro-batch {args.batch} x seq {args.seq} per GPU, "
                      f"{'tiny' if args.tiny else '1.24B'} Llama shape, {args.steps} timed steps after {args.warmup}")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "fsdp_2gpu.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
