"""LoRA SFT throughput and peak memory: plain HF transformers + PEFT vs toolkit's lora tuner on the local engine.

Same process, same random weights (saved once to a temporary HF directory), same tokens. Default
shape: the 1.24B Llama (hidden 2048, 16 layers, 32 heads, 8 KV heads, FFN 8192, vocab 128256),
seq 4096, batch 4, bf16, r=16 on every linear layer. ``--tiny`` runs a small shape on CPU.

    python bench/peft_lora.py                 # GPU, prints a table, writes $OUT/peft_lora.json if OUT is set
    python bench/peft_lora.py --tiny          # CPU smoke run of the same code paths

Variants: ``hf-peft`` (HF forward with labels -> full-vocabulary loss, PEFT's LoRA layers, AdamW),
``toolkit`` (lora tuner: bf16 frozen base, fp32 adapters, fused LoRA forward; local engine: chunked
label log-probs with the frozen-head gradient made in forward), ``toolkit-peft-forward`` (the same
with PEFT's own LoRA forward) and ``toolkit-fp32-base`` (the same with an fp32 frozen base under
autocast), to show what each part is worth. ``--variants hf-peft-qlora,toolkit-qlora`` compares
QLoRA (NF4, double quantisation, bf16 compute) the same way.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

SHAPES = {
    "1.24b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                  intermediate_size=8192, vocab_size=128256, head_dim=64, tie_word_embeddings=True),
    "tiny": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=256, vocab_size=1024, head_dim=32, tie_word_embeddings=True),
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="small shape on CPU (checks the code paths)")
    parser.add_argument("--seq-len", type=int, default=None)
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--alpha", type=float, default=32.0)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--steps", type=int, default=None, help="timed optimizer steps")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first")
    parser.add_argument("--variants", default="hf-peft,toolkit,toolkit-peft-forward,toolkit-fp32-base")
    parser.add_argument("--chunk-tokens", type=int, default=2048, help="local engine: tokens per log-prob chunk (its default)")
    parser.add_argument("--profile", action="store_true", help="after timing, profile one step per variant and print the top kernels")
    args = parser.parse_args()
    args.seq_len = args.seq_len or (64 if args.tiny else 4096)
    args.batch = args.batch or (2 if args.tiny else 4)
    args.steps = args.steps or (3 if args.tiny else 10)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 3)
    return args


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def make_model_dir(args: argparse.Namespace, root: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = SHAPES["tiny" if args.tiny else "1.24b"]
    config = LlamaConfig(**shape, max_position_embeddings=max(args.seq_len, 4096), rope_theta=500000.0,
                         dtype="bfloat16", attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(device()):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    directory = root / "model"
    model.save_pretrained(directory)
    del model
    return directory


def make_batch(args: argparse.Namespace, vocab: int) -> dict:
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab, (args.batch, args.seq_len + 1), generator=generator)
    rows = args.batch
    return {
        "input_ids": tokens[:, :-1].contiguous(),
        "labels": tokens[:, 1:].contiguous(),  # already shifted (the engine's micro-batch contract)
        "position_ids": torch.arange(args.seq_len).expand(rows, -1).contiguous(),
        "sequence_ids": torch.arange(rows)[:, None].expand(-1, args.seq_len).contiguous(),  # one sequence per row
        "sequence_meta": {"example_ids": torch.arange(rows), "roles": torch.zeros(rows, dtype=torch.long)},
        "num_sequences": rows,
    }


def reset_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_gib() -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else float("nan")


def timed(step, args: argparse.Namespace) -> tuple[float, list[float]]:
    losses = [step() for _ in range(args.warmup)]
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    losses += [step() for _ in range(args.steps)]
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    if args.profile:
        profile(step)
    return seconds, losses


def profile(step) -> None:
    """One step under torch.profiler; the 15 most expensive kernels/ops by self time."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with torch_profile(activities=activities) as prof:
        step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=15), file=sys.stderr, flush=True)


def run_hf_peft(args: argparse.Namespace, model_dir: Path, batch: dict, qlora: bool = False) -> dict:
    import peft
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    if qlora:
        quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                          bnb_4bit_compute_dtype=torch.bfloat16)
        target = {"": torch.cuda.current_device()} if torch.cuda.is_available() else None
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, attn_implementation="sdpa",
                                                     quantization_config=quantization, device_map=target)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, attn_implementation="sdpa").to(device())
    model.config.use_cache = False
    config = peft.LoraConfig(r=args.rank, lora_alpha=args.alpha, lora_dropout=args.dropout, target_modules="all-linear",
                             task_type="CAUSAL_LM")
    model = peft.get_peft_model(model, config)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    ids = batch["input_ids"].to(device())

    def step() -> float:
        # The usual HF recipe: labels=input_ids, the model shifts them and builds full-vocabulary logits.
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(out.loss)

    seconds, losses = timed(step, args)
    return {"seconds": seconds, "losses": losses, "trainable": sum(p.numel() for p in params), "_keep": model}


def run_toolkit(args: argparse.Namespace, model_dir: Path, batch: dict, fast_forward: bool, base_dtype: str = "auto",
                tuner_name: str = "lora") -> dict:
    from transformers import AutoConfig

    from toolkit.contracts import ModelSource, StepContext
    from toolkit.plugins import get_plugin_manager
    from toolkit.recipe import resolve_recipe

    recipe = resolve_recipe({"model": str(model_dir), "tuner": tuner_name, "loss": "sft", "precision": "bf16",
                             "seq_len": args.seq_len, "micro_batch_size": args.batch, "lr": 1e-4,
                             tuner_name: {"rank": args.rank, "alpha": args.alpha, "dropout": args.dropout, "fast_forward": fast_forward,
                                      "base_dtype": base_dtype},
                             "local": {"logps_chunk_tokens": args.chunk_tokens}}, source="bench")
    manager = get_plugin_manager()
    source = ModelSource(reference=str(model_dir), directory=model_dir, config=AutoConfig.from_pretrained(model_dir),
                         tokenizer=None, weight_files=sorted(model_dir.glob("*.safetensors")))
    tuner_cls, loss_cls, strategy_cls = (manager.get(k, n) for k, n in (("tuner", tuner_name), ("loss", "sft"), ("strategy", "local")))
    tuner = tuner_cls(tuner_cls.Config(**recipe.section(tuner_name)))
    problems = tuner.validate(recipe, source)
    if problems:
        raise SystemExit("\n".join(problems))
    loss = loss_cls()
    engine = strategy_cls(strategy_cls.Config(**recipe.section("local"))).build(source, tuner, loss, recipe)
    engine.set_total_steps(args.warmup + args.steps)
    tokens = int(batch["labels"].numel())
    ctx = StepContext(label_tokens=tokens, sequences=args.batch, examples=args.batch)

    def step() -> float:
        return engine.train_step([batch], loss, ctx).loss

    seconds, losses = timed(step, args)
    trainable = sum(p.numel() for p in engine.params)
    return {"seconds": seconds, "losses": losses, "trainable": trainable, "_keep": engine}


def main() -> None:
    args = parse_args()
    if not args.tiny and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --tiny on CPU")
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench-peft-") as tmp:
        model_dir = make_model_dir(args, Path(tmp))
        from transformers import AutoConfig

        batch = make_batch(args, AutoConfig.from_pretrained(model_dir).vocab_size)
        tokens_per_step = args.batch * args.seq_len
        for variant in [v.strip() for v in args.variants.split(",") if v.strip()]:
            reset_memory()
            if variant in ("hf-peft", "hf-peft-qlora"):
                result = run_hf_peft(args, model_dir, batch, qlora=variant == "hf-peft-qlora")
            elif variant == "toolkit-qlora":
                result = run_toolkit(args, model_dir, batch, fast_forward=True, tuner_name="qlora")
            elif variant in ("toolkit", "toolkit-peft-forward", "toolkit-fp32-base"):
                result = run_toolkit(args, model_dir, batch, fast_forward=variant != "toolkit-peft-forward",
                                     base_dtype="fp32" if variant == "toolkit-fp32-base" else "auto")
            else:
                raise SystemExit(f"unknown variant {variant!r}")
            result.pop("_keep")
            result.update(tokens_per_s=tokens_per_step * args.steps / result["seconds"], peak_gib=peak_gib())
            results[variant] = result
            print(f"{variant}: {result['tokens_per_s']:.0f} tokens/s, peak {result['peak_gib']:.1f} GiB, "
                  f"losses {[round(x, 4) for x in result['losses']]}", file=sys.stderr, flush=True)
            del result
            reset_memory()
    print_table(args, results)
    write_json(args, results)


def print_table(args: argparse.Namespace, results: dict) -> None:
    shape = "tiny" if args.tiny else "1.24B"
    where = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    print(f"\nLoRA SFT, {shape} shape, seq {args.seq_len}, batch {args.batch}, r={args.rank} all-linear, bf16, {where}")
    print(f"{'variant':<24}{'tokens/s':>12}{'peak GiB':>10}{'trainable':>12}{'first loss':>12}{'speed-up':>10}")
    base = results.get("hf-peft", {}).get("tokens_per_s")
    for name, r in results.items():
        speedup = f"{r['tokens_per_s'] / base:.2f}x" if base else "-"
        print(f"{name:<24}{r['tokens_per_s']:>12.0f}{r['peak_gib']:>10.1f}{r['trainable']:>12,}{r['losses'][0]:>12.4f}{speedup:>10}")


def write_json(args: argparse.Namespace, results: dict) -> None:
    out = os.environ.get("OUT")
    if not out:
        return
    payload = {"args": vars(args), "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
               "torch": torch.__version__, "results": results}
    path = Path(out) / "peft_lora.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
