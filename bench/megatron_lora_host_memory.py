"""Peak host memory per rank of Megatron-Core LoRA (issue 23): the adapters come from the tuner's
``initial_adapters`` (a meta skeleton) instead of ``load_hf_model`` on every rank.

CPU only (gloo), random weights, a Llama shape of about 1.1B parameters (TinyLlama's: hidden 2048,
22 layers, vocabulary 32000) or smaller with ``--layers``:

    python bench/megatron_lora_host_memory.py adapters      # one process: old path vs new, peak RSS
    python bench/megatron_lora_host_memory.py train --tp 2  # toolkit sft --strategy megatron --tuner lora, peak RSS per rank

Peak RSS is the kernel's high-water mark (``VmHWM`` in /proc/PID/status, for each
process: ``ru_maxrss`` would count the parent's peak
across fork and exec). Results print as JSON lines.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

GiB = 2**30


def model_dir(root: Path, layers: int) -> Path:
    directory = root / f"llama-1b-l{layers}"
    if (directory / "model.safetensors.index.json").is_file() or (directory / "model.safetensors").is_file():
        return directory
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from toolkit.models import TOKENIZER_DIR

    config = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=layers,
                         num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to_empty(device="cpu").to(torch.bfloat16)  # bf16 on disk: half the bytes to write
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.02)
    model.save_pretrained(directory, max_shard_size="1GB")
    del model
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    tokenizer.save_pretrained(directory)
    return directory


def peak_rss_gib() -> float:
    """This process's VmHWM (ru_maxrss would carry the parent's peak across fork + exec)."""
    return hwm_gib(os.getpid())[0]


def adapters(directory: str, path: str) -> None:
    """One process, one path: print the peak RSS of building the adapters (rank 0's work in the engine)."""
    import types

    import torch

    from toolkit.models import load_hf_directory, load_hf_model
    from toolkit_peft.tuners import LoRAConfig, LoRATuner

    source = load_hf_directory(directory, Path(directory))
    recipe = types.SimpleNamespace(seed=0, gradient_checkpointing=False, loss="sft", precision="fp32", strategy="megatron",
                                   optimizer="adamw", section=lambda name: {})
    tuner = LoRATuner(LoRAConfig(rank=16))
    tuner.validate(recipe, source)
    before = peak_rss_gib()
    start = time.perf_counter()
    if path == "load_hf_model":
        state = tuner.checkpoint_state(load_hf_model(source, tuner, recipe, torch.device("cpu")))
    else:
        state = tuner.initial_adapters(source, recipe)
    params = sum(t.numel() for t in state.values())
    print(json.dumps({"path": path, "adapter_params": params, "seconds": round(time.perf_counter() - start, 1),
                      "peak_rss_gib_before": round(before, 2), "peak_rss_gib": round(peak_rss_gib(), 2)}), flush=True)


def descendants(pid: int) -> list[int]:
    found, queue = [], [pid]
    while queue:
        parent = queue.pop()
        try:
            children = Path(f"/proc/{parent}/task/{parent}/children").read_text().split()
        except OSError:
            continue
        found += [int(c) for c in children]
        queue += [int(c) for c in children]
    return found


def _direct(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def hwm_gib(pid: int) -> tuple[float, str] | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024 / GiB, cmdline
    return None


def train(directory: Path, tp: int, output: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={tp}", "-m", "toolkit", "sft",
               "--model", str(directory), "--dataset", "demo", "--seq-len", "64", "--max-steps", "1", "--micro-batch-size", "1",
               "--global-batch-size", "1", "--strategy", "megatron", "--tp", str(tp), "--tuner", "lora", "--lora-rank", "16",
               "--output", str(output)]
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peaks: dict[int, float] = {}
    ranks: set[int] = set()

    def poll() -> None:
        while process.poll() is None:
            ranks.update(_direct(process.pid))  # torchrun's children: the ranks
            for pid in descendants(process.pid):
                seen = hwm_gib(pid)
                if seen is not None:
                    peaks[pid] = max(peaks.get(pid, 0.0), seen[0])
            time.sleep(0.2)

    watcher = threading.Thread(target=poll, daemon=True)
    watcher.start()
    log = process.communicate()[0]
    watcher.join()
    per_rank = [round(peaks[pid], 2) for pid in sorted(ranks) if pid in peaks]
    others = [round(gib, 2) for pid, gib in sorted(peaks.items()) if pid not in ranks]
    print(json.dumps({"tp": tp, "returncode": process.returncode, "peak_rss_gib_per_rank": per_rank,
                      "launcher_and_helpers_gib": others}), flush=True)
    if process.returncode:
        print(log[-4000:], file=sys.stderr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["adapters", "train"])
    parser.add_argument("--layers", type=int, default=22, help="22: about 1.1B parameters")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--root", type=Path, default=Path(tempfile.gettempdir()) / "toolkit-bench-models")
    parser.add_argument("--path", choices=["load_hf_model", "initial_adapters"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    directory = model_dir(args.root, args.layers)
    if args.path:
        adapters(str(directory), args.path)
    elif args.what == "adapters":
        for path in ("load_hf_model", "initial_adapters"):  # a fresh process each: ru_maxrss is per process
            subprocess.run([sys.executable, __file__, "adapters", "--layers", str(args.layers), "--root", str(args.root),
                            "--path", path], check=True)
    else:
        with tempfile.TemporaryDirectory() as output:
            train(directory, args.tp, Path(output) / "run")


if __name__ == "__main__":
    main()
