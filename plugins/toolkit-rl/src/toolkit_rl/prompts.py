"""Prompt datasets for RL: records with a ``prompt`` (text or messages) or ``messages``, kept whole for the rewards.

Read through the core's reading layer (JSONL, JSON, Parquet, CSV, bundled names). A ``messages``
record gives the conversation before its last assistant turn as the prompt, and that turn as the
``answer`` when the record has none, so SFT chat data (the bundled ``demo``) serves as prompts too.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from toolkit.errors import DataError


@dataclasses.dataclass
class Prompt:
    ids: list[int]
    text: str
    """The rendered prompt as the model sees it."""
    record: dict[str, Any]
    source: str
    """``file, line N``."""


def normalise_messages(messages: Any, where: str) -> list[dict[str, str]]:
    """Role/content messages (the core's check for training data wants an assistant turn; a prompt has none)."""
    from toolkit.data.template import ROLES

    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: expected text or a non-empty list of messages, got {type(messages).__name__}")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES or "content" not in message:
            raise DataError(f"{where}: message {i} needs a 'role' ({', '.join(ROLES)}) and 'content', got {message!r:.120}")
    return [{"role": m["role"], "content": str(m["content"])} for m in messages]


def prompt_messages(record: dict[str, Any], where: str, raw: bool) -> tuple[list[dict[str, str]] | str, dict[str, Any]]:
    """(messages or raw text, the record with ``answer`` filled from a final assistant turn)."""
    if "prompt" in record:
        prompt = record["prompt"]
        if isinstance(prompt, str):
            return (prompt if raw else [{"role": "user", "content": prompt}]), record
        return normalise_messages(prompt, where), record
    if "messages" in record:
        messages = normalise_messages(record["messages"], where)
        if messages and messages[-1]["role"] == "assistant":
            record = {"answer": messages[-1]["content"], **record}
            messages = messages[:-1]
        if not messages:
            raise DataError(f"{where}: the conversation has no turn before its assistant reply to use as the prompt")
        return messages, record
    raise DataError(f"{where}: a prompt record needs a 'prompt' (text or messages) or a 'messages' column; it has "
                    f"{sorted(record)}. Rename columns with --columns prompt=YOUR_COLUMN")


def load_prompts(recipe: Any, config: Any, tokenizer: Any) -> list[Prompt]:
    """Every prompt of every ``--dataset``, tokenised, checked against ``--seq-len``."""
    from toolkit.data.reading import read_records
    from toolkit.data.template import ChatTemplate

    template = ChatTemplate(tokenizer)
    prompts: list[Prompt] = []
    for reference in recipe.dataset:
        path, records = read_records(reference, recipe.max_samples)
        for number, raw_record in enumerate(records, start=1):
            where = f"{path}, record {number}"
            record = {**raw_record, **{ours: raw_record[theirs] for ours, theirs in recipe.columns.items() if theirs in raw_record}}
            messages, record = prompt_messages(record, where, config.raw_prompts)
            text = messages if isinstance(messages, str) else template.render(messages, add_generation_prompt=True)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            if len(ids) + config.max_new_tokens > recipe.seq_len:
                raise DataError(f"{where}: the prompt has {len(ids)} tokens; with --max-new-tokens "
                                f"{config.max_new_tokens} that exceeds --seq-len {recipe.seq_len}. Raise --seq-len "
                                "or shorten the prompt")
            prompts.append(Prompt(ids, text, record, where))
    if not prompts:
        raise DataError(f"--dataset {', '.join(recipe.dataset)} holds no prompts")
    return prompts


def prompt_order(count: int, seed: int, epoch: int) -> list[int]:
    """The epoch's permutation of prompt indices (a function of seed and epoch only: resume replays it)."""
    import torch

    generator = torch.Generator().manual_seed(seed * 100_003 + epoch)
    return torch.randperm(count, generator=generator).tolist()
