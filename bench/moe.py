"""MoE full-SFT throughput: transformers' Qwen3-MoE vs toolkit's training paths, one script, one subprocess per case.

Shape of Qwen3-30B-A3B with 4 layers (hidden 2048, 128 experts, top-8, expert FFN 768, vocab
151936, 32 query / 4 KV heads of 128), seq 4096, batch 2 per GPU, bf16. Cases:

  hf            transformers' model (its default grouped_mm experts), its ``labels=`` loss, fused AdamW on bf16 params
  blocks        the same loop with toolkit-moe's blocks (attribution of the MoE block alone)
  blocks+logps  the same loop with toolkit-moe's blocks and the engines' chunked label log-probs head
                (the model side of ``toolkit`` without its fp32 master weights and clipping)
  toolkit       the ``local`` engine's train_step with --moe-enabled (chunked label log-probs, fp32 master
                weights, fused AdamW, clipping at 1.0, aux loss): what ``toolkit sft`` runs
  toolkit-pure  the same with ``--local-bf16-mode pure``: bf16 parameters, gradients and AdamW states, no
                fp32 copy, as the hf case keeps them (like against like; clipping and aux loss stay)
  megatron      ``--strategy megatron`` (toolkit-megatron's bridge and engine), EP1, 1 GPU (torchrun), with
                its default grouped-matmul experts (toolkit_megatron.experts.GroupedExperts)
  megatron-seq  the same with ``--megatron-moe-experts sequential`` (Megatron's SequentialMLP: a loop over experts)
  toolkit-ep2   the local engine with --moe-enabled --ep 2 on 2 GPUs (torchrun; DDP for the rest)
  megatron-ep2  --strategy megatron --ep 2 on 2 GPUs

The EP2 cases run when two GPUs are visible (or with ``--tiny``, on CPU over gloo). Each case runs
in its own process with a timeout; a case that fails or times out is reported, not fatal.
Prints a table; writes ``$OUT/moe.json`` when ``OUT`` is set.

    source bench/gpu_setup.sh && python bench/moe.py            # GPU (all cases that fit the GPUs)
    python bench/moe.py --cases hf,toolkit                      # a subset
    python bench/moe.py --tiny                                  # CPU check of every path
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ONE_GPU = ["hf", "blocks", "blocks+logps", "toolkit", "toolkit-pure", "megatron", "megatron-seq"]
TWO_GPU = ["toolkit-ep2", "megatron-ep2"]
TORCHRUN = {"megatron": 1, "megatron-seq": 1, "toolkit-ep2": 2, "megatron-ep2": 2}


def build_config(tiny: bool, layers: int):
    from transformers import Qwen3MoeConfig

    if tiny:
        return Qwen3MoeConfig(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
                              num_experts_per_tok=2, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                              head_dim=16, norm_topk_prob=True, max_position_embeddings=512, tie_word_embeddings=False)
    return Qwen3MoeConfig(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                          num_experts_per_tok=8, num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=4,
                          head_dim=128, norm_topk_prob=True, max_position_embeddings=40960, rope_theta=1e6,
                          tie_word_embeddings=False)


# ---------------------------------------------------------------------------------------------- orchestration
def prepare(args) -> None:
    """Write the model (bf16 safetensors + the toolkit's tiny tokenizer) to ``args.model_dir``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from toolkit.models import TOKENIZER_DIR

    config = build_config(args.tiny, args.layers)
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    with torch.device(device):  # a 3B-parameter init on the CPU takes minutes
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(args.model_dir, safe_serialization=True)
    AutoTokenizer.from_pretrained(TOKENIZER_DIR).save_pretrained(args.model_dir)


def launch(case: str, args, model_dir: Path, result: Path) -> dict:
    script = [str(HERE / "moe.py"), "--case", case, "--model-dir", str(model_dir), "--result", str(result),
              "--seq", str(args.seq), "--batch", str(args.batch), "--steps", str(args.steps), "--warmup", str(args.warmup),
              "--layers", str(args.layers), *(["--tiny"] if args.tiny else []), *(["--profile"] if args.profile else [])]
    nproc = TORCHRUN.get(case)
    command = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *script]
               if nproc else [sys.executable, *script])
    start = time.perf_counter()
    try:
        done = subprocess.run(command, timeout=args.timeout, capture_output=True, text=True)
    except subprocess.TimeoutExpired:
        return {"case": case, "error": f"timed out after {args.timeout} s"}
    wall = time.perf_counter() - start
    profile = result.with_suffix(".profile.txt")
    if profile.is_file():
        print(f"\n{case}: costliest kernels\n{profile.read_text()}", flush=True)
        if os.environ.get("OUT"):
            Path(os.environ["OUT"], f"moe_profile_{case}.txt").write_text(profile.read_text())
    if result.is_file():
        return {**json.loads(result.read_text()), "wall_s": wall}
    tail = (done.stdout + done.stderr).strip().splitlines()[-6:]
    return {"case": case, "error": f"exit {done.returncode}: " + " | ".join(tail)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="small shape on the CPU (checks every path; timings mean nothing)")
    parser.add_argument("--cases", default=None, help=f"comma-separated of {','.join(ONE_GPU + TWO_GPU)} (default: all that fit)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=None)
    parser.add_argument("--batch", type=int, default=2, help="sequences per GPU")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--timeout", type=int, default=None, help="seconds per case (default 300: loading 3B parameters and the first torch.compile take a while)")
    parser.add_argument("--profile", action="store_true", help="also print each case's 25 costliest kernels (torch.profiler, 2 steps)")
    parser.add_argument("--case", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.seq = args.seq or (64 if args.tiny else 4096)
    args.steps = args.steps or (2 if args.tiny else 10)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 3)
    args.timeout = args.timeout or 300
    if args.case:
        return run_case(args)

    import torch

    gpus = 0 if args.tiny else torch.cuda.device_count()
    cases = args.cases.split(",") if args.cases else ONE_GPU + (TWO_GPU if args.tiny or gpus >= 2 else [])
    results = []
    with tempfile.TemporaryDirectory(prefix="toolkit-moe-bench-") as tmp:
        model_dir = Path(tmp) / "model"
        subprocess.run([sys.executable, str(HERE / "moe.py"), "--case", "prepare", "--model-dir", str(model_dir),
                        "--layers", str(args.layers), *(["--tiny"] if args.tiny else [])], check=True, timeout=300)
        for case in cases:
            results.append(launch(case.strip(), args, model_dir, Path(tmp) / f"{case.strip()}.json"))
            print(json.dumps(results[-1]), flush=True)
    print_table(results, args)


def print_table(results: list[dict], args) -> None:
    base = next((r for r in results if r.get("case") == "hf" and "error" not in r), None)
    print(f"\nMoE full SFT, Qwen3-30B-A3B layer shape x{args.layers} layers{' (tiny)' if args.tiny else ''}, "
          f"seq {args.seq}, batch {args.batch}/GPU")
    print(f"{'case':<14}{'procs':>6}{'tokens/s':>11}{'per GPU':>10}{'step ms':>9}{'peak GiB':>10}{'vs hf/GPU':>10}{'loss[0]':>9}")
    for r in results:
        if "error" in r:
            print(f"{r['case']:<14} FAILED: {r['error'][:300]}")
            continue
        per_gpu = r["tokens_per_s"] / r["gpus"]
        r["speedup_per_gpu"] = per_gpu / base["tokens_per_s"] if base else None
        speedup = f"{r['speedup_per_gpu']:.2f}x" if base else "-"
        print(f"{r['case']:<14}{r['gpus']:>6}{r['tokens_per_s']:>11.0f}{per_gpu:>10.0f}{r['step_ms']:>9.1f}{r['peak_gib']:>10.2f}"
              f"{speedup:>10}{r['first_loss']:>9.4f}")
    if os.environ.get("OUT"):
        import torch

        meta = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "torch": torch.__version__,
                "transformers": __import__("transformers").__version__, "seq": args.seq, "batch_per_gpu": args.batch,
                "layers": args.layers, "steps": args.steps, "warmup": args.warmup, "tiny": args.tiny}
        path = Path(os.environ["OUT"], "moe.json")
        path.write_text(json.dumps({"meta": meta, "results": results}, indent=2))
        print(f"wrote {path}")


# ---------------------------------------------------------------------------------------------- one case
def run_case(args) -> None:
    if args.case == "prepare":
        return prepare(args)
    import torch

    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if torch.cuda.is_available() and not args.tiny \
        else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    runner = hf_loop if args.case in ("hf", "blocks", "blocks+logps") else engine_case
    step, losses = runner(args, device, rank)
    seconds, peak = timed(step, args, device)
    tokens = args.batch * args.seq * world
    result = {"case": args.case, "gpus": world, "tokens_per_s": tokens / seconds,
              "step_ms": 1000 * seconds, "peak_gib": peak, "first_loss": float(losses[0]), **getattr(args, "info", {})}
    if args.profile:
        table = profile_steps(step, args, device)
        if rank == 0:
            args.result.with_suffix(".profile.txt").write_text(table)
    if rank == 0:
        args.result.write_text(json.dumps(result))
    if args.case.startswith("megatron"):
        from toolkit_megatron.checkpoint import stop_checkpoint_workers

        stop_checkpoint_workers()
    import torch.distributed as dist

    if dist.is_initialized():  # clean exit of gloo/NCCL jobs (see docs: exit-abort trap)
        dist.barrier()
        dist.destroy_process_group()
        sys.stdout.flush()
        os._exit(0)


def batches(args, vocab: int, device, rank: int) -> list:
    import torch

    generator = torch.Generator().manual_seed(1 + rank)
    return [torch.randint(0, vocab, (args.batch, args.seq), generator=generator).to(device) for _ in range(2)]


def timed(step, args, device) -> tuple[float, float]:
    import torch

    for i in range(args.warmup):
        step(i)
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(args.steps):
        step(args.warmup + i)
    if device.type == "cuda":
        torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    return (time.perf_counter() - start) / args.steps, peak


def profile_steps(step, args, device) -> str:
    """The 25 kernels with the most device time over two more steps."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for i in range(2):
            step(args.warmup + args.steps + i)
        if device.type == "cuda":
            torch.cuda.synchronize()
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=60)


def hf_loop(args, device, rank: int):
    """transformers' training loop as users write it: ``labels=`` loss, fused AdamW on bf16 parameters."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.bfloat16, attn_implementation="sdpa").to(device)
    model.config.use_cache = False
    model.train()
    if args.case.startswith("blocks"):
        from toolkit_moe.patch import patch_moe_blocks

        patch_moe_blocks(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")
    data = batches(args, model.config.vocab_size, device, rank)
    losses = []

    def task_loss(ids):
        if args.case != "blocks+logps":
            return model(input_ids=ids, labels=ids).loss
        from toolkit.train.logps import label_logps

        hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state
        return -label_logps(model.lm_head, hidden[:, :-1].reshape(-1, hidden.shape[-1]), ids[:, 1:].reshape(-1)).mean()

    def step(i: int) -> None:
        loss = task_loss(data[i % 2])
        losses.append(loss.detach())
        pop = getattr(model, "toolkit_pop_aux_loss", None)  # toolkit-moe's aux loss (HF adds none without router logits)
        aux = pop()[0] if pop else None
        (loss + aux if aux is not None else loss).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step, losses


def engine_case(args, device, rank: int):
    """The strategy's engine exactly as ``toolkit sft`` builds it, with ``--ep N`` (N = number of processes):
    ``local`` with ``--moe-enabled [--local-bf16-mode pure]`` (toolkit-moe's expert parallelism), or ``megatron``
    with grouped or sequential experts."""
    import torch
    from common import full_rows

    from toolkit.contracts import StepContext
    from toolkit.models import load_hf_directory
    from toolkit.recipe import resolve_recipe
    from toolkit.train.runner import resolve_components

    world = int(os.environ.get("WORLD_SIZE", "1"))
    values = {"model": str(args.model_dir), "precision": "bf16" if device.type == "cuda" else "fp32", "lr": 1e-5,
              "max_grad_norm": 1.0, "seq_len": args.seq, "micro_batch_size": args.batch, "expert_parallel": world}
    if args.case == "toolkit-pure":  # bf16 on the CPU too: the mode exists only under --precision bf16
        values.update(precision="bf16", local={"bf16_mode": "pure"})
    if args.case.startswith("megatron"):
        values.update(strategy="megatron",
                      megatron={"moe_experts": "sequential" if args.case == "megatron-seq" else "grouped"})
        if not torch.distributed.is_initialized():  # Megatron wants a process group even for one process
            torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo")
    else:
        values.update(strategy="local", moe={"enabled": True})
    strategy, tuner, loss, recipe = resolve_components(resolve_recipe(values), world)
    source = load_hf_directory(str(args.model_dir), args.model_dir)
    engine = strategy.build(source, tuner, loss, recipe)
    engine.set_total_steps(args.warmup + args.steps)
    chunks = getattr(engine, "chunks", None) or [engine.model]
    args.info = {"param_dtypes": sorted({str(p.dtype) for chunk in chunks for p in chunk.parameters()})}
    if args.case.startswith("megatron"):  # which experts module ran
        args.info["experts"] = sorted({type(m).__name__ for chunk in chunks for m in chunk.modules()
                                       if type(m).__name__ in ("GroupedExperts", "SequentialMLP")})
    else:
        args.info["bf16_mode"] = engine.bf16_scheme
    data = batches(args, source.config.vocab_size, device, rank)
    b, t = data[0].shape
    ctx = StepContext(label_tokens=b * (t - 1) * world, sequences=b * world, examples=b * world)
    losses = []

    def step(i: int) -> None:
        losses.append(engine.train_step([full_rows(data[i % 2])], loss, ctx).loss)

    return step, losses


if __name__ == "__main__":
    main()
