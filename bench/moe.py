"""MoE full-SFT throughput: transformers' own Qwen3-MoE blocks vs toolkit-moe's, in one script.

Default shape: Qwen3-30B-A3B layers (hidden 2048, 128 experts, top-8, expert FFN 768, vocab
151936, 32 query / 4 KV heads of 128) with 4 layers, seq 4096, batch 2, bf16 params and AdamW.
Variants: ``hf`` (transformers' default experts implementation, grouped_mm on GPU),
``moe`` (toolkit-moe blocks, same HF loss), ``moe+chunked`` (toolkit-moe blocks and the
toolkit engines' chunked label log-probs instead of full logits). ``--tiny`` runs a small
shape on CPU. Prints a table; writes ``$OUT/moe.json`` when ``OUT`` is set.

    python bench/moe.py                      # GPU, the issue-9 shape
    python bench/moe.py --tiny               # CPU smoke run (timings on a shared CPU mean nothing)
    python bench/moe.py --layer              # also one MoE block alone, forward + backward
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time


def build_config(tiny: bool, layers: int):
    from transformers import Qwen3MoeConfig

    if tiny:
        return Qwen3MoeConfig(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
                              num_experts_per_tok=2, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                              head_dim=16, norm_topk_prob=True, max_position_embeddings=512)
    return Qwen3MoeConfig(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                          num_experts_per_tok=8, num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=4,
                          head_dim=128, norm_topk_prob=True, max_position_embeddings=40960, rope_theta=1e6)


def step_fn(model, variant: str, ids):

    if variant == "moe+chunked":
        from toolkit.train.logps import label_logps

        hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state
        logps = label_logps(model.lm_head, hidden[:, :-1].reshape(-1, hidden.shape[-1]), ids[:, 1:].reshape(-1))
        loss = -logps.mean()
    else:
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    task_loss = loss.detach().float()
    aux_fn = getattr(model, "toolkit_pop_aux_loss", None)
    aux = aux_fn()[0] if aux_fn else None
    if aux is not None:
        loss = loss + aux
    loss.backward()
    return task_loss


def run_variant(variant: str, args, config, device) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    dtype = torch.bfloat16
    with torch.device(device):  # initialise on the GPU: a 3B-parameter CPU init takes minutes
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa").train()
    implementation = getattr(model.config, "_experts_implementation", None)
    if variant != "hf":
        from toolkit_moe.patch import patch_moe_blocks

        patch_moe_blocks(model, capacity_factor=args.capacity_factor)
        implementation = "toolkit-moe"
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")
    generator = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, config.vocab_size, (args.batch, args.seq), generator=generator).to(device) for _ in range(2)]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    losses, start = [], None
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            sync()
            start = time.perf_counter()
        losses.append(step_fn(model, variant, batches[step % 2]))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    sync()
    elapsed = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    result = {"variant": variant, "experts": implementation, "tokens_per_s": args.batch * args.seq * args.steps / elapsed,
              "step_ms": 1000 * elapsed / args.steps, "peak_gib": peak, "first_loss": float(losses[0]),
              "last_loss": float(losses[-1])}
    print(f"{variant}: {result['tokens_per_s']:.0f} tokens/s, {result['peak_gib']:.1f} GiB", flush=True)
    del model, optimizer, batches
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def run_layer(variant: str, args, config, device) -> dict:
    """One MoE block alone, forward + backward on ``batch * seq`` tokens (attribution of the model numbers)."""
    import torch
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    torch.manual_seed(0)
    block = Qwen3MoeSparseMoeBlock(config)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.02)
    block = block.to(device=device, dtype=torch.bfloat16).train()
    if variant == "moe":
        from toolkit_moe.block import BlockOptions, MoeBlock
        from toolkit_moe.families import FAMILIES

        block = MoeBlock(block, FAMILIES["qwen3_moe"], config, BlockOptions(capacity_factor=args.capacity_factor)).train()
    x = torch.randn(args.batch, args.seq, config.hidden_size, device=device, dtype=torch.bfloat16, requires_grad=True)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            sync()
            start = time.perf_counter()
        block(x).float().square().mean().backward()
    sync()
    elapsed = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    return {"variant": f"layer:{variant}", "experts": "toolkit-moe" if variant == "moe" else getattr(block.experts.config, "_experts_implementation", None),
            "tokens_per_s": args.batch * args.seq * args.steps / elapsed, "step_ms": 1000 * elapsed / args.steps,
            "peak_gib": peak, "first_loss": float("nan"), "last_loss": float("nan")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="small shape for a CPU smoke run")
    parser.add_argument("--variants", default="hf,moe,moe+chunked", help="comma-separated: hf, moe, moe+chunked")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=None)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--capacity-factor", type=float, default=0.0)
    parser.add_argument("--layer", action="store_true", help="also time one MoE block alone (hf vs toolkit-moe)")
    args = parser.parse_args()
    args.seq = args.seq or (64 if args.tiny else 4096)
    args.steps = args.steps or (2 if args.tiny else 10)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 3)

    import torch

    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    config = build_config(args.tiny, args.layers)
    results = [run_variant(v.strip(), args, config, device) for v in args.variants.split(",") if v.strip()]
    if args.layer:
        results += [run_layer(v, args, config, device) for v in ("hf", "moe")]
    print(f"{'variant':<13}{'experts':<13}{'tokens/s':>11}{'step ms':>9}{'peak GiB':>10}{'speed-up':>9}{'loss[0]':>10}{'loss[-1]':>10}")
    for r in results:
        base = next((b for b in results if b["variant"] == ("layer:hf" if r["variant"].startswith("layer:") else "hf")), r)
        r["speedup"] = r["tokens_per_s"] / base["tokens_per_s"]
        print(f"{r['variant']:<13}{str(r['experts']):<13}{r['tokens_per_s']:>11.0f}{r['step_ms']:>9.1f}{r['peak_gib']:>10.2f}"
              f"{r['speedup']:>9.2f}{r['first_loss']:>10.4f}{r['last_loss']:>10.4f}")
    meta = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
            "transformers": __import__("transformers").__version__, "seq": args.seq, "batch": args.batch,
            "layers": args.layers, "steps": args.steps, "tiny": args.tiny, "capacity_factor": args.capacity_factor}
    if os.environ.get("OUT"):
        path = os.path.join(os.environ["OUT"], "moe.json")
        with open(path, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=2)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
