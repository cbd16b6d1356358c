"""Forward+backward throughput of one decoder stack: Megatron-Core with our SDPA core attention,
Megatron's local (unfused) attention spec, and HF transformers (SDPA), in one script.

GPU (lead):  torchrun --nproc-per-node 1 bench/megatron_bridge.py            (1.24B shape, bf16, seq 4096)
CPU check:   torchrun --nproc-per-node 1 bench/megatron_bridge.py --tiny
Prints a table; writes $OUT/megatron_bridge.json when OUT is set.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch


def shape(tiny: bool) -> dict:
    if tiny:
        return dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                    intermediate_size=256, vocab_size=1000, seq=128, batch=1)
    return dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                intermediate_size=8192, vocab_size=128256, seq=4096, batch=1)


def timed(step, warmup: int, iters: int, device: torch.device) -> float:
    for _ in range(warmup):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--iters", type=int, default=5)
    args = parser.parse_args()
    s = shape(args.tiny)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("nccl" if cuda else "gloo")
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    from transformers import AutoModelForCausalLM, LlamaConfig

    from toolkit.parallel import ParallelLayout
    from toolkit_megatron.bridge import SafetensorsReader, load_hf_weights
    from toolkit_megatron.compat import cpu_compat
    from toolkit_megatron.model import build_model, initialize_parallel

    seq, batch = s.pop("seq"), s.pop("batch")
    config = LlamaConfig(**s, max_position_embeddings=seq, tie_word_embeddings=False)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(dtype)
    ids = torch.randint(0, config.vocab_size, (batch, seq), device=device)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)
        initialize_parallel(ParallelLayout())
        for attention in ("sdpa", "local"):
            model = build_model(config, ParallelLayout(), dtype=dtype, attention=attention)[0]
            load_hf_weights([model], config, SafetensorsReader.from_directory(tmp))
            model.to(device)

            def step(model=model):
                with cpu_compat():
                    model(ids, None, None).float().mean().backward()

            seconds = timed(step, 1, args.iters, device)
            memory = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
            rows.append({"impl": f"megatron-{attention}", "seconds": seconds, "tokens_per_s": batch * seq / seconds, "peak_gib": memory})
            del model
            if cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
    hf.to(device)

    def hf_step():
        hf(ids).logits.float().mean().backward()

    seconds = timed(hf_step, 1, args.iters, device)
    rows.append({"impl": "hf-sdpa", "seconds": seconds, "tokens_per_s": batch * seq / seconds,
                 "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0})
    print(f"{'impl':<16}{'s/iter':>10}{'tokens/s':>12}{'peak GiB':>10}")
    for row in rows:
        print(f"{row['impl']:<16}{row['seconds']:>10.4f}{row['tokens_per_s']:>12.1f}{row['peak_gib']:>10.2f}")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "megatron_bridge.json"), "w") as f:
            json.dump({"shape": {**s, "seq": seq, "batch": batch}, "dtype": str(dtype), "rows": rows}, f, indent=2)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
