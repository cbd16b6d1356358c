"""Where a training step's memory peak comes from: allocated bytes after forward, and peaks of forward and backward.

    python bench/memory_phases.py           # 1.24B Llama shape on one GPU, full and LoRA at seq 4096
    python bench/memory_phases.py --tiny    # CPU smoke run (no CUDA counters: prints the hook count only)

Uses the planner's measurement harness (toolkit.plan.measure.local_engine). Per case it prints, in GiB:
what forward leaves allocated (activations + saved logits), the activations the saved-tensor hook
counts, the forward peak, the backward peak, and the peak of a full engine step.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile

from plan_check import SHAPE_1B, SHAPE_TINY

CASES = [("full", 4096, False), ("lora", 4096, False), ("full", 1024, False), ("full", 4096, True)]


def child(index: int, tiny: bool) -> dict:
    import torch

    from toolkit.plan.measure import local_engine, saved_activation_bytes

    tuner, seq, recompute = CASES[index]
    config = SHAPE_TINY if tiny else SHAPE_1B
    cuda = torch.cuda.is_available() and not tiny
    with tempfile.TemporaryDirectory() as directory:
        engine, loss_fn, step = local_engine(config, directory, tuner=tuner, seq_len=256 if tiny else seq, recompute=recompute)
    step()  # optimizer states exist
    hook = None if recompute else saved_activation_bytes(engine.model, loss_fn, config["vocab_size"])
    row = {"case": f"{tuner} seq {seq}{' recompute' if recompute else ''}", "hook_activations": hook}
    if cuda:
        gib = 2**30
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        loss = loss_fn()
        torch.cuda.synchronize()
        row["after_forward"] = (torch.cuda.memory_allocated() - base) / gib
        row["forward_peak"] = (torch.cuda.max_memory_allocated() - base) / gib
        torch.cuda.reset_peak_memory_stats()
        loss.backward()
        torch.cuda.synchronize()
        row["backward_peak"] = (torch.cuda.max_memory_allocated() - base) / gib
        row["after_backward"] = (torch.cuda.memory_allocated() - base) / gib
        del loss
        engine.optimizer.zero_grad(set_to_none=True)
        for p in engine.model.parameters():
            p.grad = None
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        row["base"] = base / gib
        row["step_peak_abs"] = torch.cuda.max_memory_allocated() / gib
        row["hook_activations"] = hook / gib if hook else None
    return row


def main() -> None:
    tiny = "--tiny" in sys.argv
    if "--child" in sys.argv:
        print(json.dumps(child(int(sys.argv[sys.argv.index("--child") + 1]), tiny)))
        return
    for index in range(len(CASES)):
        done = subprocess.run([sys.executable, __file__, "--child", str(index)] + (["--tiny"] if tiny else []),
                              capture_output=True, text=True, check=False)
        lines = done.stdout.strip().splitlines()
        print(lines[-1] if done.returncode == 0 and lines else f"case {index} failed: {done.stderr[-2000:]}", flush=True)


if __name__ == "__main__":
    main()
