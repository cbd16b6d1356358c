"""Dataset formats ``preference`` (prompt/chosen/rejected) and ``kto`` (prompt/completion/label).

Prompts and responses are text or lists of ``{role, content}`` messages; the chat template is
applied and only the response tokens get labels (shifted, per the core's label convention).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, ClassVar

from toolkit.config import option
from toolkit.contracts import Example, Sequence
from toolkit.data.template import record_tools
from toolkit.errors import DataError
from toolkit_dpo.losses import KTOConfig

ASSETS = Path(__file__).resolve().parent / "assets"


def _require(record: dict[str, Any], columns: tuple[str, ...], where: str, fmt: str) -> None:
    missing = [c for c in columns if record.get(c) is None]
    if missing:
        raise DataError(f"{where}: the {fmt!r} format needs column(s) {', '.join(repr(c) for c in missing)}; "
                        f"columns found: {', '.join(repr(c) for c in record) or 'none'}. "
                        "Rename columns with --columns OURS=THEIRS.")


def _messages(value: Any, where: str, column: str) -> list[dict[str, str]]:
    from toolkit.data.template import normalise_message

    if isinstance(value, str):
        return [{"role": "user" if column == "prompt" else "assistant", "content": value}]
    if not isinstance(value, list) or not value:
        raise DataError(f"{where}: column {column!r} must be a string or a non-empty list of messages, "
                        f"got {type(value).__name__}")
    return [normalise_message(message, f"{column}[{i}]", where) for i, message in enumerate(value)]


def _split_prompt(record: dict[str, Any], response_column: str, where: str) -> tuple[list | None, list]:
    """(prompt messages or None, response messages) for one response column."""
    response = _messages(record[response_column], where, response_column)
    if record.get("prompt") is not None:
        return _messages(record["prompt"], where, "prompt"), response
    # Implicit prompt: the response column holds the whole conversation; its last message is the reply.
    if len(response) < 2 or response[-1]["role"] != "assistant":
        raise DataError(f"{where}: without a 'prompt' column, {response_column!r} must be a conversation ending "
                        "with an assistant message (the response)")
    return response[:-1], response[-1:]


def encode_response(template: Any, prompt: list[dict[str, str]] | None, response: list[dict[str, str]],
                    where: str, raw_text: bool = False, tools: list | None = None) -> tuple[list[int], list[int]]:
    """Token ids and shifted labels of prompt + response, labels on the final response only; ``tools`` (a
    record's tool schemas) go to the chat template."""
    if raw_text:
        prompt_text = "".join(m["content"] for m in prompt or [])
        return template.encode_prompt_completion(prompt_text, "".join(m["content"] for m in response))
    if response[-1]["role"] != "assistant":
        raise DataError(f"{where}: the response must end with an assistant message, got role {response[-1]['role']!r}")
    text, spans = template.assistant_spans((prompt or []) + response, tools)
    first_reply = len(prompt or [])
    reply_spans = [span for span, index in zip(spans, _assistant_indices((prompt or []) + response))
                   if index >= first_reply]
    return template.encode_text_with_spans(text, reply_spans)


def _assistant_indices(messages: list[dict[str, str]]) -> list[int]:
    return [i for i, m in enumerate(messages) if m["role"] == "assistant"]


@dataclasses.dataclass(kw_only=True)
class PreferenceFormatConfig:
    raw_text: bool = option(False, help="Concatenate prompt and response as plain text instead of applying "
                                        "the chat template (base models).")
    system: str = option("", help="System prompt prepended to every prompt given as text.")


class PreferenceFormat:
    """``prompt`` / ``chosen`` / ``rejected`` records (text or message lists; ``prompt`` optional when the
    responses are whole conversations). An optional numeric ``margin`` column reaches the ``rm`` loss."""

    name: ClassVar[str] = "preference"
    Config: ClassVar[type] = PreferenceFormatConfig
    example_kind: ClassVar[str] = "preference"
    bundled_datasets: ClassVar[dict[str, str]] = {
        "parity-prefs": str(ASSETS / "parity-prefs.jsonl"),
        "parity-prefs-eval": str(ASSETS / "parity-prefs-eval.jsonl"),
    }

    def __init__(self, config: PreferenceFormatConfig | None = None):
        self.config = config or PreferenceFormatConfig()

    def detect(self, columns: list[str]) -> bool:
        return "chosen" in columns and "rejected" in columns

    def encode(self, record: dict[str, Any], tokenizer: Any, template: Any, where: str = "record") -> Example:
        _require(record, ("chosen", "rejected"), where, self.name)
        sequences = []
        prompts = []
        for role, column in ((0, "chosen"), (1, "rejected")):
            prompt, response = _split_prompt(record, column, where)
            if self.config.system and isinstance(record.get("prompt"), str):
                prompt = [{"role": "system", "content": self.config.system}, *prompt]
            prompts.append(prompt)
            ids, labels = encode_response(template, prompt, response, where, self.config.raw_text, record_tools(record, where))
            meta = {}
            if record.get("margin") is not None:
                try:
                    meta["margin"] = float(record["margin"])
                except (TypeError, ValueError):
                    raise DataError(f"{where}: 'margin' must be a number, got {record['margin']!r}") from None
            sequences.append(Sequence(ids, labels, role=role, meta=meta))
        if prompts[0] != prompts[1]:
            raise DataError(f"{where}: 'chosen' and 'rejected' must continue the same prompt; their conversations "
                            "differ before the final assistant reply")
        return Example(sequences, kind="preference")


# 1/0 (and 1.0/0.0) match True/False as dictionary keys.
LABELS = {True: True, False: False, "true": True, "false": False, "1": True, "0": False,
          "desirable": True, "undesirable": False}


class KTOFormat:
    """Unpaired ``prompt`` / ``completion`` / ``label`` records (label true = desirable)."""

    name: ClassVar[str] = "kto"
    Config: ClassVar[type] = KTOConfig
    """Shared with the ``kto`` loss: a recipe's ``kto:`` section (and ``--kto-*`` flags) configures both."""
    bundled_datasets: ClassVar[dict[str, str]] = {"parity-kto": str(ASSETS / "parity-kto.jsonl")}
    example_kind: ClassVar[str] = "unpaired"

    def __init__(self, config: KTOConfig | None = None):
        self.config = config or KTOConfig()
        self._previous: list[dict[str, str]] | None = None

    def detect(self, columns: list[str]) -> bool:
        return "completion" in columns and "label" in columns

    def encode(self, record: dict[str, Any], tokenizer: Any, template: Any, where: str = "record") -> Example:
        _require(record, ("prompt", "completion", "label"), where, self.name)
        label = record["label"]
        key = label.strip().lower() if isinstance(label, str) else label
        if not isinstance(key, (str, int, float)) or key not in LABELS:
            raise DataError(f"{where}: 'label' must be true/false (or 1/0), got {label!r}")
        desirable = LABELS[key]
        prompt = _messages(record["prompt"], where, "prompt")
        completion = _messages(record["completion"], where, "completion")
        tools = record_tools(record, where)
        ids, labels = encode_response(template, prompt, completion, where, self.config.raw_text, tools)
        meta = {"kto_label": float(desirable), "kto_kl": 0.0}
        sequences = [Sequence(ids, labels, role=0 if desirable else 1, meta=meta)]
        if self.config.kl:
            # The first record has no predecessor yet and pairs with its own completion.
            other = self._previous or completion
            kl_ids, kl_labels = encode_response(template, prompt, other, where, self.config.raw_text, tools)
            sequences.append(Sequence(kl_ids, kl_labels, role=0 if desirable else 1,
                                      meta={"kto_label": float(desirable), "kto_kl": 1.0}))
        self._previous = completion
        return Example(sequences, kind="unpaired")


FORMATS = (PreferenceFormat, KTOFormat)
