"""Peak memory and step time of each registered optimizer (and the lisa tuner) against AdamW, on the local engine.

The engine is built the way ``toolkit sft --optimizer NAME`` builds it (resolve_components, strategy.build) on a
randomly initialised Llama saved once to a temporary HF directory; every variant trains on the same random
full rows. Columns: optimizer-state bytes after the last step (tensors in ``optimizer.state``, GaLore's
projection matrices included), gradient bytes held at the optimizer step, and on a GPU the allocator's peak
over the run. Default shape: the 1.24B Llama (hidden 2048, 16 layers, FFN 8192, vocab 128256), seq 2048,
batch 4, bf16 with fp32 master weights. ``--tiny`` runs a small shape on CPU.

    python bench/optimizers.py              # GPU (needs toolkit-optim with its [all] extra)
    python bench/optimizers.py --tiny       # CPU smoke run of the same code paths
    python bench/optimizers.py --strategy fsdp   # the same under FSDP2 on one process (DTensor parameters: the
                                                 # sharded adafactor / adamw-8bit / lisa code paths on the GPU)
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import full_rows  # noqa: E402

SHAPES = {
    "1.24b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                  intermediate_size=8192, vocab_size=128256, head_dim=64, tie_word_embeddings=False),
    "tiny": dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=256, vocab_size=1024, head_dim=32, tie_word_embeddings=False),
}
# name -> recipe values on top of the common ones; GaLore's rank as the paper's 1B runs (512)
VARIANTS = {
    "adamw": {},
    "adamw-8bit": {"optimizer": "adamw-8bit"},
    "adafactor": {"optimizer": "adafactor"},
    "galore": {"optimizer": "galore", "galore": {"rank": 512, "update_proj_gap": 200}},
    "lisa": {"tuner": "lisa", "lisa": {"layers": 2, "interval": 20}},
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="small shape on CPU (checks the code paths)")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--seq-len", type=int, default=None)
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--strategy", choices=("local", "fsdp"), default="local")
    args = parser.parse_args()
    args.seq_len = args.seq_len or (64 if args.tiny else 2048)
    args.batch = args.batch or (2 if args.tiny else 4)
    args.steps = args.steps or (3 if args.tiny else 6)
    return args


def make_model_dir(args: argparse.Namespace, root: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    from toolkit.models import TOKENIZER_DIR

    shape = SHAPES["tiny" if args.tiny else "1.24b"]
    config = LlamaConfig(**shape, max_position_embeddings=max(args.seq_len, 4096), rope_theta=500000.0)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    if not args.tiny:
        model = model.to(torch.bfloat16)
    model.save_pretrained(root / "model")
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(TOKENIZER_DIR).save_pretrained(root / "model")
    return root / "model"


def state_bytes(optimizer) -> int:
    total = 0
    for state in optimizer.state.values():
        # this rank's part of a DTensor (under fsdp)
        tensors = [v.to_local() if hasattr(v, "to_local") else v for v in state.values() if torch.is_tensor(v)]
        projector = state.get("projector")
        if projector is not None:
            matrix = projector.ortho_matrix
            tensors += list(matrix) if isinstance(matrix, (list, tuple)) else [matrix]
        total += sum(t.numel() * t.element_size() for t in tensors if t.dim())
    return total


def run_variant(name: str, args: argparse.Namespace, model_dir: Path, device: torch.device) -> dict:
    from toolkit.models import resolve_model
    from toolkit.recipe import resolve_recipe
    from toolkit.train.runner import resolve_components

    values = {"model": str(model_dir), "lr": 1e-5, "schedule": "constant", "micro_batch_size": args.batch,
              "seq_len": args.seq_len, "precision": "fp32" if args.tiny else "bf16", "strategy": args.strategy,
              **VARIANTS[name]}
    if args.tiny and name == "galore":
        values["galore"] = {"rank": 16, "update_proj_gap": 200}  # the tiny matrices are 128 wide
    strategy, tuner, loss, recipe = resolve_components(resolve_recipe(values, source=f"bench {name}"), 1)
    source = resolve_model(recipe.model)
    problems = tuner.validate(recipe, source)
    if problems:
        raise SystemExit(f"{name}: {problems}")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    engine = strategy.build(source, tuner, loss, recipe)
    engine.set_total_steps(args.steps)
    generator = torch.Generator().manual_seed(1)
    from toolkit.contracts import StepContext

    grads, times = 0, []
    for step in range(args.steps):
        ids = torch.randint(0, source.config.vocab_size, (args.batch, args.seq_len), generator=generator)
        batch = full_rows(ids)
        ctx = StepContext(label_tokens=int((batch["labels"] != -100).sum()), sequences=args.batch, examples=args.batch, step=step)
        start = time.perf_counter()
        result = engine.train_step([batch], loss, ctx)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    optimized = engine.master.master if engine.master is not None else engine.params
    grads = sum(p.numel() * 4 for p in optimized if p.requires_grad) if name != "lisa" else sum(
        p.numel() * 4 for p in engine.model.parameters() if p.requires_grad)
    row = {"run": name, "state_gib": state_bytes(engine.optimizer) / 2**30, "grad_gib": grads / 2**30,
           "step_s": sum(times[1:]) / max(1, len(times) - 1), "loss": result.loss,
           "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")}
    engine.close()
    del engine
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def main() -> None:
    from toolkit.errors import ToolkitError

    args = parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model_dir(args, Path(tmp))
        rows = []
        for name in args.variants.split(","):
            try:
                rows.append(run_variant(name, args, model_dir, device))
            except ToolkitError as exc:  # e.g. bitsandbytes or galore-torch missing on the GPU image: say so, go on
                print(f"{name}: skipped ({str(exc).splitlines()[0]})", file=sys.stderr)
    base = next((r for r in rows if r["run"] == "adamw"), rows[0])
    print(f"\noptimizer memory, {'tiny' if args.tiny else '1.24B'} Llama, seq {args.seq_len} x batch {args.batch}, {device}, "
          f"--strategy {args.strategy}")
    print(f"{'run':12s} {'state GiB':>10s} {'vs adamw':>9s} {'grads GiB':>10s} {'peak GiB':>9s} {'s/step':>8s} {'loss':>8s}")
    for r in rows:
        ratio = r["state_gib"] / base["state_gib"] if base["state_gib"] else float("nan")
        print(f"{r['run']:12s} {r['state_gib']:10.4f} {ratio:9.2f} {r['grad_gib']:10.4f} {r['peak_gib']:9.2f} "
              f"{r['step_s']:8.3f} {r['loss']:8.4f}")
    if os.environ.get("OUT"):
        suffix = "" if args.strategy == "local" else f"-{args.strategy}"
        Path(os.environ["OUT"], f"optimizers{suffix}.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
