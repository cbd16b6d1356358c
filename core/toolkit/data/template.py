"""Chat templates: render conversations with the tokenizer's template (ChatML when it has none)
and mark which tokens train (assistant replies for SFT, everything for PT)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from toolkit.contracts import IGNORE_INDEX
from toolkit.errors import DataError

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

ROLES = ("system", "user", "assistant", "tool")


@dataclass
class ChatTemplate:
    """Renders messages and returns token ids with SHIFTED labels (``labels[t]`` predicts ``ids[t+1]``)."""

    tokenizer: Any
    train_on: str = "assistant"
    """``assistant``: only assistant replies train; ``all``: every token (continued pre-training)."""

    @property
    def template(self) -> str:
        return getattr(self.tokenizer, "chat_template", None) or CHATML

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(messages, chat_template=self.template, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def assistant_spans(self, messages: list[dict[str, str]]) -> tuple[str, list[tuple[int, int]]]:
        """The rendered text and the character spans of each assistant reply (with its end marker)."""
        spans = []
        for index, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prefix = self.render(messages[:index], add_generation_prompt=True) if index else self.generation_prompt()
            upto = self.render(messages[: index + 1])
            if not upto.startswith(prefix):
                raise DataError("the chat template renders a conversation prefix differently from the whole; "
                                "cannot locate assistant replies for label masking"
                                + (" (the conversation starts with an assistant message)" if not index else ""))
            reply = upto[len(prefix):]
            # The reply span ends after the template's end-of-turn marker but not its trailing newline.
            stripped = reply.rstrip("\n")
            spans.append((len(prefix), len(prefix) + len(stripped)))
        return self.render(messages), spans

    def generation_prompt(self) -> str:
        """What the template adds to open an assistant turn (templates refuse to render an empty conversation)."""
        probe = [{"role": "user", "content": "x"}]
        return self.render(probe, add_generation_prompt=True)[len(self.render(probe)):]

    def encode_messages(self, messages: list[dict[str, str]]) -> tuple[list[int], list[int]]:
        text, spans = self.assistant_spans(messages)
        return self.encode_text_with_spans(text, spans if self.train_on == "assistant" else [(0, len(text))])

    def encode_text_with_spans(self, text: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
        encoded = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids: list[int] = encoded["input_ids"]
        trained = [any(start < end_s and end > start_s for start_s, end_s in spans) for start, end in encoded["offset_mapping"]]
        return ids, shift_labels(ids, trained)

    def encode_prompt_completion(self, prompt: str, completion: str) -> tuple[list[int], list[int]]:
        """Plain text prompt + completion: the completion (and EOS) trains."""
        eos = self.tokenizer.eos_token or ""
        text = prompt + completion + eos
        start = 0 if self.train_on == "all" else len(prompt)
        return self.encode_text_with_spans(text, [(start, len(text))])


def shift_labels(ids: list[int], trained: list[bool]) -> list[int]:
    """``labels[t] = ids[t+1]`` where token t+1 trains, else -100; the last position predicts nothing."""
    return [ids[t + 1] if trained[t + 1] else IGNORE_INDEX for t in range(len(ids) - 1)] + [IGNORE_INDEX]


def normalise_messages(messages: Any, where: str) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not messages:
        got = "an empty list" if isinstance(messages, list) else type(messages).__name__
        hint = " (a CSV cell holds only text: keep conversations in .jsonl, .json or .parquet)" if isinstance(messages, str) else ""
        raise DataError(f"{where}: expected a non-empty list of messages, got {got}{hint}")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise DataError(f"{where}: message {i} needs 'role' and 'content', got {message!r:.120}")
        if message["role"] not in ROLES:
            raise DataError(f"{where}: message {i} has role {message['role']!r}; roles: {', '.join(ROLES)}")
        out.append({"role": message["role"], "content": str(message["content"])})
    if not any(m["role"] == "assistant" for m in out):
        raise DataError(f"{where}: the conversation has no assistant message to train on")
    return out
