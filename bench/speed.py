"""Speed levers of the ``local`` engine beside HF transformers (and HF + PEFT for LoRA), one script.

    python bench/speed.py --group full       # full-SFT levers on the GPU (1.24B Llama, seq 4096, batch 4, bf16), ~6 min
    python bench/speed.py --group lora       # LoRA: HF + PEFT vs the lora tuner with the levers, ~3 min
    python bench/speed.py --group extra      # HF + torch.compile, compile + cuDNN, Liger's kernels
    python bench/speed.py --group defaults   # HF, HF + PEFT and the toolkit with no speed flags only
    python bench/speed.py --group packed     # packed rows (several samples per row): HF's own packed handling vs flex
    python bench/speed.py                    # all of them (more than one 10-minute device call)
    python bench/speed.py --cases 'hf,local defaults'   # chosen cases (--list shows them)
    python bench/speed.py --tiny             # the same code paths on CPU with a tiny shape
    python bench/speed.py --plot speed.json  # PNG of tokens/s and peak memory per case (needs matplotlib)

"local defaults" and "lora defaults" run the engine with no speed option at all (what a user gets: on a GPU
``--local-kernels auto`` = Triton and the ``auto`` fused loss); every other toolkit case names its options
explicitly, so it measures the same thing whatever the defaults are. First a kernel check (GPU): each Triton kernel (and Liger's, when installed) against the torch
reference, forward and backward, max abs difference and time. Then each case runs in its own
subprocess with a timeout, on the same Zipf-distributed tokens, same model weights, batch,
precision (bf16 compute) and AdamW settings; "long" cases run --long-steps steps and their
losses are printed side by side. Peak is ``torch.cuda.max_memory_allocated`` over the timed steps;
``syncs`` counts host synchronisations in one extra step (``torch.cuda.set_sync_debug_mode``).
Results go to $OUT/speed.json after every case (a time limit keeps what finished).

Packed cases ("hf-packed", "local-packed*"): every row holds several samples of random lengths (seq/16 to
seq/2, the last one cut to fill the row; the same layout in every process), positions restart per sample and
no token attends across samples. HF's baseline is its own packed handling (transformers 5: position ids that
restart and no attention mask -> a dense block-causal mask for SDPA; "hf-packed-flex": HF's own BlockMask and
compiled flex_attention, GPU only). The toolkit runs the same rows with ``--local-packed-attention sdpa-mask``
(dense mask) and ``flex`` (BlockMask). On CPU (``--tiny``) torch refuses FlexAttention's backward, so the flex
case lifts that check there and runs the eager reference (a smoke test of the code path, not a speed).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SHAPE_1B = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                intermediate_size=8192, vocab_size=128256, max_position_embeddings=8192, head_dim=64)
SHAPE_TINY = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=256, vocab_size=768, max_position_embeddings=512, head_dim=32)
LR = 1e-4
OFF = {"kernels": "none", "fused_loss": False}  # the engine's defaults are auto: the explicit cases say what they use
KERNELS = {"kernels": "triton", "fused_loss": False}
FUSED = {"kernels": "triton", "fused_loss": True}
COMPILED = {**FUSED, "compile": True}
# name: (kind, engine options, long run, what it shows). The fastest short full-SFT case is re-run
# long afterwards ("best"), so the loss curves compare HF with what the toolkit would really run.
CASES = {
    "hf": ("hf", {}, True, "HF transformers: bf16 params and Adam states, SDPA, fused AdamW, labels= loss"),
    "hf-compile": ("hf", {"compile": True}, False, "HF transformers + torch.compile of each decoder layer"),
    "local defaults": ("full", {}, False, "toolkit local with no speed flags: the engine's own defaults (auto kernels, "
                       "auto fused loss: on a GPU Triton kernels + fused linear-CE)"),
    "local": ("full", OFF, False, "toolkit local, levers off: bf16 params, fp32 master weights, chunked log-probs"),
    "local+kernels": ("full", KERNELS, False, "+ Triton RMSNorm/SwiGLU/RoPE"),
    "local+kernels+fused": ("full", FUSED, False, "+ fused linear cross-entropy head"),
    "local+kernels+fused+cudnn": ("full", {**FUSED, "attention": "cudnn"}, False, "+ cuDNN SDPA attention first"),
    "local+kernels+fused+compile": ("full", COMPILED, False, "+ torch.compile of each decoder layer"),
    "local+compile+cudnn": ("full", {**COMPILED, "attention": "cudnn"}, False, "compiled, with cuDNN attention"),
    "local+liger+fused": ("full", {"kernels": "liger", "fused_loss": True}, False, "Liger's kernels instead of ours"),
    "local pure": ("full", {"bf16_mode": "pure"}, False, "the defaults with --local-bf16-mode pure: bf16 params, grads "
                   "and AdamW states, the precision and optimizer of the HF baseline (like against like)"),
    "local pure+compile": ("full", {**COMPILED, "bf16_mode": "pure"}, False, "pure bf16, + torch.compile of each decoder layer"),
    "local+fp8": ("full", {**COMPILED, "fp8": True}, True, "+ float8 linears (torchao), compiled"),
    "hf-peft": ("hf-peft", {}, False, "HF + PEFT LoRA r=16 all-linear (baseline of the LoRA cases)"),
    "lora defaults": ("lora", {}, False, "toolkit lora tuner with no speed flags: the engine's own defaults"),
    "lora": ("lora", OFF, False, "toolkit lora tuner on the local engine, levers off"),
    "lora+kernels+fused": ("lora", FUSED, False, "+ Triton kernels and the fused head"),
    "lora+kernels+fused+cudnn": ("lora", {**FUSED, "attention": "cudnn"}, False, "+ cuDNN SDPA attention first"),
    "lora+kernels+fused+compile": ("lora", COMPILED, False, "+ torch.compile of each decoder layer"),
    "hf-packed": ("hf-packed", {}, False, "HF transformers on packed rows: position ids restart per sample, no mask -> "
                  "HF builds a dense block-causal mask for SDPA"),
    "hf-packed-flex": ("hf-packed", {"attn": "flex_attention"}, False, "HF with attn_implementation=flex_attention: "
                       "its own BlockMask from the position ids, compiled flex_attention (GPU only)"),
    "local-packed": ("packed", {**OFF, "packed_attention": "sdpa-mask"}, False,
                     "toolkit local on packed rows, levers off, dense block-causal mask for SDPA"),
    "local-packed+flex": ("packed", {**OFF, "packed_attention": "flex"}, False,
                          "toolkit local on packed rows, levers off, FlexAttention with a document BlockMask"),
    "local-packed+kernels+fused+flex": ("packed", {**FUSED, "packed_attention": "flex"}, False,
                                        "+ Triton kernels and the fused head"),
    "local-packed defaults": ("packed", {}, False, "toolkit local on packed rows with no speed flags (on a GPU: "
                              "Triton kernels, fused head, dense mask until flex is the default)"),
}
GROUPS = {
    "full": ["hf", "local defaults", "local", "local+kernels", "local+kernels+fused", "local+kernels+fused+cudnn",
             "local+kernels+fused+compile", "local pure", "local pure+compile", "local+fp8"],
    "lora": ["hf-peft", "lora defaults", "lora", "lora+kernels+fused", "lora+kernels+fused+cudnn", "lora+kernels+fused+compile"],
    "extra": ["hf", "hf-compile", "local+compile+cudnn", "local+liger+fused"],
    "packed": ["hf-packed", "hf-packed-flex", "local-packed", "local-packed+flex", "local-packed+kernels+fused+flex",
               "local-packed defaults"],
}
GROUPS["all"] = list(dict.fromkeys(GROUPS["full"] + GROUPS["lora"] + GROUPS["extra"] + GROUPS["packed"]))
GROUPS["defaults"] = ["hf", "local defaults", "local pure", "hf-peft", "lora defaults"]  # what a user gets, beside the baselines, ~2 min


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    sys.path.insert(0, str(HERE))
    from common import shape_parser

    parser = shape_parser()
    parser.add_argument("--long-steps", type=int, default=50, help="steps of the long cases (losses side by side)")
    parser.add_argument("--group", choices=sorted(GROUPS), default="all")
    parser.add_argument("--cases", default="", help="comma-separated case names (overrides --group)")
    parser.add_argument("--timeout", type=int, default=240, help="seconds per case (compiled cases get 1.5x)")
    parser.add_argument("--no-check", action="store_true", help="skip the kernel check")
    parser.add_argument("--list", action="store_true", help="list the cases and exit")
    parser.add_argument("--plot", metavar="JSON", nargs="+", help="draw tokens/s and peak memory per case from speed.json file(s) and exit")
    parser.add_argument("--output", default=None, help="--plot: PNG path (default: beside the JSON)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.tiny:
        args.batch, args.seq = 2, 64
        args.steps, args.warmup, args.long_steps = min(args.steps, 3), min(args.warmup, 1), min(args.long_steps, 6)
    return args


# ----------------------------------------------------------------------------- worker side (one case per process)


def device():
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def make_models(args: argparse.Namespace, root: Path) -> None:
    """Two HF directories with the same random weights: untied head (full SFT), tied (the LoRA bench's shape)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from toolkit.models import TOKENIZER_DIR

    shape = SHAPE_TINY if args.tiny else SHAPE_1B
    for name, tied in (("full", False), ("lora", True)):
        config = LlamaConfig(**shape, tie_word_embeddings=tied, rope_theta=500000.0, dtype="bfloat16", attn_implementation="sdpa")
        torch.manual_seed(0)
        with torch.device(device()):
            model = LlamaForCausalLM(config).to(torch.bfloat16)
        model.save_pretrained(root / name, safe_serialization=True)
        AutoTokenizer.from_pretrained(TOKENIZER_DIR).save_pretrained(root / name)
        del model


def token_batches(count: int, batch: int, seq: int, vocab: int) -> list:
    """Zipf-distributed tokens (a loss that falls as the model learns their frequencies), same in every process."""
    import torch

    generator = torch.Generator().manual_seed(1234)
    weights = 1.0 / torch.arange(10, vocab + 10, dtype=torch.float64) ** 1.1
    order = torch.randperm(vocab, generator=generator)
    return [order[torch.multinomial(weights, batch * seq, replacement=True, generator=generator)].view(batch, seq)
            for _ in range(count)]


def packed_data(data: list, seed: int = 4321) -> list[dict]:
    """The same tokens as packed rows: samples of seq/16 to seq/2 tokens, the last one cut to fill its row."""
    import torch
    from common import packed_rows

    generator = torch.Generator().manual_seed(seed)
    batches = []
    for ids in data:
        length = ids.shape[1]
        low, high = max(2, length // 16), max(3, length // 2)
        layout = []
        for _ in range(ids.shape[0]):
            row, left = [], length
            while left > 0:
                row.append(min(left, int(torch.randint(low, high + 1, (1,), generator=generator))))
                left -= row[-1]
            layout.append(row)
        batches.append(packed_rows(ids, layout))
    return batches


def tokens_of(item) -> int:
    return (item["input_ids"] if isinstance(item, dict) else item).numel()


def run_timed(step, data: list, warmup: int) -> dict:
    """Run ``step(ids) -> loss`` over ``data``; time all but the first ``warmup`` steps; one extra step counts syncs."""
    import warnings

    import torch

    cuda = torch.cuda.is_available()
    losses = [step(ids) for ids in data[:warmup]]
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    losses += [step(ids) for ids in data[warmup:]]
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    tokens = sum(tokens_of(item) for item in data[warmup:])
    result = {"tokens_per_s": tokens / seconds, "step_ms": 1000 * seconds / max(1, len(data) - warmup),
              "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan"),
              "losses": [float(x) for x in losses], "syncs": None}
    if cuda:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                step(data[-1])
            finally:
                torch.cuda.set_sync_debug_mode("default")
            torch.cuda.synchronize()
        result["syncs"] = sum("synchroniz" in str(w.message) for w in caught)
    return result


def to_device(ids):
    """Pinned and non-blocking, as the engine copies its micro-batches (a pageable copy would wait for the GPU)."""
    return ids.pin_memory().to(device(), non_blocking=True) if device().type == "cuda" else ids


def hf_case(args: argparse.Namespace, model_dir: Path, data: list, options: dict) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    attn = options.get("attn", "sdpa")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, attn_implementation=attn).to(device())
    model.config.use_cache = False
    if options.get("compile"):
        for layer in model.model.layers:
            layer.compile(dynamic=False, backend=compile_backend())
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                                  fused=device().type == "cuda")

    def step(item):
        if isinstance(item, dict):  # packed rows, HF's own way: position ids that restart and no attention mask
            ids, positions = to_device(item["input_ids"]), to_device(item["position_ids"])
            loss = model(input_ids=ids, position_ids=positions, labels=ids.masked_fill(positions == 0, -100)).loss
        else:
            ids = to_device(item)
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return finish(run_timed(step, data, args.warmup))


def hf_peft_case(args: argparse.Namespace, model_dir: Path, data: list, options: dict) -> dict:
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, attn_implementation="sdpa").to(device())
    model.config.use_cache = False
    model = peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear",
                                                       task_type="CAUSAL_LM"))
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=LR)  # as bench/peft_lora.py measured it

    def step(ids):
        ids = to_device(ids)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return finish(run_timed(step, data, args.warmup))


def toolkit_case(args: argparse.Namespace, model_dir: Path, data: list, options: dict, tuner_name: str) -> dict:
    from common import full_rows

    from toolkit.contracts import StepContext
    from toolkit.models import load_hf_directory
    from toolkit.plugins import get_plugin_manager
    from toolkit.recipe import resolve_recipe, thing_options

    values = {"model": str(model_dir), "precision": "bf16", "lr": LR, "max_grad_norm": 1.0, "schedule": "constant",
              "tuner": tuner_name, "loss": "sft", "seq_len": args.seq, "micro_batch_size": args.batch, "local": options}
    if tuner_name == "lora":
        values["lora"] = {"rank": 16, "alpha": 32.0, "dropout": 0.0}
    recipe = resolve_recipe(values, source="bench/speed.py")
    manager = get_plugin_manager()
    tuner_cls, loss_cls, strategy_cls = (manager.get(k, n) for k, n in (("tuner", tuner_name), ("loss", "sft"), ("strategy", "local")))
    tuner, loss, strategy = (cls(thing_options(recipe, cls)) for cls in (tuner_cls, loss_cls, strategy_cls))
    problems = strategy.validate(recipe, 1)
    if problems:
        raise SystemExit("\n".join(problems))
    engine = strategy.build(load_hf_directory(str(model_dir), model_dir), tuner, loss, recipe)
    engine.set_total_steps(len(data) + 1)
    batch, length = (data[0]["input_ids"] if isinstance(data[0], dict) else data[0]).shape
    ctx = StepContext(label_tokens=batch * (length - 1), sequences=batch, examples=batch)

    def step(item):
        if not isinstance(item, dict):
            return engine.train_step([full_rows(item)], loss, ctx).loss
        labels = int((item["labels"] != -100).sum())  # a host tensor: no device synchronisation
        packed_ctx = StepContext(label_tokens=labels, sequences=item["num_sequences"], examples=item["num_sequences"])
        return engine.train_step([item], loss, packed_ctx).loss

    result = run_timed(step, data, args.warmup)
    result["trainable"] = sum(p.numel() for p in engine.params)
    return finish(result)


def finish(result: dict) -> dict:
    import torch

    result["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    result["torch"] = torch.__version__
    return result


def compile_backend() -> str:
    """Inductor on the GPU; on CPU (``--tiny``) AOT autograd without code generation (no C++ toolchain needed)."""
    import torch

    return "inductor" if torch.cuda.is_available() else "aot_eager"


def worker(args: argparse.Namespace) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    root = Path(args.model_dir)
    if args.worker == "make-models":
        make_models(args, root)
        return
    if args.worker == "check":
        from kernel_check import check_kernels

        check_kernels(args)
        return
    from toolkit.train.kernels import patch

    patch.COMPILE_BACKEND = compile_backend()
    name = args.worker.removeprefix("best:")
    kind, options, long_run, _ = CASES[name]
    long_run = long_run or args.worker.startswith("best:")
    shape = SHAPE_TINY if args.tiny else SHAPE_1B
    steps = args.long_steps if long_run else args.warmup + args.steps
    data = token_batches(max(steps, args.warmup + 1), args.batch, args.seq, shape["vocab_size"])
    if kind in ("hf-packed", "packed"):
        data = packed_data(data)
        problem = cpu_flex(options)
        if problem:
            print("RESULT " + json.dumps(finish({"tokens_per_s": float("nan"), "peak_gib": float("nan"), "losses": [],
                                                 "skipped": problem})), flush=True)
            return
    if kind in ("hf", "hf-packed"):
        result = hf_case(args, root / "full", data, options)
    elif kind == "hf-peft":
        result = hf_peft_case(args, root / "lora", data, options)
    else:
        result = toolkit_case(args, root / ("lora" if kind == "lora" else "full"), data, options, "lora" if kind == "lora" else "full")
    print("RESULT " + json.dumps(result), flush=True)


def cpu_flex(options: dict) -> str | None:
    """On CPU: why a FlexAttention case cannot run (HF's compiles flex_attention for a backward torch refuses);
    for the toolkit's, lift torch's refusal of FlexAttention backward on CPU so --tiny runs its code path eagerly."""
    import torch

    if torch.cuda.is_available():
        return None
    if options.get("attn") == "flex_attention":
        return "HF's flex_attention trains on a GPU only (torch has no FlexAttention backward on CPU)"
    if options.get("packed_attention") == "flex":
        import torch.nn.attention.flex_attention as flex

        flex._validate_device = lambda query, key, value: None
        print("toolkit bench: CPU FlexAttention backward allowed (eager reference; a code-path check, not a speed)", flush=True)
    return None


# ----------------------------------------------------------------------------- parent side


def spawn(args: argparse.Namespace, name: str, root: Path, timeout: int) -> tuple[dict | None, str]:
    """Run one worker; its RESULT line (or ``None``) and the interesting part of its output."""
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", name, "--model-dir", str(root),
               "--batch", str(args.batch), "--seq", str(args.seq), "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--long-steps", str(args.long_steps)] + (["--tiny"] if args.tiny else [])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return None, f"timed out after {timeout} s\n{out[-1500:]}"
    result = next((json.loads(line[7:]) for line in done.stdout.splitlines() if line.startswith("RESULT ")), None)
    notes = [line for line in (done.stdout + done.stderr).splitlines()
             if line.startswith("toolkit:") or "Error" in line or "error:" in line]
    if result is None:
        return None, f"exit {done.returncode}\n" + "\n".join(notes[-8:] + done.stderr.splitlines()[-12:])
    if name == "check":
        return result, done.stdout
    return result, "\n".join(dict.fromkeys(notes))


def chosen_cases(args: argparse.Namespace) -> list[str]:
    names = [c.strip() for c in args.cases.split(",") if c.strip()] or GROUPS[args.group]
    unknown = [c for c in names if c not in CASES]
    if unknown:
        raise SystemExit(f"unknown case(s) {', '.join(unknown)}; cases: {', '.join(CASES)}")
    return names


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    if args.list:
        for name, (_kind, options, long_run, text) in CASES.items():
            print(f"{name:30s} {'long ' if long_run else 'short'} {text}  {options or ''}")
        return
    if args.plot:
        return plot([Path(p) for p in args.plot], args.output)
    import tempfile

    names = chosen_cases(args)
    payload = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "command": " ".join(["python", *sys.argv]),
               "shape": "tiny" if args.tiny else "1.24B Llama", "batch": args.batch, "seq": args.seq, "steps": args.steps,
               "warmup": args.warmup, "long_steps": args.long_steps, "check": None, "rows": []}
    with tempfile.TemporaryDirectory(prefix="bench-speed-") as tmp:
        root = Path(tmp)
        _, text = spawn(args, "make-models", root, 600)
        if not (root / "full" / "config.json").is_file():
            raise SystemExit(f"could not create the benchmark models: {text}")
        if not args.no_check:
            check, text = spawn(args, "check", root, 300)
            payload["check"] = check
            print(text if check else f"kernel check failed: {text}", flush=True)
        for name in names:
            run_case(args, name, root, payload)
        best = best_short_case(payload["rows"])
        if best and args.long_steps > 0:
            run_case(args, "best:" + best, root, payload)
    summarize(payload)
    write_json(payload)


def run_case(args: argparse.Namespace, name: str, root: Path, payload: dict) -> None:
    """One case in its own process; its row is appended and the JSON rewritten at once."""
    kind, options, long_run, what = CASES[name.removeprefix("best:")]
    started = time.perf_counter()
    limit = int(args.timeout * (1.5 if options.get("compile") else 1))
    result, notes = spawn(args, name, root, limit)
    row = {"run": name, "kind": kind, "options": options, "what": what, "long": long_run or name.startswith("best:"),
           "wall_s": round(time.perf_counter() - started, 1), "notes": notes}
    row.update(result or {"tokens_per_s": float("nan"), "peak_gib": float("nan"), "failed": True, "losses": []})
    payload["rows"].append(row)
    status = f"{row['tokens_per_s']:.0f} tokens/s, {row['peak_gib']:.1f} GiB" if result else "FAILED"
    status = f"skipped: {row['skipped']}" if row.get("skipped") else status
    print(f"[{name}] {status} ({row['wall_s']} s){chr(10) + notes if notes else ''}", flush=True)
    write_json(payload)


def best_short_case(rows: list[dict]) -> str | None:
    """The fastest full-SFT toolkit case that ran short and in bf16 (fp8 has its own long run)."""
    candidates = [r for r in rows if r["kind"] == "full" and not r["long"] and not r.get("failed")
                  and not r["options"].get("fp8")]
    return max(candidates, key=lambda r: r["tokens_per_s"])["run"] if candidates else None


def write_json(payload: dict) -> None:
    if os.environ.get("OUT"):
        Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)
        Path(os.environ["OUT"], "speed.json").write_text(json.dumps(payload, indent=2))


def summarize(payload: dict) -> None:
    from common import report

    rows = payload["rows"]
    title = f"{payload['shape']}, batch {payload['batch']} x seq {payload['seq']}, {rows[0].get('device', '?') if rows else ''}"
    report(title, rows, "speed_rows.json")
    baselines = {name: next((r for r in rows if r["run"] == run and not r.get("failed")), None)
                 for name, run in (("hf", "hf"), ("lora", "hf-peft"), ("packed", "hf-packed"))}
    print(f"\n{'case':30s} {'tokens/s':>10s} {'step ms':>8s} {'GiB':>6s} {'speed-up':>9s} {'memory':>7s} {'syncs':>6s}")
    for row in rows:
        base = baselines["lora" if row["kind"] in ("hf-peft", "lora") else "packed" if "packed" in row["kind"] else "hf"]
        if row.get("failed") or row.get("skipped") or base is None:
            ratio = memory = "-"
        else:
            ratio = f"{row['tokens_per_s'] / base['tokens_per_s']:.2f}x"
            memory = f"{row['peak_gib'] / base['peak_gib']:.2f}x" if base["peak_gib"] == base["peak_gib"] else "-"
            row["speedup"], row["memory_ratio"] = ratio, memory
        step_ms = f"{row.get('step_ms', float('nan')):.0f}"
        print(f"{row['run']:30s} {row['tokens_per_s']:10.0f} {step_ms:>8s} {row['peak_gib']:6.1f} {ratio:>9s} {memory:>7s} "
              f"{str(row.get('syncs', '-')):>6s}")
    long_rows = [r for r in rows if r["long"] and r.get("losses")]
    if long_rows:
        print("\nlosses per step (same tokens, same initial weights):")
        print("step " + " ".join(f"{r['run'][:22]:>22s}" for r in long_rows))
        for step in range(max(len(r["losses"]) for r in long_rows)):
            cells = [f"{r['losses'][step]:22.4f}" if step < len(r["losses"]) else " " * 22 for r in long_rows]
            print(f"{step + 1:4d} " + " ".join(cells))


def plot(paths: list[Path], output: str | None) -> None:
    """Tokens/s and peak GiB per case from speed.json file(s) (e.g. --group full and --group lora), drawn by
    bench/plot_results.py (which also draws the committed results: python bench/plot_results.py)."""
    from plot_results import Figure, draw, speed_bars

    payloads = [json.loads(path.read_text()) for path in paths]
    payload = payloads[0]
    device = next((r.get("device") for p in payloads for r in p["rows"] if r.get("device")), "?")
    title = f"{payload['shape']}, batch {payload['batch']} x seq {payload['seq']} - {device}, {payload['date']}"
    draw(Figure("speed", title, "tokens/s", [bar for p in payloads for bar in speed_bars(p)]),
         Path(output) if output else paths[0].with_suffix(".png"))


if __name__ == "__main__":
    main()
