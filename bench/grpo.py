"""GRPO throughput: ``toolkit grpo`` (HF generate rollouts, the local engine) beside TRL 1.16's GRPOTrainer, same script.

    python bench/grpo.py              # 1.24B Llama shape, 8 prompts x 8 completions x 256 new tokens, bf16 (one GPU)
    python bench/grpo.py --tiny       # a CPU smoke run of the same code path
    python bench/grpo.py --model DIR  # a real HF model directory instead of the random-weight shape

Both sides: the same model, prompts, reward function, group size, completion length, micro-batch and
one optimizer step per rollout batch (beta 0, so no reference model), HF ``generate`` for rollouts.
Rollout tokens/s = completion tokens / time of the rollout phase (sampling, rewards, log-probs);
training tokens/s = prompt + completion tokens / time of the optimizer steps. TRL's phases are timed
by wrapping ``_generate_and_score_completions`` and ``training_step``. Random weights never stop
early, so every completion is ``--completion`` tokens long on both sides. Writes $OUT/grpo.json.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from local_sft import SHAPE_1B, SHAPE_TINY  # noqa: E402


def make_model_dir(shape: dict, root: Path) -> Path:
    """A random-weight Llama with the toolkit's tiny tokenizer (its vocabulary, so every sampled id decodes)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from toolkit.models import TOKENIZER_DIR

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    config = LlamaConfig(**{**shape, "vocab_size": len(tokenizer)}, tie_word_embeddings=False, attn_implementation="sdpa",
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(root, safe_serialization=True)
    tokenizer.save_pretrained(root)
    return root


def write_prompts(model_dir: Path, count: int, words: int, path: Path) -> Path:
    generator = torch.Generator().manual_seed(0)
    vocabulary = ["river", "stone", "city", "capital", "north", "green", "seven", "market", "bridge", "winter"]
    with path.open("w") as handle:
        for _ in range(count):
            text = " ".join(vocabulary[int(i)] for i in torch.randint(0, len(vocabulary), (words,), generator=generator))
            handle.write(json.dumps({"prompt": f"Continue: {text}"}) + "\n")
    return path


def spread_reward(completions, **kwargs):
    """Varies between completions (so advantages are not zero): the share of letters that are vowels."""
    return [sum(ch in "aeiou" for ch in c) / max(len(c), 1) for c in completions]


def toolkit_grpo(model_dir: Path, prompts: Path, args, out: Path) -> dict:
    from toolkit.recipe import resolve_recipe
    from toolkit_rl.loop import run_grpo

    recipe = resolve_recipe({
        "model": str(model_dir), "dataset": [str(prompts)], "loss": "grpo", "output": str(out), "overwrite": True,
        "max_steps": args.steps + args.warmup, "micro_batch_size": args.micro_batch, "seq_len": args.completion + 128,
        "precision": "bf16" if torch.cuda.is_available() else "fp32", "lr": 1e-6, "schedule": "constant",
        "log_every": 1, "grpo": {"rewards": [f"{Path(__file__).resolve()}:spread_reward"], "num_generations": args.group,
                                 "prompts_per_rollout": args.prompts, "max_new_tokens": args.completion,
                                 "raw_prompts": True, "log_completions": 0}})
    start = time.perf_counter()
    run_grpo(recipe)
    wall = time.perf_counter() - start
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][args.warmup:]
    completion = sum(m["completion_length"] * args.prompts * args.group for m in lines)
    trained = sum(m["tokens_per_s"] * m["train_time"] for m in lines)
    rollout_time = sum(m["rollout_time"] for m in lines)
    train_time = sum(m["train_time"] for m in lines)
    return {"rollout_tokens_per_s": completion / rollout_time, "train_tokens_per_s": trained / train_time,
            "rollout_s_per_step": rollout_time / len(lines), "train_s_per_step": train_time / len(lines), "wall_s": wall}


def trl_grpo(model_dir: Path, prompts: Path, args, out: Path) -> dict:
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    cuda = torch.cuda.is_available()
    accumulation = max(args.prompts * args.group // args.micro_batch, 1)
    config = GRPOConfig(output_dir=str(out), per_device_train_batch_size=args.micro_batch,
                        gradient_accumulation_steps=accumulation, num_generations=args.group,
                        max_completion_length=args.completion, max_steps=args.steps + args.warmup, learning_rate=1e-6,
                        lr_scheduler_type="constant", beta=0.0, bf16=cuda, use_cpu=not cuda, logging_steps=1,
                        report_to="none", save_strategy="no", temperature=1.0, top_p=1.0, seed=42,
                        dataloader_num_workers=0, log_completions=False)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    dataset = load_dataset("json", data_files=str(prompts), split="train")
    trainer = GRPOTrainer(model=model, reward_funcs=spread_reward, args=config, train_dataset=dataset,
                          processing_class=tokenizer)
    phases = {"rollout": [], "step": [], "tokens": [], "completion": []}
    generate, training_step = trainer._generate_and_score_completions, trainer.training_step

    def timed_generate(inputs):
        start = time.perf_counter()
        output = generate(inputs)
        if cuda:
            torch.cuda.synchronize()
        phases["rollout"].append(time.perf_counter() - start)
        phases["completion"].append(int(output["completion_mask"].sum()))
        phases["tokens"].append(int(output["completion_mask"].sum() + output["prompt_mask"].sum()))
        return output

    def timed_step(*a, **k):
        start = time.perf_counter()
        result = training_step(*a, **k)
        if cuda:
            torch.cuda.synchronize()
        phases["step"].append(time.perf_counter() - start)
        return result

    trainer._generate_and_score_completions, trainer.training_step = timed_generate, timed_step
    start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - start
    # one rollout per optimizer step; training_step calls include the rollout of their step's first micro-batch
    rollouts = phases["rollout"][args.warmup:]
    steps = phases["step"][args.warmup * accumulation:]
    train_time = sum(steps) - sum(rollouts)
    return {"rollout_tokens_per_s": sum(phases["completion"][args.warmup:]) / sum(rollouts),
            "train_tokens_per_s": sum(phases["tokens"][args.warmup:]) / train_time,
            "rollout_s_per_step": sum(rollouts) / len(rollouts), "train_s_per_step": train_time / len(rollouts),
            "wall_s": wall}


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--model", help="an HF model directory (default: a random-weight 1.24B Llama shape)")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per optimizer step")
    parser.add_argument("--group", type=int, default=8, help="completions per prompt")
    parser.add_argument("--completion", type=int, default=256, help="new tokens per completion")
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1)
    args = parser.parse_args()
    if args.tiny:
        args.prompts, args.group, args.completion, args.micro_batch, args.steps, args.warmup = 2, 4, 8, 4, 2, 1
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model_dir = Path(args.model) if args.model else make_model_dir(SHAPE_TINY if args.tiny else SHAPE_1B, root / "model")
        prompts = write_prompts(model_dir, 8 * args.prompts * (args.steps + args.warmup), 12, root / "prompts.jsonl")
        rows = []
        for name, run in (("trl 1.16 GRPOTrainer (HF generate)", trl_grpo), ("toolkit grpo (HF generate, local engine)", toolkit_grpo)):
            result = run(model_dir, prompts, args, root / name.split()[0])
            rows.append({"run": name, **result, "prompts": args.prompts, "group": args.group, "completion": args.completion})
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(f"\nGRPO step, {device}, {args.prompts} prompts x {args.group} completions x {args.completion} new tokens, "
          f"{'tiny' if args.tiny else args.model or '1.24B'} model")
    print(f"{'run':44s} {'rollout tok/s':>13s} {'train tok/s':>11s} {'rollout s':>9s} {'train s':>8s}")
    for row in rows:
        print(f"{row['run']:44s} {row['rollout_tokens_per_s']:13.0f} {row['train_tokens_per_s']:11.0f} "
              f"{row['rollout_s_per_step']:9.2f} {row['train_s_per_step']:8.2f}")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "grpo.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
