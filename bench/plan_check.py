"""Check ``toolkit plan``'s memory and speed estimates against the toolkit's own training path on this GPU.

For each configuration (full fine-tune at two sequence lengths, with recompute, LoRA r=16) it
trains a Llama of the 1.24B shape (hidden 2048, 16 layers, 32 heads, 8 KV, FFN 8192, vocab 128256)
for a few steps, measures peak allocated memory (torch.cuda.max_memory_allocated after the
optimizer states exist) and tokens/s, and prints the planner's estimate beside each, plus whether
the planner orders the configurations by speed as measured. Target: memory within 15%.

The training path is what ``toolkit train --strategy local --precision bf16`` runs: the ``local``
engine (toolkit.builtins.strategies.LocalEngine: bf16 parameters, fp32 master weights, fused AdamW
on CUDA, chunked label log-probs) with the tuner from the plugin registry (``full``, or
toolkit-peft's ``lora``: bf16 frozen base, fused LoRA forward) and the ``sft`` loss, built by
toolkit.plan.measure.local_engine. Every configuration runs in its own subprocess, so no model,
optimizer or allocator cache of an earlier one is counted in a later peak.

    python bench/plan_check.py            # on a GPU (the lead's H200 run)
    python bench/plan_check.py --tiny     # CPU: a tiny model, peak from the CPU allocator trace
Writes plan_check.json to $OUT when it is set.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
import time
from dataclasses import dataclass

SHAPE_1B = dict(model_type="llama", hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                head_dim=64, intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True)
SHAPE_TINY = dict(model_type="llama", hidden_size=320, num_hidden_layers=4, num_attention_heads=10, num_key_value_heads=2,
                  intermediate_size=1024, vocab_size=2048, tie_word_embeddings=True)


@dataclass
class Case:
    name: str
    tuner: str
    seq_len: int
    micro_batch_size: int = 1
    recompute: bool = False
    micro_batches: int = 1
    """Micro-batches per optimizer step (gradient accumulation into the fp32 master gradients)."""
    fused_loss: bool = False
    kernels: str = "none"
    """``--local-fused-loss`` / ``--local-kernels`` (the engine's GPU defaults are true / triton)."""


GPU_CASES = [Case("full seq 1024", "full", 1024), Case("full seq 4096", "full", 4096),
             Case("full seq 4096 recompute", "full", 4096, recompute=True), Case("lora seq 4096", "lora", 4096),
             Case("lora seq 8192", "lora", 8192), Case("full seq 4096 x 4", "full", 4096, micro_batch_size=4),
             Case("full seq 4096 accum 2", "full", 4096, micro_batches=2),
             Case("full seq 4096 x 4 defaults", "full", 4096, micro_batch_size=4, fused_loss=True, kernels="triton"),
             Case("lora seq 4096 defaults", "lora", 4096, fused_loss=True, kernels="triton")]
TINY_CASES = [Case("full seq 64", "full", 64), Case("full seq 256", "full", 256),
              Case("full seq 256 recompute", "full", 256, recompute=True), Case("lora seq 256", "lora", 256),
              Case("full seq 256 accum 2", "full", 256, micro_batches=2),
              Case("full seq 256 fused loss", "full", 256, fused_loss=True)]


def measure(config_dict: dict, case: Case, device: str, steps: int, warmup: int, model_dir: str) -> dict:
    import torch

    from toolkit.plan.measure import cpu_peak_bytes, engine_allocated_bytes, local_engine, saved_activation_bytes

    engine, loss_fn, step = local_engine(config_dict, model_dir, tuner=case.tuner, seq_len=case.seq_len,
                                         micro_batch_size=case.micro_batch_size, recompute=case.recompute,
                                         micro_batches=case.micro_batches, fused_loss=case.fused_loss, kernels=case.kernels)
    gc.collect()
    for _ in range(warmup):
        step()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    if device == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    if device == "cuda":
        peak = torch.cuda.max_memory_allocated()
    else:  # CPU: the allocator trace of one more step, on top of weights, masters and optimizer states
        peak = cpu_peak_bytes(step, engine_allocated_bytes(engine))
    tokens = steps * case.micro_batches * case.micro_batch_size * case.seq_len
    # Counted after the timed steps: the counting forward is never backpropagated, and on CUDA its
    # graph outlived it (the next forward ran beside it), which once added a second set of
    # activations to every peak measured after it.
    activations = None if case.recompute else saved_activation_bytes(engine.model, loss_fn, config_dict["vocab_size"])
    return {"peak_bytes": peak, "tokens_per_s": tokens / elapsed, "activation_bytes": activations}


def measure_in_subprocess(index: int, args: argparse.Namespace) -> dict:
    """One configuration in a fresh interpreter: its peak cannot include an earlier case's tensors."""
    import subprocess
    import sys

    command = [sys.executable, __file__, "--child", str(index), "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--model-dir", args.model_dir]
    if args.tiny:
        command.append("--tiny")
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"case {index} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def estimate(config_dict: dict, case: Case, gpu_kind: str) -> dict:
    """The planner's numbers; on CPU without the CUDA workspace and with CPU AdamW's per-tensor
    temporaries (no fused kernel there)."""
    from toolkit.plan import Layout, Workload, layout_memory, make_cluster, shape_from_config, step_time
    from toolkit.plan.memory import activation_bytes_per_token_layer, cpu_optimizer_temp

    shape = shape_from_config(config_dict, name="bench")
    workload = Workload(seq_len=case.seq_len, micro_batch_size=case.micro_batch_size,
                        global_batch_size=case.micro_batch_size * case.micro_batches, tuner=case.tuner, lora_rank=16,
                        fused_loss=case.fused_loss, kernels=case.kernels)
    layout = Layout("local", recompute=case.recompute)
    memory = layout_memory(shape, layout, workload, micro_batches=case.micro_batches)
    if gpu_kind == "cpu":
        memory.buffers = 0.0
        memory.optimizer_step_temp = max(memory.optimizer_step_temp, cpu_optimizer_temp(shape, case.tuner))
    timing = step_time(shape, layout, workload, make_cluster(1, 1, None, gpu_kind),
                       case.micro_batch_size * case.micro_batches)
    activations = activation_bytes_per_token_layer(shape, layout, workload) * shape.layers * workload.micro_batch_tokens
    return {"peak_bytes": memory.total, "tokens_per_s": timing.tokens_per_second, "activation_bytes": activations,
            "breakdown_gib": {name: round(value / 2**30, 3) for name, value in memory.rows()}}


TIE = 0.05
"""Measured speeds closer than this (relative) are a tie for the ranking check (step-to-step noise)."""


def order(values: list[float]) -> list[int]:
    return sorted(range(len(values)), key=lambda i: -values[i])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="CPU smoke test with a tiny model")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--cases", default=None, help="comma-separated case numbers to run (default: all)")
    parser.add_argument("--from-json", default=None, metavar="PLAN_CHECK_JSON",
                        help="measure nothing: report the measurements of an earlier run against this planner")
    args = parser.parse_args()
    if args.from_json:
        rereport(args.from_json)
        return

    import torch

    from toolkit.plan.hardware import detect_gpu_kind

    device = "cpu" if args.tiny or not torch.cuda.is_available() else "cuda"
    config, cases = (SHAPE_TINY, TINY_CASES) if args.tiny else (SHAPE_1B, GPU_CASES)
    steps = args.steps = args.steps or (3 if args.tiny else 10)
    if args.child is not None:  # one configuration, its measurement as the last line of stdout
        print(json.dumps(measure(config, cases[args.child], device, steps, args.warmup, args.model_dir)))
        return
    gpu_kind = detect_gpu_kind(torch.cuda.get_device_name(0)) if device == "cuda" else "cpu"
    rows = []
    chosen = [int(i) for i in args.cases.split(",")] if args.cases else range(len(cases))
    with tempfile.TemporaryDirectory() as model_dir:  # one random model on disk, loaded by every case
        args.model_dir = model_dir
        save_model(config, model_dir)
        for index in chosen:
            rows.append(run_case(index, cases[index], config, args, gpu_kind))
    report(rows, device, gpu_kind, steps)


def rereport(path: str) -> None:
    """The measured columns of an earlier run (its plan_check.json), the estimates recomputed."""
    try:
        earlier = json.loads(open(path).read())
        cases = {case.name: case for case in (TINY_CASES if earlier["device"] == "cpu" else GPU_CASES)}
        config = SHAPE_TINY if earlier["device"] == "cpu" else SHAPE_1B
        rows = [{"case": row["case"], "measured": row["measured"],
                 "estimate": estimate(config, cases[row["case"]], earlier["gpu_kind"])} for row in earlier["rows"]]
    except (OSError, ValueError, KeyError) as exc:
        raise SystemExit(f"--from-json {path}: not a plan_check.json of this script ({type(exc).__name__}: {exc})") from None
    report(rows, earlier["device"], earlier["gpu_kind"], earlier["steps"])


def save_model(config: dict, directory: str) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.for_model(**config), attn_implementation="sdpa", dtype=torch.bfloat16)
    model.save_pretrained(directory)


def run_case(index: int, case: Case, config: dict, args: argparse.Namespace, gpu_kind: str) -> dict:
    measured = measure_in_subprocess(index, args)
    predicted = estimate(config, case, gpu_kind)
    # each case as it finishes, so a run stopped by a time limit still reports what it measured
    print(f"{case.name}: measured {json.dumps(measured)}; estimated {json.dumps(predicted)}", flush=True)
    return {"case": case.name, "measured": measured, "estimate": predicted}


def report(rows: list[dict], device: str, gpu_kind: str, steps: int) -> None:
    import torch

    unit = 2**20 if device == "cpu" else 2**30

    def gib(value):
        return f"{value / unit:8.2f}" if value is not None else "     n/a"

    def error(est, meas):
        return f"{(est - meas) / meas:+7.1%}" if meas else "    n/a"

    header = (f"{'configuration':26} {'mem est':>8} {'mem meas':>8} {'err':>7} {'act est':>8} {'act meas':>8} {'err':>7} "
              f"{'tok/s est':>10} {'tok/s meas':>10} {'err':>7}")
    print(f"device: {torch.cuda.get_device_name(0) if device == 'cuda' and torch.cuda.is_available() else device} (planner GPU kind {gpu_kind}); {'MiB' if device == 'cpu' else 'GiB'}")
    print(header)
    for row in rows:
        m, e = row["measured"], row["estimate"]
        print(f"{row['case']:26} {gib(e['peak_bytes'])} {gib(m['peak_bytes'])} {error(e['peak_bytes'], m['peak_bytes'])} "
              f"{gib(e['activation_bytes'])} {gib(m['activation_bytes'])} {error(e['activation_bytes'], m['activation_bytes'])} "
              f"{e['tokens_per_s']:10.0f} {m['tokens_per_s']:10.0f} {error(e['tokens_per_s'], m['tokens_per_s'])}")
    est_order = order([r["estimate"]["tokens_per_s"] for r in rows])
    meas_order = order([r["measured"]["tokens_per_s"] for r in rows])
    within = [abs(r["estimate"]["peak_bytes"] - r["measured"]["peak_bytes"]) / r["measured"]["peak_bytes"] <= 0.15
              for r in rows if r["measured"]["peak_bytes"]]
    print("speed order, planner :", " > ".join(rows[i]["case"] for i in est_order))
    print("speed order, measured:", " > ".join(rows[i]["case"] for i in meas_order))
    est_speed = [r["estimate"]["tokens_per_s"] for r in rows]
    meas_speed = [r["measured"]["tokens_per_s"] for r in rows]
    pairs = [(i, j) for i in range(len(rows)) for j in range(i + 1, len(rows))]
    concordant = sum((est_speed[i] - est_speed[j]) * (meas_speed[i] - meas_speed[j]) > 0 for i, j in pairs)
    # Two configurations measured within TIE of each other are a tie: either order agrees.
    discordant = [(rows[i]["case"], rows[j]["case"]) for i, j in pairs
                  if (est_speed[i] - est_speed[j]) * (meas_speed[i] - meas_speed[j]) <= 0
                  and abs(meas_speed[i] - meas_speed[j]) > TIE * max(meas_speed[i], meas_speed[j])]
    ties = len(pairs) - concordant - len(discordant)
    print(f"ranking agrees: {not discordant} ({concordant}/{len(pairs)} pairs ordered alike, {ties} measured within "
          f"{TIE:.0%} of each other (ties){'' if not discordant else ', out of order: ' + str(discordant)}); "
          f"memory within 15%: {sum(within)}/{len(within)}")
    summary = {"device": device, "gpu_kind": gpu_kind, "steps": steps, "rows": rows,
               "ranking_agrees": not discordant, "exact_order": est_order == meas_order,
               "pairs_ordered_alike": [concordant, len(pairs)], "out_of_order": discordant,
               "memory_within_15pct": within}
    if os.environ.get("OUT"):
        path = os.path.join(os.environ["OUT"], "plan_check.json")
        with open(path, "w") as handle:
            json.dump(summary, handle, indent=2)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
