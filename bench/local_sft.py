"""Full SFT throughput: the toolkit ``local`` engine beside a plain HF transformers loop, same script.

    python bench/local_sft.py              # 1.24B Llama shape, seq 4096, batch 4, bf16 (one GPU)
    python bench/local_sft.py --tiny       # a CPU smoke run of the same code path

Prints a table (tokens/s, peak GiB) and writes JSON to $OUT/local_sft.json when OUT is set.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch
from common import full_rows, report, run_all, shape_parser

SHAPE_1B = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                intermediate_size=8192, vocab_size=128256, max_position_embeddings=8192, head_dim=64)
SHAPE_TINY = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=256, vocab_size=768, max_position_embeddings=512, head_dim=32)


def make_model_dir(shape: dict, root: Path) -> Path:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from toolkit.models import TOKENIZER_DIR

    config = LlamaConfig(**shape, tie_word_embeddings=False, torch_dtype="bfloat16", attn_implementation="sdpa")
    with torch.device("cpu"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(root, safe_serialization=True)
    AutoTokenizer.from_pretrained(TOKENIZER_DIR).save_pretrained(root)
    return root


def batches(steps: int, batch: int, seq: int, vocab: int, device: str) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (batch, seq), generator=generator).to(device) for _ in range(steps)]


def timed(step_fn, data: list, warmup: int) -> tuple[float, float]:
    device = data[0].device
    for ids in data[:warmup]:
        step_fn(ids)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for ids in data[warmup:]:
        step_fn(ids)
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    tokens = sum(ids.numel() for ids in data[warmup:])
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    return tokens / elapsed, peak


def hf_baseline(model_dir: Path, data: list, warmup: int, compile_model: bool = False) -> tuple[float, float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, attn_implementation="sdpa").to(data[0].device)
    model.config.use_cache = False
    if compile_model:
        model = torch.compile(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=data[0].device.type == "cuda")

    def step(ids: torch.Tensor) -> None:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return timed(step, data, warmup)


def toolkit_engine(model_dir: Path, data: list, warmup: int, precision: str, master_weights: bool = True) -> tuple[float, float]:
    from toolkit.builtins.losses import SFTLoss
    from toolkit.builtins.strategies import LocalConfig, LocalEngine
    from toolkit.builtins.tuners import FullTuner
    from toolkit.contracts import StepContext
    from toolkit.models import load_hf_directory
    from toolkit.recipe import Recipe

    recipe = Recipe(model=str(model_dir), precision=precision, lr=1e-5, max_grad_norm=1.0)
    source = load_hf_directory(str(model_dir), model_dir)
    engine = LocalEngine(source, FullTuner(), SFTLoss(), recipe, LocalConfig(master_weights=master_weights))
    engine.set_total_steps(len(data))
    loss = SFTLoss()

    def step(ids: torch.Tensor) -> None:
        b, t = ids.shape
        engine.train_step([full_rows(ids)], loss, StepContext(label_tokens=b * (t - 1), sequences=b, examples=b))

    return timed(step, data, warmup)


def main() -> None:
    parser = shape_parser()
    parser.add_argument("--compile", action="store_true", help="also time HF + torch.compile")
    parser.add_argument("--autocast", action="store_true", help="also time fp32 parameters under bf16 autocast")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shape = SHAPE_TINY if args.tiny else SHAPE_1B
    seq, batch = (64, 2) if args.tiny else (args.seq, args.batch)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model_dir(shape, Path(tmp))
        data = batches(args.steps + args.warmup, batch, seq, shape["vocab_size"], device)
        runs = [("hf transformers (bf16 params, labels= loss)", lambda: hf_baseline(model_dir, data, args.warmup))]
        if args.compile:
            runs.append(("hf transformers + torch.compile", lambda: hf_baseline(model_dir, data, args.warmup, True)))
        runs.append(("toolkit local --precision bf16 (bf16 params, fp32 master)", lambda: toolkit_engine(model_dir, data, args.warmup, "bf16")))
        if args.autocast:
            runs.append(("toolkit local, fp32 params under bf16 autocast",
                         lambda: toolkit_engine(model_dir, data, args.warmup, "bf16", master_weights=False)))
        rows = run_all(runs, device, batch=batch, seq=seq)
    device_name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    report(f"full SFT, {device_name}, batch {batch} x seq {seq}, {'tiny' if args.tiny else '1.24B'} Llama shape", rows, "local_sft.json")


if __name__ == "__main__":
    main()
