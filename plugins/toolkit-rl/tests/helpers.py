"""Test helpers: a tiny causal LM, a fixed batch of rollouts in the core's contract and in TRL's GRPO layout."""

from __future__ import annotations

import dataclasses
import types
from collections import defaultdict

import torch

from toolkit.contracts import IGNORE_INDEX, StepContext, TokenLogps

VOCAB = 96


def tiny_model(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=128,
                         pad_token_id=0, attn_implementation="eager")
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).float().train()


@dataclasses.dataclass
class Rollouts:
    """G completions for each prompt with advantages, old (rollout-time) and reference per-token log-probs."""

    prompts: list[list[int]]
    completions: list[list[int]]
    advantages: list[float]
    old: list[list[float]]
    ref: list[list[float]]


def random_rollouts(model, reference, groups: int = 2, group: int = 4, seed: int = 0, drift: float = 0.3) -> Rollouts:
    """Completions of varying lengths; old log-probs = current ones plus noise (so ratios leave the clip range)."""
    g = torch.Generator().manual_seed(seed)

    def tokens(lo, hi):
        return torch.randint(1, VOCAB, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()

    prompts, completions = [], []
    for _ in range(groups):
        prompt = tokens(3, 7)
        for _ in range(group):
            prompts.append(prompt)
            completions.append(tokens(2, 9))
    rewards = torch.randn(groups * group, generator=g, dtype=torch.float64)
    grouped = rewards.view(groups, group)
    advantages = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)).flatten().tolist()
    with torch.no_grad():
        current = completion_logps(model, prompts, completions)
        ref = completion_logps(reference, prompts, completions)
    old = [[v + drift * float(torch.randn(1, generator=g)) for v in row] for row in current]
    return Rollouts(prompts, completions, advantages, old, ref)


def completion_logps(model, prompts, completions) -> list[list[float]]:
    out = []
    for p, c in zip(prompts, completions):
        ids = torch.tensor([p + c])
        logps = torch.log_softmax(model(input_ids=ids).logits.float(), -1)[0]
        out.append([float(logps[len(p) - 1 + j, c[j]]) for j in range(len(c))])
    return out


def micro_batch(r: Rollouts, rows: list[int]) -> dict:
    """Our contract: one completion per row, right padded; labels on the completion; token_meta aligned with labels."""
    width = max(len(r.prompts[i]) + len(r.completions[i]) for i in rows)
    shape = (len(rows), width)
    input_ids, labels = torch.zeros(shape, dtype=torch.long), torch.full(shape, IGNORE_INDEX)
    sequence_ids, position_ids = torch.full(shape, -1), torch.zeros(shape, dtype=torch.long)
    old, ref = torch.zeros(shape), torch.zeros(shape)
    for k, i in enumerate(rows):
        p, c = r.prompts[i], r.completions[i]
        n = len(p) + len(c)
        input_ids[k, :n] = torch.tensor(p + c)
        labels[k, len(p) - 1:n - 1] = torch.tensor(c)
        old[k, len(p) - 1:n - 1] = torch.tensor(r.old[i])
        ref[k, len(p) - 1:n - 1] = torch.tensor(r.ref[i])
        sequence_ids[k, :n] = k
        position_ids[k, :n] = torch.arange(n)
    meta = {"example_ids": torch.arange(len(rows)), "roles": torch.zeros(len(rows), dtype=torch.long),
            "advantage": torch.tensor([r.advantages[i] for i in rows], dtype=torch.float32)}
    return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids, "sequence_ids": sequence_ids,
            "sequence_meta": meta, "num_sequences": len(rows), "token_meta": {"old_logps": old, "ref_logps": ref}}


def token_logps(model, batch: dict) -> TokenLogps:
    """Per-token label log-probs (plain HF forward, no TRL code)."""
    mask = batch["labels"] != IGNORE_INDEX
    logits = model(input_ids=batch["input_ids"], attention_mask=(batch["sequence_ids"] >= 0).long()).logits.float()
    logps = torch.log_softmax(logits, -1).gather(-1, batch["labels"].clamp(min=0)[..., None]).squeeze(-1) * mask
    return TokenLogps(logps=logps, mask=mask, sequence_ids=batch["sequence_ids"], num_sequences=batch["num_sequences"],
                      sequence_meta=batch["sequence_meta"], token_meta=batch["token_meta"])


def context(batches: list[dict]) -> StepContext:
    tokens = sum(int((b["labels"] != IGNORE_INDEX).sum()) for b in batches)
    sequences = sum(b["num_sequences"] for b in batches)
    return StepContext(label_tokens=tokens, sequences=sequences, examples=sequences)


def trl_inputs(r: Rollouts, rows: list[int], generation_rows: list[int] | None = None) -> dict:
    """TRL's GRPO layout: left-padded prompts, right-padded completions, per-token old/ref log-probs;
    ``num_items_in_batch`` counts the completion tokens of the whole generation batch (``generation_rows``)."""
    pw = max(len(r.prompts[i]) for i in rows)
    cw = max(len(r.completions[i]) for i in rows)
    n = len(rows)
    prompt_ids, prompt_mask = torch.zeros(n, pw, dtype=torch.long), torch.zeros(n, pw, dtype=torch.long)
    completion_ids, completion_mask = torch.zeros(n, cw, dtype=torch.long), torch.zeros(n, cw, dtype=torch.long)
    old, ref = torch.zeros(n, cw), torch.zeros(n, cw)
    for k, i in enumerate(rows):
        p, c = r.prompts[i], r.completions[i]
        prompt_ids[k, pw - len(p):], prompt_mask[k, pw - len(p):] = torch.tensor(p), 1
        completion_ids[k, :len(c)], completion_mask[k, :len(c)] = torch.tensor(c), 1
        old[k, :len(c)], ref[k, :len(c)] = torch.tensor(r.old[i]), torch.tensor(r.ref[i])
    return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
            "completion_mask": completion_mask, "advantages": torch.tensor([r.advantages[i] for i in rows]),
            "old_per_token_logps": old, "ref_per_token_logps": ref,
            "num_items_in_batch": torch.tensor(float(sum(len(r.completions[i]) for i in (generation_rows or rows))))}


def trl_grpo(model, *, loss_type: str, beta: float, epsilon: float, epsilon_high: float, level: str,
             max_completion_length: int, accumulation: int = 1):
    """A GRPOTrainer without its constructor: the attributes ``_compute_loss`` reads, and TRL's fused LM head."""
    from accelerate import Accelerator
    from trl import GRPOTrainer
    from trl.trainer.utils import add_fused_lm_head

    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    stub = object.__new__(GRPOTrainer)
    stub.__dict__.update(
        model=model, accelerator=Accelerator(cpu=True), aux_loss_enabled=False, loss_type=loss_type, beta=beta,
        epsilon_low=epsilon, epsilon_high=epsilon_high, importance_sampling_level=level, top_entropy_quantile=1.0,
        off_policy_mask_threshold=None, use_vllm=False, vllm_importance_sampling_correction=False,
        max_completion_length=max_completion_length, current_gradient_accumulation_steps=accumulation,
        _entropy_bonus_enabled=False, _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        args=types.SimpleNamespace(delta=None, use_bias_correction_kl=False, steps_per_generation=accumulation))
    return stub


def grads(model) -> dict[str, torch.Tensor]:
    out = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def assert_grads_close(ours: dict, theirs: dict, rtol: float = 1e-4, atol: float = 1e-6) -> None:
    assert ours.keys() == theirs.keys() and ours
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}")
