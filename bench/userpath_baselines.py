"""The baselines of bench/userpath.py, each run in its own process by ``userpath.py --baseline NAME``.

- ``hf-sft``: a plain HF transformers loop over the chats in a seeded random order, micro-batches padded to
  their longest row (what an HF user writes), fused AdamW, bf16 autocast over fp32 weights (the toolkit's
  default precision).
- ``trl-sft-bfd``: TRL's SFTTrainer with its own best-fit-decreasing packing (``packing=True``,
  ``packing_strategy="bfd"``, which turns on padding-free batches); ``trl-sft-padded``: SFTTrainer without
  packing (dynamic padding).
- ``trl-dpo``: TRL's DPOTrainer on the preference pairs, the reference model held in memory (as the
  toolkit's ``dpo`` without --precompute-reference).

TRL keeps its own defaults except those that would make it do other work than the toolkit case beside it:
gradient checkpointing off (TRL turns it on by default; the toolkit cases do not checkpoint) and the
same learning rate, sequence length and micro-batch size. Tokens are counted from each micro-batch as
the toolkit counts them: real tokens (attention mask, or every token of a padding-free row), trained
tokens (labels or completion mask), row fill real over capacity; time per optimizer step after warm-up.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any


class StepClock:
    """Tokens of each step (added by the trainer's training_step) and the time each step ends."""

    def __init__(self, device: Any):
        self.device, self.marks, self.tokens, self.losses = device, [time.perf_counter()], [], []

    def sync(self) -> None:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def add(self, real: int, trained: int, capacity: int) -> None:
        if len(self.tokens) < len(self.marks):
            self.tokens.append([0, 0, 0])
        step = self.tokens[-1]
        step[0], step[1], step[2] = step[0] + real, step[1] + trained, step[2] + capacity

    def end_step(self, loss: float | None = None) -> None:
        self.sync()
        self.marks.append(time.perf_counter())
        if loss is not None:
            self.losses.append(loss)

    def figures(self, warmup: int) -> dict:
        import torch

        spans = [b - a for a, b in zip(self.marks, self.marks[1:])]
        kept = list(range(min(warmup, len(spans) - 1), len(spans)))
        seconds = sum(spans[i] for i in kept)
        real = sum(self.tokens[i][0] for i in kept)
        trained = sum(self.tokens[i][1] for i in kept)
        capacity = sum(self.tokens[i][2] for i in kept)
        peak = torch.cuda.max_memory_allocated() / 2**30 if self.device.type == "cuda" else 0.0
        losses = self.losses or [float("nan")]
        return {"steps": len(spans), "tokens_per_s": real / seconds, "trained_tokens_per_s": trained / seconds,
                "row_fill": real / max(capacity, 1), "peak_gib": peak, "first_loss": losses[0], "last_loss": losses[-1]}


def count_batch(clock: StepClock, inputs: dict, row_capacity: int = 0) -> None:
    """``row_capacity``: tokens a padding-free batch (one flattened row) could have held (micro-batch x max length)."""
    ids = inputs["input_ids"]
    mask = inputs.get("attention_mask")
    real = int(mask.sum()) if mask is not None else int(ids.numel())
    if "labels" in inputs:
        trained = int((inputs["labels"] != -100).sum())
    elif "completion_mask" in inputs:
        trained = int((inputs["completion_mask"] * (mask if mask is not None else 1)).sum())
    else:
        trained = real
    clock.add(real, trained, row_capacity if mask is None and row_capacity else int(ids.numel()))


def read_jsonl(path: Path) -> list[dict]:
    import json

    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def device() -> Any:
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def hf_sft(paths: dict, args: Any) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dev = device()
    tokenizer = AutoTokenizer.from_pretrained(paths["dense"])
    model = AutoModelForCausalLM.from_pretrained(paths["dense"], dtype=torch.float32, attn_implementation="sdpa").to(dev)
    model.config.use_cache = False
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=dev.type == "cuda")
    chats = read_jsonl(paths["chats"])
    random.Random(0).shuffle(chats)
    encoded = [tokenizer.apply_chat_template(c["messages"], tokenize=True, return_dict=False)[: args.seq_len] for c in chats]
    clock = StepClock(dev)
    pad = tokenizer.pad_token_id or 0
    for step in range(args.steps):
        rows = encoded[step * args.micro_batch:(step + 1) * args.micro_batch]
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, r in enumerate(rows):
            ids[i, :len(r)] = torch.tensor(r)
            mask[i, :len(r)] = 1
        labels = ids.masked_fill(mask == 0, -100)
        batch = {"input_ids": ids.to(dev), "attention_mask": mask.to(dev), "labels": labels.to(dev)}
        count_batch(clock, batch)
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        clock.end_step(float(loss))
    return clock.figures(args.warmup)


def clocked(trainer_cls: type, clock: StepClock, row_capacity: int = 0) -> type:
    """``trainer_cls`` counting each micro-batch's tokens and timing each optimizer step."""
    from transformers import TrainerCallback

    class Clocked(trainer_cls):
        def training_step(self, model, inputs, *rest, **kwargs):
            count_batch(clock, inputs, row_capacity)
            return super().training_step(model, inputs, *rest, **kwargs)

    class EndOfStep(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):  # after TRL's data preparation, as the toolkit's step 1
            clock.sync()
            clock.marks = [time.perf_counter()]

        def on_step_end(self, args, state, control, **kwargs):
            clock.end_step()

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                clock.losses.append(float(logs["loss"]))

    Clocked.step_callback = EndOfStep
    return Clocked


def trl_common(args: Any, out: Path, dev: Any) -> dict:
    return dict(output_dir=str(out), per_device_train_batch_size=args.micro_batch, max_steps=args.steps, learning_rate=1e-5,
                logging_steps=1, report_to=[], save_strategy="no", gradient_checkpointing=False, bf16=dev.type == "cuda",
                dataloader_num_workers=0, seed=0, use_cpu=dev.type == "cpu")


def trl_sft(paths: dict, args: Any, packing: bool) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    dev = device()
    clock = StepClock(dev)
    trainer_cls = clocked(SFTTrainer, clock, args.micro_batch * args.seq_len)
    config = SFTConfig(**trl_common(args, args.work / "trl-sft", dev), max_length=args.seq_len, packing=packing,
                       packing_strategy="bfd", model_init_kwargs={"dtype": torch.bfloat16, "attn_implementation": "sdpa"})
    chats = Dataset.from_list([{"messages": c["messages"]} for c in read_jsonl(paths["chats"])])
    trainer = trainer_cls(model=str(paths["dense"]), args=config, train_dataset=chats,
                          processing_class=AutoTokenizer.from_pretrained(paths["dense"]), callbacks=[trainer_cls.step_callback()])
    trainer.train()
    return clock.figures(args.warmup)


def trl_dpo(paths: dict, args: Any) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    dev = device()
    clock = StepClock(dev)
    trainer_cls = clocked(DPOTrainer, clock)
    config = DPOConfig(**{**trl_common(args, args.work / "trl-dpo", dev), "learning_rate": 1e-6}, max_length=2048,
                       model_init_kwargs={"dtype": torch.bfloat16, "attn_implementation": "sdpa"})
    pairs = Dataset.from_list(read_jsonl(paths["prefs"]))
    trainer = trainer_cls(model=str(paths["dense"]), args=config, train_dataset=pairs,
                          processing_class=AutoTokenizer.from_pretrained(paths["dense"]), callbacks=[trainer_cls.step_callback()])
    trainer.train()
    return clock.figures(args.warmup)


def run_baseline(name: str, paths: dict, args: Any) -> dict:
    runs = {"hf-sft": lambda: hf_sft(paths, args), "trl-sft-bfd": lambda: trl_sft(paths, args, packing=True),
            "trl-sft-padded": lambda: trl_sft(paths, args, packing=False), "trl-dpo": lambda: trl_dpo(paths, args)}
    result = runs[name]()
    return {**result, "status": "ok" if result["tokens_per_s"] > 0 else "no tokens counted"}
