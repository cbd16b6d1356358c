"""DeepSpeed ZeRO throughput and memory: the toolkit ``deepspeed`` engine beside a plain DeepSpeed + HF loop.

    torchrun --nproc-per-node 2 bench/deepspeed_zero.py            # 1.24B Llama shape, seq 4096, batch 4, bf16
    torchrun --nproc-per-node 2 bench/deepspeed_zero.py --tiny     # CPU smoke run of the same code (gloo)
    python bench/deepspeed_zero.py --stages 3                     # one GPU

Every run uses the same data, model and bf16 ZeRO settings. The baseline is what a user writes
by hand: ``deepspeed.initialize`` on the HF model and ``model(labels=...).loss``. Prints a table
(tokens/s per rank, peak GiB on rank 0) and writes JSON to $OUT/deepspeed_zero.json when OUT is set.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import full_rows, shape_parser  # noqa: E402
from local_sft import SHAPE_1B, SHAPE_TINY, batches, make_model_dir, timed  # noqa: E402


def ds_config(stage: int, batch: int) -> dict:
    return {"train_micro_batch_size_per_gpu": batch, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
            "bf16": {"enabled": True}, "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
            "zero_force_ds_cpu_optimizer": False, "steps_per_print": 10**9}


def plain_deepspeed(model_dir: Path, data: list, warmup: int, stage: int, batch: int) -> tuple[float, float]:
    import deepspeed
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    config = ds_config(stage, batch) | {"train_batch_size": batch * deepspeed.comm.get_world_size()}
    keep = HfDeepSpeedConfig(config) if stage == 3 else None  # zero.Init while it is alive
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, attn_implementation="sdpa")
    model.config.use_cache = False
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)

    def step(ids: torch.Tensor) -> None:
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()

    result = timed(step, data, warmup)
    engine.destroy()
    del keep
    return result


def toolkit_deepspeed(model_dir: Path, data: list, warmup: int, stage: int, batch: int, world_size: int) -> tuple[float, float]:
    from toolkit.builtins.losses import SFTLoss
    from toolkit.builtins.tuners import FullTuner
    from toolkit.contracts import StepContext
    from toolkit.models import load_hf_directory
    from toolkit.recipe import Recipe
    from toolkit_deepspeed.strategy import DeepSpeedStrategy

    recipe = Recipe(model=str(model_dir), strategy="deepspeed", zero=stage, precision="bf16", lr=1e-5, max_grad_norm=1.0,
                    micro_batch_size=batch)
    source = load_hf_directory(str(model_dir), model_dir)
    engine = DeepSpeedStrategy().build(source, FullTuner(), SFTLoss(), recipe)
    engine.set_total_steps(len(data))
    loss = SFTLoss()

    def step(ids: torch.Tensor) -> None:
        b, t = ids.shape
        micro = full_rows(ids)
        tokens = b * (t - 1) * world_size
        engine.train_step([micro], loss, StepContext(label_tokens=tokens, sequences=b * world_size, examples=b * world_size))

    result = timed(step, data, warmup)
    engine.close()
    return result


def main() -> None:
    parser = shape_parser()
    parser.add_argument("--stages", default="1,2,3", help="ZeRO stages to time, e.g. 3 or 1,2,3")
    args = parser.parse_args()

    from toolkit_deepspeed.runtime import init_distributed

    world = init_distributed()
    import deepspeed.comm as dist

    device = world.device.type
    shape = SHAPE_TINY if args.tiny else SHAPE_1B
    seq, batch = (64, 2) if args.tiny else (args.seq, args.batch)
    rows = []
    root = Path(tempfile.mkdtemp(prefix="ds-bench-")) if world.is_main else None
    shared = [str(make_model_dir(shape, root)) if world.is_main else None]
    torch.distributed.broadcast_object_list(shared, src=0)
    model_dir = Path(shared[0])
    data = batches(args.steps + args.warmup, batch, seq, shape["vocab_size"], str(world.device))
    for stage in (int(s) for s in args.stages.split(",")):
        for name, run in ((f"deepspeed ZeRO-{stage} + HF labels= loss (by hand)", lambda z=stage: plain_deepspeed(model_dir, data, args.warmup, z, batch)),
                          (f"toolkit --strategy deepspeed --zero {stage}", lambda z=stage: toolkit_deepspeed(model_dir, data, args.warmup, z, batch, world.world_size))):
            tokens_per_s, peak = run()
            rows.append({"run": name, "zero": stage, "tokens_per_s_per_rank": tokens_per_s, "peak_gib_rank0": peak,
                         "batch": batch, "seq": seq, "ranks": world.world_size})
            gc.collect()
            if device == "cuda":
                torch.cuda.empty_cache()
            dist.barrier()
    if world.is_main:
        device_name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
        print(f"\nfull SFT, bf16, {world.world_size} x {device_name}, batch {batch} x seq {seq} per rank, "
              f"{'tiny' if args.tiny else '1.24B'} Llama shape")
        print(f"{'run':52s} {'tokens/s/rank':>14s} {'peak GiB':>9s}")
        for row in rows:
            print(f"{row['run']:52s} {row['tokens_per_s_per_rank']:14.0f} {row['peak_gib_rank0']:9.1f}")
        if os.environ.get("OUT"):
            Path(os.environ["OUT"], "deepspeed_zero.json").write_text(json.dumps(rows, indent=2))
    from toolkit.train.distributed import shutdown

    shutdown(exit_code=0)


if __name__ == "__main__":
    main()
