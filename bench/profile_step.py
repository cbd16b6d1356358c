"""Where one training step's GPU time goes: torch.profiler over the HF baseline and the ``local`` engine.

    python bench/profile_step.py             # 1.24B Llama shape, batch 4 x seq 4096, bf16, one GPU
    python bench/profile_step.py --tiny      # CPU smoke run

Prints, for each side, the kernels that take the most device time over the profiled steps, so a
speed change can be aimed at what costs. Writes the tables to $OUT/profile_step.txt when OUT is set.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch
from common import full_rows, shape_parser
from local_sft import SHAPE_1B, SHAPE_TINY, batches, make_model_dir


def hf_step(model_dir: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, attn_implementation="sdpa")
    model = model.to("cuda" if torch.cuda.is_available() else "cpu")
    model.config.use_cache = False
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=torch.cuda.is_available())

    def step(ids: torch.Tensor) -> None:
        model(input_ids=ids, labels=ids).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def toolkit_step(model_dir: Path):
    from toolkit.builtins.losses import SFTLoss
    from toolkit.builtins.strategies import LocalConfig, LocalEngine
    from toolkit.builtins.tuners import FullTuner
    from toolkit.contracts import StepContext
    from toolkit.models import load_hf_directory
    from toolkit.recipe import Recipe

    recipe = Recipe(model=str(model_dir), precision="bf16", lr=1e-5, max_grad_norm=1.0)
    engine = LocalEngine(load_hf_directory(str(model_dir), model_dir), FullTuner(), SFTLoss(), recipe, LocalConfig())
    engine.set_total_steps(100)
    loss = SFTLoss()

    def step(ids: torch.Tensor) -> None:
        b, t = ids.shape
        engine.train_step([full_rows(ids)], loss, StepContext(label_tokens=b * (t - 1), sequences=b, examples=b))

    return step


def profile(name: str, step, data: list, rows: int) -> str:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    for ids in data[:2]:
        step(ids)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with torch_profile(activities=activities) as prof:
        for ids in data[2:]:
            step(ids)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    key = "self_device_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=70)
    return f"== {name} ({len(data) - 2} steps) ==\n{table}\n"


def main() -> None:
    parser = shape_parser(steps=2, warmup=2)
    parser.add_argument("--rows", type=int, default=30)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    shape = SHAPE_TINY if args.tiny else SHAPE_1B
    seq, batch = (64, 2) if args.tiny else (args.seq, args.batch)
    text = ""
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model_dir(shape, Path(tmp))
        data = batches(args.steps + 2, batch, seq, shape["vocab_size"], device)
        for name, build in (("hf transformers", hf_step), ("toolkit local bf16", toolkit_step)):
            part = profile(name, build(model_dir), data, args.rows)
            print(part, flush=True)
            text += part
            torch.cuda.empty_cache() if device == "cuda" else None
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "profile_step.txt").write_text(text)


if __name__ == "__main__":
    main()
