"""Full-SFT training throughput: toolkit's megatron engine vs a plain HF transformers loop, one script.

GPU (lead), 1.24B shape (hidden 2048, 16 layers, 32 heads, 8 KV heads, FFN 8192, vocab 128256), bf16:
    torchrun --nproc-per-node 1 bench/megatron_train.py                 (megatron TP1 vs HF on one GPU)
    torchrun --nproc-per-node 2 bench/megatron_train.py --tp 2          (megatron TP2; HF baseline on rank 0)
CPU check:
    torchrun --nproc-per-node 1 bench/megatron_train.py --tiny
Both sides run the same synthetic batches (full rows, every token trained) with AdamW and clipping
at 1.0. Prints a table; writes $OUT/megatron_train.json when OUT is set.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch


def model_config(tiny: bool):
    from transformers import LlamaConfig

    if tiny:
        return LlamaConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                           intermediate_size=256, vocab_size=1000, max_position_embeddings=256, tie_word_embeddings=False)
    return LlamaConfig(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                       intermediate_size=8192, vocab_size=128256, max_position_embeddings=4096, tie_word_embeddings=False)


def micro_batch(vocab: int, batch: int, seq: int, device: torch.device, seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq + 1), generator=generator)
    rows = torch.arange(batch)
    return {"input_ids": ids[:, :-1].to(device), "labels": ids[:, 1:].to(device),
            "position_ids": torch.arange(seq)[None].repeat(batch, 1).to(device),
            "sequence_ids": rows[:, None].repeat(1, seq).to(device),
            "sequence_meta": {"example_ids": rows.to(device), "roles": torch.zeros(batch, dtype=torch.long, device=device)},
            "num_sequences": batch}


def bench_hf(directory: Path, args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation="sdpa").to(device)
    model.config.use_cache = False
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)

    def step(seed: int) -> None:
        batch = micro_batch(model.config.vocab_size, args.micro_batch_size, args.seq, device, seed)
        with autocast:
            logits = model(input_ids=batch["input_ids"]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), batch["labels"].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    seconds = timed(step, args, device)
    return {"impl": "hf-transformers", "seconds_per_step": seconds, "tokens_per_s": args.micro_batch_size * args.seq / seconds,
            "peak_gib": peak(device)}


def bench_megatron(directory: Path, args: argparse.Namespace, device: torch.device) -> dict:
    from transformers import AutoConfig

    from toolkit.contracts import ModelSource, StepContext
    from toolkit.plugins import get_plugin_manager
    from toolkit.recipe import Recipe
    from toolkit_megatron.strategy import MegatronConfig, MegatronEngine

    recipe = Recipe(model=str(directory), strategy="megatron", tensor_parallel=args.tp, pipeline_parallel=args.pp,
                    precision="bf16" if device.type == "cuda" else "fp32", lr=1e-5, max_grad_norm=1.0,
                    seq_len=args.seq, micro_batch_size=args.micro_batch_size, gradient_checkpointing=args.recompute)
    source = ModelSource(reference=str(directory), directory=directory, config=AutoConfig.from_pretrained(directory),
                         tokenizer=None, weight_files=sorted(directory.glob("*.safetensors")))
    manager = get_plugin_manager()
    loss = manager.create("loss", "sft")
    engine = MegatronEngine(source, manager.create("tuner", "full"), loss, recipe, MegatronConfig(attention=args.attention))
    engine.set_total_steps(args.warmup + args.steps)
    micro = args.pp  # the pipeline needs at least pp micro-batches per step
    tokens = micro * args.micro_batch_size * args.seq * engine.dp_world_size
    ctx = StepContext(label_tokens=tokens, sequences=micro * args.micro_batch_size * engine.dp_world_size,
                      examples=micro * args.micro_batch_size * engine.dp_world_size)

    def step(seed: int) -> None:
        batches = [micro_batch(source.config.vocab_size, args.micro_batch_size, args.seq, device, seed * 10 + i) for i in range(micro)]
        engine.train_step(batches, loss, ctx)

    seconds = timed(step, args, device)
    world = torch.distributed.get_world_size()
    return {"impl": f"megatron-{args.attention} tp{args.tp} pp{args.pp}", "seconds_per_step": seconds,
            "tokens_per_s": tokens / seconds, "tokens_per_s_per_gpu": tokens / seconds / world, "peak_gib": peak(device)}


def timed(step, args: argparse.Namespace, device: torch.device) -> float:
    for i in range(args.warmup):
        step(i)
    sync(device)
    start = time.perf_counter()
    for i in range(args.steps):
        step(args.warmup + i)
    sync(device)
    return (time.perf_counter() - start) / args.steps


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def peak(device: torch.device) -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="a tiny model on the CPU (checks the script runs)")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--attention", choices=["sdpa", "local"], default="sdpa")
    parser.add_argument("--seq", type=int, default=None)
    parser.add_argument("--micro-batch-size", type=int, default=1)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--recompute", action="store_true")
    args = parser.parse_args()
    args.seq = args.seq or (64 if args.tiny else 4096)
    cuda = torch.cuda.is_available()
    rank = int(os.environ.get("RANK", 0))
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("nccl" if cuda else "gloo")
    config = model_config(args.tiny)
    directory = Path(tempfile.gettempdir()) / f"toolkit-bench-{'tiny' if args.tiny else '1b'}"
    if rank == 0 and not (directory / "config.json").is_file():
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    torch.distributed.barrier()
    rows = [bench_megatron(directory, args, device)]
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    torch.distributed.barrier()
    if rank == 0:
        rows.append(bench_hf(directory, args, device, torch.bfloat16 if cuda else torch.float32))
        print(f"{'impl':<28}{'s/step':>10}{'tokens/s':>12}{'peak GiB':>10}")
        for row in rows:
            print(f"{row['impl']:<28}{row['seconds_per_step']:>10.4f}{row['tokens_per_s']:>12.1f}{row['peak_gib']:>10.2f}")
        if os.environ.get("OUT"):
            Path(os.environ["OUT"], "megatron_train.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
    torch.distributed.barrier()
    from toolkit_megatron.checkpoint import stop_checkpoint_workers

    stop_checkpoint_workers()
    torch.distributed.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
