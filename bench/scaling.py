"""Scaling of full SFT under ``--strategy megatron`` over 1, 2, 4 and 8 GPUs, one script (issues 12 and 14).

For the visible GPU count (or ``--gpus``) it runs that count's layout list for three shapes, each case
a ``torchrun`` subprocess of the real engine (toolkit-megatron's ``MegatronEngine``) with a timeout:

    gpus 1: tp1 (the reference of each shape)
    gpus 2: tp2, pp2, dp2; MoE: ep2 (TP1 x EP2, data parallel 2)
    gpus 4: tp4, tp2xpp2, tp2xdp2; MoE: ep4
    gpus 8: tp8, tp4xpp2, tp2xpp2xdp2; MoE: ep8

Shapes: ``1b`` (Llama 1.24B: hidden 2048, 16 layers, 32/8 heads, FFN 8192, vocab 128256), ``8b``
(hidden 4096, 32/8 heads, FFN 14336, vocab 128256, layers cut to what one GPU holds, at most 8),
``moe`` (Qwen3-30B-A3B layers: hidden 2048, 128 experts, top-8, expert FFN 768, vocab 151936, 4
layers). Every layout of a shape trains on the same seeded global batch per step (each data-parallel
replica takes its rows), 20 steps, and reports tokens/s (total, per GPU), MFU, peak GiB per GPU, the
scaling efficiency against the 1-GPU run of the shape and ``max_i |loss_i - loss_i(1 GPU)|``. The
1-GPU references run first, side by side on separate GPUs when more than one is visible, with the
issue-12 speed cases: the megatron engine's kernel variants and the HF transformers baseline on the
1.24B shape (batch 4 x seq 4096, one micro-batch per step).

    python bench/scaling.py                         # the list for every visible GPU (plus 1-GPU references)
    python bench/scaling.py --gpus 2 --budget 400   # stop starting cases after 400 s
    python bench/scaling.py --cases '1b/*,moe/ep2'  # a filter (fnmatch patterns, comma-separated)
    python bench/scaling.py --tiny                  # CPU, gloo, 2 processes, tiny shapes (checks the script)

Prints each case as it finishes; writes ``$OUT/scaling.json`` after every case when ``OUT`` is set.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

H200_BF16_PEAK = 989e12
"""Dense bf16 tensor-core peak of one H200 (FLOP/s), the MFU denominator."""
HERE = Path(__file__).resolve()

SHAPES = {
    "1b": dict(kind="llama", hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
               head_dim=64, intermediate_size=8192, vocab_size=128256, seq=4096, global_batch=8, micro_batch=4),
    "8b": dict(kind="llama", hidden_size=4096, num_hidden_layers=None, num_attention_heads=32, num_key_value_heads=8,
               head_dim=128, intermediate_size=14336, vocab_size=128256, seq=4096, global_batch=4, micro_batch=2,
               full_layers=32),
    "moe": dict(kind="qwen3_moe", hidden_size=2048, num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=4,
                head_dim=128, intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                vocab_size=151936, seq=4096, global_batch=4, micro_batch=2),
}
TINY_SHAPES = {
    "1b": dict(kind="llama", hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
               head_dim=16, intermediate_size=128, vocab_size=301, seq=32, global_batch=4, micro_batch=2),
    "8b": dict(kind="llama", hidden_size=96, num_hidden_layers=None, num_attention_heads=4, num_key_value_heads=2,
               head_dim=24, intermediate_size=160, vocab_size=301, seq=32, global_batch=4, micro_batch=2, full_layers=8),
    "moe": dict(kind="qwen3_moe", hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, intermediate_size=128, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                vocab_size=301, seq=32, global_batch=4, micro_batch=2),
}
DENSE_LAYOUTS = {1: ["tp1"], 2: ["tp2", "dp2", "pp2"], 4: ["tp4", "tp2xdp2", "tp2xpp2"], 8: ["tp8", "tp2xpp2xdp2", "tp4xpp2"]}
MOE_LAYOUTS = {1: ["tp1"], 2: ["ep2"], 4: ["ep4"], 8: ["ep8"]}
SPEED_VARIANTS = {  # issue 12: engine options measured against each other and the HF baseline (1.24B, 1 GPU)
    # the engine's defaults: on a GPU the fused output head (sft), compiled elementwise ops + Triton RMSNorm
    "speed-default": {},
    "speed-unfused": {"fused_loss": False},  # the defaults but the logits path (compiled log-probs): the fused head's lever
    "speed-before": {"logps_kernel": "reference", "fused_adam": False, "foreach_clipping": False,
                     "compile_elementwise": False, "kernels": "none", "fused_loss": False},
    "speed-chunked": {"logps_kernel": "chunked", "compile_elementwise": False, "kernels": "none",  # defaults until 2026-11-30
                      "fused_loss": False},
    "speed-compiled": {"logps_kernel": "compiled", "compile_elementwise": True, "kernels": "none", "fused_loss": False},
}


@dataclass
class Case:
    shape: str
    layout: str
    options: dict = field(default_factory=dict)
    steps: int = 20
    global_batch: int | None = None  # None: the shape's
    profile: bool = False  # one more step under torch.profiler: the top kernels by GPU time

    @property
    def name(self) -> str:
        return f"{self.shape}/{self.layout}"

    def sizes(self) -> dict[str, int]:
        """tp, pp, dp, ep, sp of the layout name (``tp2xpp2xdp2``; ``epN``: N data-parallel expert ranks; ``sp``: sequence parallel)."""
        if self.layout.startswith(("speed", "hf")):
            return {"tp": 1, "pp": 1, "dp": 1, "ep": 1, "sp": 0}
        parts = {p[:2]: int(p[2:] or 1) for p in self.layout.split("x")}
        sizes = {"tp": parts.get("tp", 1), "pp": parts.get("pp", 1), "ep": parts.get("ep", 1), "sp": int("sp" in parts)}
        sizes["dp"] = parts.get("dp", parts.get("ep", 1))
        return sizes

    @property
    def gpus(self) -> int:
        s = self.sizes()
        return s["tp"] * s["pp"] * s["dp"]


# --------------------------------------------------------------------------------------------- arithmetic
def layer_matmul_params(shape: dict) -> tuple[int, int]:
    """(attention, MLP) weights of one layer that every token multiplies (MoE: the routed top-k experts and the router)."""
    h, q, kv = shape["hidden_size"], shape["num_attention_heads"] * shape["head_dim"], shape["num_key_value_heads"] * shape["head_dim"]
    attention = h * (q + 2 * kv) + q * h
    if shape["kind"] == "qwen3_moe":
        mlp = shape["num_experts_per_tok"] * 3 * h * shape["moe_intermediate_size"] + h * shape["num_experts"]
    else:
        mlp = 3 * h * shape["intermediate_size"]
    return attention, mlp


def flops_per_token(shape: dict) -> float:
    """Training model FLOPs per token: 3 x forward, forward = 2 x matmul weights + causal attention + LM head."""
    attention, mlp = layer_matmul_params(shape)
    q = shape["num_attention_heads"] * shape["head_dim"]
    causal_scores = 2 * 2 * q * (shape["seq"] + 1) / 2  # QK^T and PV over the mean causal context (s+1)/2
    forward = shape["num_hidden_layers"] * (2 * (attention + mlp) + causal_scores) + 2 * shape["hidden_size"] * shape["vocab_size"]
    return 3 * forward


def total_params(shape: dict) -> int:
    h = shape["hidden_size"]
    attention, _ = layer_matmul_params(shape)
    if shape["kind"] == "qwen3_moe":
        mlp = shape["num_experts"] * 3 * h * shape["moe_intermediate_size"] + h * shape["num_experts"]
    else:
        mlp = 3 * h * shape["intermediate_size"]
    return shape["num_hidden_layers"] * (attention + mlp + 2 * h) + 2 * h * shape["vocab_size"] + h


def estimate_gib(shape: dict, layers: int, tp: int = 1, pp: int = 1, micro_batch: int | None = None) -> float:
    """Rough peak GiB of one rank: 18 bytes per parameter (bf16 weight, fp32 grad, master, two Adam moments),
    activations of the micro-batches in flight (~18h + 6F bytes per token and layer, bf16, no recompute)
    and the bf16 logits kept for the log-probs."""
    h, vocab, seq = shape["hidden_size"], shape["vocab_size"], shape["seq"]
    mb = micro_batch or shape["micro_batch"]
    attention, _ = layer_matmul_params(shape)
    mlp = 3 * h * shape["intermediate_size"]
    params = (layers / pp) * (attention + mlp) / tp + h * vocab / tp * (2 if pp == 1 else 1)
    activations = mb * seq * (layers / pp) * (18 * h + 6 * shape["intermediate_size"] / tp) * pp  # 1F1B: pp micro-batches in flight
    logits = 2 * mb * seq * vocab / tp
    return (18 * params + activations + logits) / 2**30


def choose_8b_layers(shape: dict, gpu_gib: float, cap: int = 8) -> tuple[int, int]:
    """(layers to run, most layers one GPU holds by :func:`estimate_gib` within 85% of its memory), even counts."""
    fits = 0
    for layers in range(2, shape["full_layers"] + 1, 2):
        if estimate_gib(shape, layers) <= 0.85 * gpu_gib:
            fits = layers
    return max(2, min(cap, fits)), fits


# --------------------------------------------------------------------------------------------- worker side
def make_model(shape_name: str, shape: dict, directory: Path) -> None:
    """A randomly initialised HF checkpoint of ``shape`` (bf16 on the GPU; fp32 on the CPU), written once."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3MoeConfig

    keys = {k: v for k, v in shape.items() if k not in ("kind", "seq", "global_batch", "micro_batch", "full_layers", "layers_note")}
    config = (Qwen3MoeConfig(**keys, norm_topk_prob=True, max_position_embeddings=8192, rope_theta=1e6)
              if shape["kind"] == "qwen3_moe" else LlamaConfig(**keys, max_position_embeddings=8192, tie_word_embeddings=False))
    cuda = torch.cuda.is_available()
    torch.manual_seed(0)
    with torch.device("cuda" if cuda else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16 if cuda else torch.float32)
    model.save_pretrained(directory)
    if shape["kind"] == "qwen3_moe":
        split_fused_experts(directory, shape["num_experts"], shape["moe_intermediate_size"])
    (directory / "toolkit_bench_shape.json").write_text(json.dumps({"name": shape_name, **shape}))


def split_fused_experts(directory: Path, experts: int, ffn: int) -> None:
    """Rewrite fused expert tensors (``mlp.experts.gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]``, however a
    transformers version saves them) as the per-expert keys the Megatron bridge reads; no-op when already split."""
    from safetensors.torch import load_file, save_file

    for path in sorted(directory.glob("*.safetensors")):
        tensors = load_file(path)
        fused = [k for k in tensors if k.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))]
        if not fused:
            continue
        for key in fused:
            tensor, prefix = tensors.pop(key), key.rsplit(".", 1)[0]
            if key.endswith("gate_up_proj"):
                tensor = tensor if tensor.shape[1] == 2 * ffn else tensor.transpose(1, 2)  # -> [E, 2I, H]
                for e in range(experts):
                    tensors[f"{prefix}.{e}.gate_proj.weight"] = tensor[e, :ffn].contiguous()
                    tensors[f"{prefix}.{e}.up_proj.weight"] = tensor[e, ffn:].contiguous()
            else:
                tensor = tensor if tensor.shape[2] == ffn else tensor.transpose(1, 2)  # -> [E, H, I]
                for e in range(experts):
                    tensors[f"{prefix}.{e}.down_proj.weight"] = tensor[e].contiguous()
        save_file(tensors, path, metadata={"format": "pt"})
    index = directory / "model.safetensors.index.json"
    if index.is_file():  # rebuild the weight map from the shards as they are now
        from safetensors import safe_open

        weight_map = {}
        for path in sorted(directory.glob("*.safetensors")):
            with safe_open(path, "pt") as handle:
                weight_map.update({k: path.name for k in handle.keys()})
        payload = json.loads(index.read_text())
        payload["weight_map"] = weight_map
        index.write_text(json.dumps(payload, indent=2))


def step_batch(shape: dict, global_batch: int, step: int, device) -> torch.Tensor:  # noqa: F821
    import torch

    generator = torch.Generator().manual_seed(1000 + step % 4)  # 4 batches repeated: the loss falls as they are learnt
    return torch.randint(0, shape["vocab_size"], (global_batch, shape["seq"]), generator=generator).to(device)


def run_engine(case: Case, shape: dict, directory: Path, device, warmup: int) -> dict:
    from common import full_rows
    from transformers import AutoConfig

    from toolkit.contracts import ModelSource, StepContext
    from toolkit.plugins import get_plugin_manager
    from toolkit.recipe import Recipe
    from toolkit_megatron.strategy import MegatronConfig, MegatronEngine

    sizes = case.sizes()
    global_batch = case.global_batch or shape["global_batch"]
    replica_rows = global_batch // sizes["dp"]
    micro = min(shape["micro_batch"], replica_rows)
    if sizes["pp"] > 1:  # at least 2 x pp micro-batches per step keeps the 1F1B bubble at (pp-1)/(m+pp-1) <= 1/3
        micro = max(1, min(micro, replica_rows // (2 * sizes["pp"])))
    recipe = Recipe(model=str(directory), strategy="megatron", tensor_parallel=sizes["tp"], pipeline_parallel=sizes["pp"],
                    expert_parallel=sizes["ep"], sequence_parallel=bool(sizes["sp"]),
                    expert_tensor_parallel=sizes["tp"] if shape["kind"] == "qwen3_moe" else 1,  # MoE under TP: etp = tp
                    precision="bf16" if device.type == "cuda" else "fp32", lr=1e-4,
                    max_grad_norm=1.0, seq_len=shape["seq"], micro_batch_size=micro, warmup_steps=0, schedule="constant")
    source = ModelSource(reference=str(directory), directory=directory, config=AutoConfig.from_pretrained(directory),
                         tokenizer=None, weight_files=sorted(directory.glob("*.safetensors")))
    manager = get_plugin_manager()
    loss = manager.create("loss", "sft")
    engine = MegatronEngine(source, manager.create("tuner", "full"), loss, recipe, MegatronConfig(**case.options))
    engine.set_total_steps(case.steps)
    seq = shape["seq"]
    ctx = StepContext(label_tokens=global_batch * (seq - 1), sequences=global_batch, examples=global_batch)
    losses, times = [], []
    for step in range(case.steps):
        ids = step_batch(shape, global_batch, step, device)[engine.dp_rank * replica_rows:(engine.dp_rank + 1) * replica_rows]
        batches = [full_rows(ids[i:i + micro]) for i in range(0, replica_rows, micro)]
        start = time.perf_counter()
        result = engine.train_step(batches, loss, ctx)  # returns floats: the step has finished on the device
        times.append(time.perf_counter() - start)
        losses.append(result.loss)
    profile = profile_step(lambda: engine.train_step(batches, loss, ctx), device) if case.profile else None
    engine.close()
    timed = times[warmup:]
    return {"profile": profile, "losses": losses, "step_seconds": times, "tokens_per_s": global_batch * seq * len(timed) / sum(timed),
            "micro_batch": micro, "micro_batches_per_replica": replica_rows // micro, "global_batch": global_batch}


def profile_step(step, device) -> str:
    """The 25 kernels with the most self device time in one ``step()`` (torch.profiler's table)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        step()
    events = prof.key_averages()
    if device.type != "cuda":
        return events.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70)
    try:
        return events.table(sort_by="self_device_time_total", row_limit=25, max_name_column_width=70)
    except (AttributeError, KeyError, ValueError):  # older torch names it after CUDA
        return events.table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=70)


def run_hf(case: Case, shape: dict, directory: Path, device, warmup: int) -> dict:
    """HF transformers, bf16 parameters and fused AdamW, SDPA, ``labels=`` loss (bench/local_sft.py's baseline)."""
    import torch
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # the engine trains fp32 on the CPU
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, attn_implementation="sdpa").to(device)
    model.config.use_cache = False
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0, fused=device.type == "cuda")
    global_batch = case.global_batch or shape["global_batch"]

    def train_step(ids: torch.Tensor) -> float:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss)

    losses, times = [], []
    for step in range(case.steps):
        ids = step_batch(shape, global_batch, step, device)
        start = time.perf_counter()
        losses.append(train_step(ids))
        times.append(time.perf_counter() - start)
    profile = profile_step(lambda: train_step(ids), device) if case.profile else None
    timed = times[warmup:]
    return {"profile": profile, "losses": losses, "step_seconds": times, "tokens_per_s": global_batch * shape["seq"] * len(timed) / sum(timed),
            "micro_batch": global_batch, "micro_batches_per_replica": 1, "global_batch": global_batch}


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    case = Case(**json.loads(args.worker))
    directory = Path(args.model_dir)
    shape = json.loads((directory / "toolkit_bench_shape.json").read_text())
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo")
    run = run_hf if case.layout == "hf" else run_engine
    result = run(case, shape, directory, device, args.warmup)
    peaks = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0)
    if dist.get_rank() == 0:
        result["peak_gib_per_rank"] = peaks
        Path(args.result).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


# --------------------------------------------------------------------------------------------- driver side
def visible_gpus() -> list[str]:
    """GPU ids this process may use (CUDA_VISIBLE_DEVICES, else nvidia-smi's list), without starting CUDA here."""
    if os.environ.get("CUDA_VISIBLE_DEVICES") is not None:
        return [d for d in os.environ["CUDA_VISIBLE_DEVICES"].split(",") if d.strip()]
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [str(i) for i, line in enumerate(listed.splitlines()) if line.startswith("GPU ")]


def plan(args: argparse.Namespace) -> list[Case]:
    """The references and speed cases (1 GPU) first, then the layout list for ``args.gpus``, filtered by ``--cases``."""
    shapes = [s for s in args.shapes.split(",") if s]
    cases = [Case(shape, "tp1") for shape in shapes]
    if "1b" in shapes and not args.no_speed:
        speed_batch = 2 if args.tiny else 4
        cases += [Case("1b", name, options, steps=args.speed_steps, global_batch=speed_batch,
                       profile=args.profile and name in ("speed-default", "speed-before"))
                  for name, options in SPEED_VARIANTS.items()]
        cases.append(Case("1b", "hf", steps=args.speed_steps, global_batch=speed_batch, profile=args.profile))
    if args.gpus > 1:  # interleaved (1b/tp2, 8b/tp2, moe/ep2, 1b/dp2, ...): a --budget cut drops whole layouts last
        lists = {shape: (MOE_LAYOUTS if shape == "moe" else DENSE_LAYOUTS)[args.gpus] for shape in shapes}
        if args.layouts:  # replaces the list of every shape, e.g. --layouts tp2xsp,dp2 --shapes 1b,8b
            lists = {shape: args.layouts.split(",") for shape in shapes}
        for index in range(max(map(len, lists.values()))):
            cases += [Case(shape, layouts[index]) for shape, layouts in lists.items() if index < len(layouts)]
    if args.cases:
        patterns = args.cases.split(",")
        cases = [c for c in cases if any(fnmatch.fnmatch(c.name, p) for p in patterns)]
    return cases


def prepare_models(args: argparse.Namespace, shapes: set[str], gpu_ids: list[str]) -> dict[str, dict]:
    """Write each shape's HF checkpoint once, one subprocess per shape spread over the GPUs (so this process
    never holds a GPU); returns the shapes as written."""
    root = Path(args.model_root)

    def make(index_name: tuple[int, str]) -> None:
        index, name = index_name
        directory = root / name
        if (directory / "toolkit_bench_shape.json").is_file():
            return
        env = {**os.environ, **({"CUDA_VISIBLE_DEVICES": gpu_ids[index % len(gpu_ids)]} if gpu_ids else {})}
        command = [sys.executable, str(HERE), "--make-model", name, "--model-dir", str(directory),
                   "--gpu-gib", str(args.gpu_gib)] + (["--tiny"] if args.tiny else [])
        started = time.time()
        subprocess.run(command, env=env, check=True, timeout=900, stdout=subprocess.DEVNULL)
        print(f"[models] {name}: written to {directory} in {time.time() - started:.0f} s", flush=True)

    with ThreadPoolExecutor(max_workers=max(1, len(gpu_ids))) as pool:
        list(pool.map(make, enumerate(sorted(shapes))))
    return {name: json.loads((root / name / "toolkit_bench_shape.json").read_text()) for name in sorted(shapes)}


def run_case(case: Case, args: argparse.Namespace, gpus: list[str] | None, timeout: float) -> dict:
    """One torchrun subprocess; returns the worker's result with status, wall time and (on failure) the output tail."""
    result_path = Path(tempfile.mkstemp(prefix="scaling-", suffix=".json")[1])
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "HF_HUB_OFFLINE": "1",
           "PYTHONWARNINGS": "ignore", "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")])}
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={case.gpus}", str(HERE),
               "--worker", json.dumps(asdict(case)), "--model-dir", str(Path(args.model_root) / case.shape),
               "--result", str(result_path), "--warmup", str(args.warmup)]
    started = time.time()
    entry = {"case": case.name, "shape": case.shape, "layout": case.layout, "gpus": case.gpus, "options": case.options}
    try:
        proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
        output = proc.stdout[-3000:] + proc.stderr[-6000:]
        if proc.returncode == 0 and result_path.stat().st_size:
            entry.update(json.loads(result_path.read_text()), status="ok")
        else:
            oom = "OutOfMemoryError" in output or "CUDA out of memory" in output
            entry.update(status="out of memory" if oom else f"failed (exit {proc.returncode})", output_tail=output[-4000:])
    except subprocess.TimeoutExpired as error:
        tail = (error.stdout or b"")[-2000:] + (error.stderr or b"")[-4000:]
        entry.update(status=f"timed out after {timeout:.0f} s", output_tail=tail.decode(errors="replace") if isinstance(tail, bytes) else tail)
    finally:
        result_path.unlink(missing_ok=True)
    entry["wall_seconds"] = round(time.time() - started, 1)
    return entry


def reference_for(entry: dict, done: list[dict]) -> dict | None:
    """The run an entry is compared with: the shape's 1-GPU run, else its smallest successful run (same global batch)."""
    same = [d for d in done if d["shape"] == entry["shape"] and d["status"] == "ok"
            and d.get("global_batch") == entry.get("global_batch") and d["layout"] != "hf"]
    if entry["layout"].startswith(("speed", "hf")):
        same = [d for d in same if d["layout"] == "speed-default"]
    else:
        same = [d for d in same if not d["layout"].startswith("speed")]
    return min(same, key=lambda d: (d["gpus"], d["layout"] != "tp1"), default=None)


def summarise(entry: dict, done: list[dict], shapes: dict[str, dict]) -> None:
    if entry["status"] != "ok":
        return
    shape = shapes[entry["shape"]]
    peaks = [p for p in entry["peak_gib_per_rank"] if p is not None]
    entry["peak_gib"] = max(peaks) if peaks else None
    entry["tokens_per_s_per_gpu"] = entry["tokens_per_s"] / entry["gpus"]
    entry["mfu"] = entry["tokens_per_s_per_gpu"] * flops_per_token(shape) / H200_BF16_PEAK
    reference = reference_for(entry, [d for d in done if d is not entry])
    if reference is None and entry["layout"] in ("tp1", "speed-default"):
        reference = entry
    if reference is not None:
        entry["reference"] = reference["case"]
        entry["scaling_efficiency"] = entry["tokens_per_s_per_gpu"] / reference["tokens_per_s_per_gpu"]
        steps = min(len(entry["losses"]), len(reference["losses"]))
        entry["max_loss_diff"] = max(abs(a - b) for a, b in zip(entry["losses"][:steps], reference["losses"][:steps]))


HEADER = f"{'case':<26}{'gpus':>5}{'tokens/s':>11}{'per GPU':>10}{'MFU':>7}{'peak GiB':>10}{'eff':>7}{'max|dloss|':>12}{'wall s':>8}  status"


def row(entry: dict) -> str:
    if entry["status"] != "ok":
        return f"{entry['case']:<26}{entry['gpus']:>5}{'':>65}{entry.get('wall_seconds', 0):>8.0f}  {entry['status']}"
    eff = f"{entry['scaling_efficiency']:.2f}" if "scaling_efficiency" in entry else "-"
    diff = f"{entry['max_loss_diff']:.2e}" if "max_loss_diff" in entry else "-"
    peak = f"{entry['peak_gib']:.1f}" if entry.get("peak_gib") else "-"
    return (f"{entry['case']:<26}{entry['gpus']:>5}{entry['tokens_per_s']:>11.0f}{entry['tokens_per_s_per_gpu']:>10.0f}"
            f"{entry['mfu']:>7.1%}{peak:>10}{eff:>7}{diff:>12}{entry['wall_seconds']:>8.0f}  ok (ref {entry.get('reference', '-')})")


def write_json(args: argparse.Namespace, shapes: dict, done: list[dict], skipped: list[str]) -> None:
    if not os.environ.get("OUT"):
        return
    unrun = {n: [f"{s}/{layout}" for s in shapes for layout in (MOE_LAYOUTS if s == "moe" else DENSE_LAYOUTS)[n]]
             for n in (2, 4, 8) if n > args.gpus}
    payload = {"gpus": args.gpus, "tiny": args.tiny, "peak_flops_per_gpu": H200_BF16_PEAK,
               "shapes": {name: {**shape, "flops_per_token": flops_per_token(shape), "params": total_params(shape)}
                          for name, shape in shapes.items()},
               "cases": done, "skipped": skipped, "layouts_not_run_for_lack_of_gpus": unrun}
    Path(os.environ["OUT"], "scaling.json").write_text(json.dumps(payload, indent=1))


def drive(args: argparse.Namespace) -> None:
    started = time.time()
    gpu_ids = [] if args.tiny else visible_gpus()
    if not args.tiny and not gpu_ids:
        sys.exit("no GPU visible: run with --tiny for the CPU check")
    args.gpus = args.gpus or (2 if args.tiny else len(gpu_ids))
    if args.gpus not in DENSE_LAYOUTS or (gpu_ids and args.gpus > len(gpu_ids)):
        sys.exit(f"--gpus {args.gpus}: layouts exist for 1, 2, 4 or 8 GPUs and {len(gpu_ids) or 'no'} GPUs are visible")
    cases = plan(args)
    print(f"{len(cases)} cases on {args.gpus} {'CPU processes (gloo)' if args.tiny else 'GPUs'}: "
          + ", ".join(c.name for c in cases), flush=True)
    shapes = prepare_models(args, {c.shape for c in cases}, gpu_ids)
    for name, shape in shapes.items():
        note = f" (layers cut from {shape['full_layers']}: {shape['layers_note']})" if shape.get("full_layers") else ""
        print(f"[shape] {name}: {total_params(shape) / 1e9:.2f}B params, {shape['num_hidden_layers']} layers{note}, "
              f"{flops_per_token(shape) / 1e9:.2f} GFLOP/token (training), global batch {shape['global_batch']} x "
              f"{shape['seq']}", flush=True)
    done: list[dict] = []
    skipped: list[str] = []
    if args.references:  # earlier runs (e.g. the 1-GPU call) to compare with, listed first and marked
        earlier = json.loads(Path(args.references).read_text())["cases"]
        done += [{**entry, "from": args.references} for entry in earlier if entry["status"] == "ok"]
        print(f"[references] {len(done)} finished cases from {args.references}: " + ", ".join(e["case"] for e in done), flush=True)

    def finish(entry: dict) -> None:
        done.append(entry)
        summarise(entry, done, shapes)
        print(row(entry), flush=True)
        if entry.get("profile"):
            print("    " + entry["profile"].replace("\n", "\n    "), flush=True)
        if entry["status"] != "ok" and entry.get("output_tail"):
            print("    " + entry["output_tail"][-1500:].replace("\n", "\n    "), flush=True)
        write_json(args, shapes, done, skipped)

    def timeout_left() -> float | None:
        """None once --budget is spent; else the case timeout, cut so no case runs past the budget by over a minute."""
        if args.budget is None:
            return args.case_timeout
        left = args.budget - (time.time() - started)
        return None if left <= 0 else min(args.case_timeout, left + 60)

    print(HEADER, flush=True)
    single = [c for c in cases if c.gpus == 1]
    slots = [[g] for g in gpu_ids] if gpu_ids and not args.serial else [gpu_ids[:1] or None]
    free = list(range(len(slots)))

    def run_single(case: Case) -> dict:
        slot = free.pop()
        try:
            timeout = timeout_left()
            if timeout is None:
                return {"case": case.name, "shape": case.shape, "layout": case.layout, "gpus": 1, "status": "skipped: budget"}
            return run_case(case, args, slots[slot], timeout)
        finally:
            free.append(slot)

    with ThreadPoolExecutor(max_workers=len(slots)) as pool:  # 1-GPU cases side by side, one per GPU
        for entry in pool.map(run_single, single):
            finish(entry)
    for case in (c for c in cases if c.gpus > 1):
        timeout = timeout_left()
        if timeout is None:
            skipped.append(case.name)
            print(f"{case.name:<26}{case.gpus:>5}  skipped: --budget {args.budget} s spent", flush=True)
            continue
        finish(run_case(case, args, gpu_ids[:case.gpus] if gpu_ids else None, timeout))
    write_json(args, shapes, done, skipped)
    print(f"\nsummary ({time.time() - started:.0f} s; MFU against {H200_BF16_PEAK / 1e12:.0f} TFLOP/s per GPU; "
          "eff = tokens/s per GPU over the reference's)\n" + HEADER)
    for entry in done:
        print(row(entry))
    for n in (4, 8):
        if n > args.gpus:
            print(f"layouts for {n} GPUs not run: {args.gpus} {'processes' if args.tiny else 'GPUs'} here")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU with gloo (2 processes)")
    parser.add_argument("--gpus", type=int, default=None, help="the layout list to run (1, 2, 4, 8); default: all visible")
    parser.add_argument("--shapes", default="1b,8b,moe", help="comma-separated: 1b, 8b, moe")
    parser.add_argument("--cases", default="", help="fnmatch patterns on case names (1b/tp2, moe/ep2, 1b/speed-*, 1b/hf)")
    parser.add_argument("--layouts", default="", help="layouts to run instead of the --gpus list (tp2xsp: TP2 + sequence parallel)")
    parser.add_argument("--no-speed", action="store_true", help="skip the issue-12 speed cases (engine variants, HF baseline)")
    parser.add_argument("--speed-steps", type=int, default=10, help="steps of each speed case (batch 4, one micro-batch)")
    parser.add_argument("--warmup", type=int, default=3, help="first steps of each case left out of the timing")
    parser.add_argument("--budget", type=float, default=None,
                        help="start no case after this many seconds (a started case may run 60 s past it)")
    parser.add_argument("--case-timeout", type=float, default=420.0, help="seconds before a case is killed")
    parser.add_argument("--profile", action="store_true", help="profile one extra step of speed-default, speed-before and hf")
    parser.add_argument("--references", default=None, help="a scaling.json of an earlier run whose cases serve as references")
    parser.add_argument("--serial", action="store_true", help="run the 1-GPU cases one after another (not one per GPU)")
    parser.add_argument("--gpu-gib", type=float, default=140.0, help="GPU memory the 8b layer count is fitted to")
    parser.add_argument("--model-root", default=None, help="where the HF checkpoints are written (reused when present)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--make-model", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.model_root = args.model_root or str(Path(tempfile.gettempdir()) / f"toolkit-scaling-{'tiny' if args.tiny else 'full'}")
    if args.worker:
        worker(args)
    elif args.make_model:
        shape = dict((TINY_SHAPES if args.tiny else SHAPES)[args.make_model])
        if shape.get("full_layers"):
            layers, fits = choose_8b_layers(shape, args.gpu_gib, cap=4 if args.tiny else 8)
            shape["num_hidden_layers"] = layers
            shape["layers_note"] = (f"{layers} run; by the estimate one {args.gpu_gib:.0f} GiB GPU holds up to {fits}, "
                                    f"{shape['full_layers']} layers need ~{estimate_gib(shape, shape['full_layers']):.0f} GiB")
        make_model(args.make_model, shape, Path(args.model_dir))
    else:
        drive(args)


if __name__ == "__main__":
    main()
