"""Core built-in plugin: dataset formats alpaca, messages, sharegpt and text."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from toolkit import hookimpl
from toolkit.config import option
from toolkit.contracts import Example, Sequence
from toolkit.data.template import ChatTemplate, normalise_messages, record_tools, text_value
from toolkit.errors import DataError


def _field(record: dict[str, Any], key: str, where: str, required: bool = True) -> Any:
    if key in record and record[key] is not None:
        return record[key]
    if required and key in record:  # null in JSON, an empty cell in CSV/Parquet
        raise DataError(f"{where}: column {key!r} is empty; give it a value or drop the record")
    if required:
        raise DataError(f"{where}: missing column {key!r}; columns found: {', '.join(record) or 'none'}")
    return None


@dataclasses.dataclass(kw_only=True)
class AlpacaConfig:
    system: str = option("", help="System prompt added to every alpaca record.")


class Alpaca:
    """``instruction`` / ``input`` / ``output`` records (Stanford Alpaca), rendered as a chat."""

    name: ClassVar[str] = "alpaca"
    Config: ClassVar[type] = AlpacaConfig
    example_kind: ClassVar[str] = "lm"

    def __init__(self, config: AlpacaConfig | None = None):
        self.config = config or AlpacaConfig()

    def detect(self, columns: list[str]) -> bool:
        return "instruction" in columns and "output" in columns

    def encode(self, record: dict[str, Any], tokenizer: Any, template: ChatTemplate, where: str = "record") -> Example:
        instruction = text_value(_field(record, "instruction", where), "column 'instruction'", where)
        extra = record.get("input")
        extra = text_value(extra, "column 'input'", where) if extra is not None else ""
        user = f"{instruction}\n\n{extra}" if extra else instruction
        output = text_value(_field(record, "output", where), "column 'output'", where)
        system = record.get("system")
        system = text_value(system, "column 'system'", where) if system not in (None, "") else self.config.system
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": user}, {"role": "assistant", "content": output}]
        ids, labels = template.encode_messages(messages, record_tools(record, where))
        return Example([Sequence(ids, labels)])


@dataclasses.dataclass(kw_only=True)
class MessagesConfig:
    column: str = option("messages", help="Column holding the list of {role, content} messages.")


class Messages:
    """OpenAI-style ``messages``: a list of ``{role, content}`` (system, user, assistant, tool; multi-turn; content
    as text or text parts; assistant ``tool_calls``), with optional ``system`` and ``tools`` columns."""

    name: ClassVar[str] = "messages"
    Config: ClassVar[type] = MessagesConfig
    example_kind: ClassVar[str] = "lm"

    def __init__(self, config: MessagesConfig | None = None):
        self.config = config or MessagesConfig()

    def detect(self, columns: list[str]) -> bool:
        return self.config.column in columns

    def encode(self, record: dict[str, Any], tokenizer: Any, template: ChatTemplate, where: str = "record") -> Example:
        messages = normalise_messages(_field(record, self.config.column, where), where, record.get("system"))
        ids, labels = template.encode_messages(messages, record_tools(record, where))
        return Example([Sequence(ids, labels)])


SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "function_call": "assistant", "observation": "tool", "tool": "tool"}


@dataclasses.dataclass(kw_only=True)
class ShareGPTConfig:
    column: str = option("conversations", help="Column holding the list of {from, value} turns.")


class ShareGPT:
    """ShareGPT ``conversations``: a list of ``{from: human|gpt|system, value}``."""

    name: ClassVar[str] = "sharegpt"
    Config: ClassVar[type] = ShareGPTConfig
    example_kind: ClassVar[str] = "lm"

    def __init__(self, config: ShareGPTConfig | None = None):
        self.config = config or ShareGPTConfig()

    def detect(self, columns: list[str]) -> bool:
        return self.config.column in columns

    def encode(self, record: dict[str, Any], tokenizer: Any, template: ChatTemplate, where: str = "record") -> Example:
        turns = _field(record, self.config.column, where)
        if not isinstance(turns, list):
            hint = " (a CSV cell holds only text: keep conversations in .jsonl, .json or .parquet)" if isinstance(turns, str) else ""
            raise DataError(f"{where}: {self.config.column!r} must be a list of {{from, value}} turns, got "
                            f"{type(turns).__name__}{hint}")
        messages = []
        for i, turn in enumerate(turns):
            role = SHAREGPT_ROLES.get(str(turn.get("from", "")).lower()) if isinstance(turn, dict) else None
            if role is None or "value" not in turn:
                raise DataError(f"{where}: turn {i} needs 'from' (one of {', '.join(SHAREGPT_ROLES)}) and 'value'")
            messages.append({"role": role, "content": turn["value"]})
        messages = normalise_messages(messages, where, record.get("system"))
        ids, labels = template.encode_messages(messages, record_tools(record, where))
        return Example([Sequence(ids, labels)])


@dataclasses.dataclass(kw_only=True)
class TextConfig:
    column: str = option("text", help="Column holding raw text.")
    add_eos: bool = option(True, help="Append the tokenizer's EOS token to every document.")


class Text:
    """Raw ``text`` documents for continued pre-training: every token trains."""

    name: ClassVar[str] = "text"
    Config: ClassVar[type] = TextConfig
    example_kind: ClassVar[str] = "lm"

    def __init__(self, config: TextConfig | None = None):
        self.config = config or TextConfig()

    def detect(self, columns: list[str]) -> bool:
        return self.config.column in columns

    def encode(self, record: dict[str, Any], tokenizer: Any, template: ChatTemplate, where: str = "record") -> Example:
        text = _field(record, self.config.column, where)
        if not isinstance(text, str):
            raise DataError(f"{where}: {self.config.column!r} must be a string, got {type(text).__name__}")
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if self.config.add_eos and tokenizer.eos_token_id is not None:
            ids = ids + [tokenizer.eos_token_id]
        return Example([Sequence(ids, ids[1:] + [-100])])


@hookimpl
def toolkit_register_dataset_formats(register):
    for cls in (Messages, ShareGPT, Alpaca, Text):
        register(cls)
