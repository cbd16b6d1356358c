"""Test helpers: a tiny causal LM, random preference data, micro-batches in the core's contract, TRL stubs."""

from __future__ import annotations

import types
from collections import defaultdict

import torch

from toolkit.contracts import IGNORE_INDEX, StepContext, TokenLogps

VOCAB = 96


def tiny_model(seed: int = 0, classification: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=128,
                         pad_token_id=0, num_labels=1, attn_implementation="eager")
    torch.manual_seed(seed)
    model = (LlamaForSequenceClassification if classification else LlamaForCausalLM)(config)
    return model.float().train()


def random_pairs(n: int, seed: int = 0) -> list[tuple[list[int], list[int], list[int]]]:
    """(prompt, chosen, rejected) token lists of varying lengths."""
    g = torch.Generator().manual_seed(seed)

    def tokens(lo, hi):
        length = int(torch.randint(lo, hi, (1,), generator=g))
        return torch.randint(1, VOCAB, (length,), generator=g).tolist()

    return [(tokens(3, 7), tokens(2, 8), tokens(2, 8)) for _ in range(n)]


def micro_batch(sequences: list[tuple[list[int], list[int]]], example_ids: list[int], roles: list[int],
                meta: dict[str, list[float]] | None = None) -> dict:
    """One sequence per row, right-padded; labels shifted and only on the response tokens."""
    width = max(len(p) + len(r) for p, r in sequences)
    rows = len(sequences)
    input_ids = torch.zeros(rows, width, dtype=torch.long)
    labels = torch.full((rows, width), IGNORE_INDEX, dtype=torch.long)
    sequence_ids = torch.full((rows, width), -1, dtype=torch.long)
    position_ids = torch.zeros(rows, width, dtype=torch.long)
    for i, (prompt, response) in enumerate(sequences):
        ids = prompt + response
        n = len(ids)
        input_ids[i, :n] = torch.tensor(ids)
        labels[i, len(prompt) - 1:n - 1] = torch.tensor(response)
        sequence_ids[i, :n] = i
        position_ids[i, :n] = torch.arange(n)
    sequence_meta = {"example_ids": torch.tensor(example_ids), "roles": torch.tensor(roles)}
    for key, values in (meta or {}).items():
        sequence_meta[key] = torch.tensor(values, dtype=torch.float32)
    return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids, "sequence_ids": sequence_ids,
            "sequence_meta": sequence_meta, "num_sequences": rows}


def pair_batch(pairs, start: int = 0) -> dict:
    """Preference micro-batch: chosen and rejected of each pair (example ids from ``start``)."""
    seqs, ids, roles = [], [], []
    for k, (prompt, chosen, rejected) in enumerate(pairs):
        seqs += [(prompt, chosen), (prompt, rejected)]
        ids += [start + k, start + k]
        roles += [0, 1]
    return micro_batch(seqs, ids, roles)


def token_logps(model, batch: dict, reference=None, scores=None) -> TokenLogps:
    """Per-token label log-probs of the micro-batch (plain HF forward, no TRL code)."""
    mask = batch["labels"] != IGNORE_INDEX
    attention = (batch["sequence_ids"] >= 0).long()
    logits = model(input_ids=batch["input_ids"], attention_mask=attention).logits.float()
    logps = torch.log_softmax(logits, -1).gather(-1, batch["labels"].clamp(min=0)[..., None]).squeeze(-1) * mask
    out = TokenLogps(logps=logps, mask=mask, sequence_ids=batch["sequence_ids"], num_sequences=batch["num_sequences"],
                     sequence_meta=batch["sequence_meta"], scores=scores)
    if reference is not None:
        with torch.no_grad():
            out.reference_logps = token_logps(reference, batch).sequence_sums()
    return out


def context(batch_or_batches, examples: int) -> StepContext:
    batches = batch_or_batches if isinstance(batch_or_batches, list) else [batch_or_batches]
    tokens = sum(int((b["labels"] != IGNORE_INDEX).sum()) for b in batches)
    chosen = 0
    for b in batches:
        roles = b["sequence_meta"]["roles"]
        for s in range(b["num_sequences"]):
            if int(roles[s]) == 0:
                chosen += int(((b["sequence_ids"] == s) & (b["labels"] != IGNORE_INDEX)).sum())
    return StepContext(label_tokens=tokens, sequences=sum(b["num_sequences"] for b in batches), examples=examples,
                       counts={"chosen_label_tokens": chosen})


def grads(model) -> dict[str, torch.Tensor]:
    out = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def assert_grads_close(ours: dict, theirs: dict, rtol: float = 1e-4, atol: float = 1e-6) -> None:
    assert ours.keys() == theirs.keys() and ours
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


def trl_stub(trainer_cls, model, **attrs):
    """A trainer instance without running its constructor: just the attributes its loss code reads."""
    from accelerate import Accelerator

    stub = object.__new__(trainer_cls)
    stub.__dict__.update(model=model, accelerator=Accelerator(cpu=True), aux_loss_enabled=False,
                         _metrics={"train": defaultdict(list), "eval": defaultdict(list)}, _total_train_tokens=0,
                         _tp_size=1, args=types.SimpleNamespace(gradient_checkpointing_kwargs=None), **attrs)
    return stub


def trl_pair_inputs(pairs, side: str = "both"):
    """TRL DPO-style padded inputs: rows of chosen then rejected, with a completion mask."""
    rows = [(p, c) for p, c, _ in pairs] + [(p, r) for p, _, r in pairs]
    width = max(len(p) + len(c) for p, c in rows)
    input_ids = torch.zeros(len(rows), width, dtype=torch.long)
    attention = torch.zeros(len(rows), width, dtype=torch.long)
    completion = torch.zeros(len(rows), width, dtype=torch.long)
    for i, (p, c) in enumerate(rows):
        input_ids[i, :len(p) + len(c)] = torch.tensor(p + c)
        attention[i, :len(p) + len(c)] = 1
        completion[i, len(p):len(p) + len(c)] = 1
    return {"input_ids": input_ids, "attention_mask": attention, "completion_mask": completion}
