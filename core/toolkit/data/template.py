"""Chat templates: render conversations with the tokenizer's template (ChatML when it has none)
and mark which tokens train (assistant replies for SFT, everything for PT).

Messages are read as the OpenAI chat format writes them: ``content`` a string or a list of text
parts (joined with newlines, as vLLM's chat parser does), assistant ``tool_calls`` (their content
may be null), ``tool`` replies, and a list of ``tools``. Tool calls and tools reach
``tokenizer.apply_chat_template`` unchanged, so they render as the model's template defines them;
a template that would drop them is refused rather than trained on a conversation missing its calls.
"""

from __future__ import annotations

from dataclasses import dataclass, field
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
    _closing: str | None = field(default=None, init=False, repr=False)
    _ends_turns: bool | None = field(default=None, init=False, repr=False)

    @property
    def template(self) -> str:
        return getattr(self.tokenizer, "chat_template", None) or CHATML

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False,
               tools: list[dict[str, Any]] | None = None) -> str:
        """The template's text; a template that fails or breaks out of jinja's sandbox is a DataError, not a traceback."""
        from jinja2.exceptions import SecurityError, TemplateError

        try:
            return self.tokenizer.apply_chat_template(messages, chat_template=self.template, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt, tools=tools or None)
        except SecurityError as exc:
            raise DataError(f"the tokenizer's chat template tried something jinja's sandbox forbids ({exc}); "
                            "it was not run. Replace chat_template in the model's tokenizer_config.json") from None
        except TemplateError as exc:
            raise DataError(f"the tokenizer's chat template cannot render this conversation: "
                            f"{type(exc).__name__}: {exc}") from None

    def check_renders_tools(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> None:
        """Refuse a template that renders the same text without the tool calls (or without the tools): it
        would train on a conversation whose calls are missing."""
        calls = [i for i, m in enumerate(messages) if m.get("tool_calls")]
        if calls:
            bare = [{k: v for k, v in m.items() if k != "tool_calls"} for m in messages]
            if self.render(bare, tools=tools) == self.render(messages, tools=tools):
                raise DataError(f"message {calls[0]} has tool_calls, but the tokenizer's chat template does not render "
                                "tool calls; use a model whose chat template supports tools, or drop the record")
        if tools and self.render(messages) == self.render(messages, tools=tools):
            raise DataError("the record has 'tools', but the tokenizer's chat template does not render tools; use a model "
                            "whose chat template supports tools, or drop the column")

    def assistant_spans(self, messages: list[dict[str, Any]],
                        tools: list[dict[str, Any]] | None = None) -> tuple[str, list[tuple[int, int]]]:
        """The rendered text and the character spans of each assistant reply (with its end marker).

        A template that writes no end-of-turn marker after a reply (GLM-4: the next role token or EOS ends
        the turn) gets the stop signal GLM's own fine-tuning trains: the special token that opens the next
        turn (``<|user|>``, ``<|observation|>``) joins the reply's span, and ``eos_token`` is appended to the
        conversation and trains after a final reply. Without it SFT trains no stop and generation runs on."""
        if tools or any(m.get("tool_calls") for m in messages):
            self.check_renders_tools(messages, tools)
        full = self.render(messages, tools=tools)
        spans = self._reply_spans(messages, tools, full)
        if not self.ends_turns():
            full, spans = self._with_stop_tokens(full, spans)
        return full, spans

    def _with_stop_tokens(self, full: str, spans: list[tuple[int, int]]) -> tuple[str, list[tuple[int, int]]]:
        """Each reply's span extended over the special token right after it, or over an appended ``eos_token``
        when the reply ends the conversation (see :meth:`assistant_spans`)."""
        eos = self.tokenizer.eos_token or ""
        specials = sorted({str(t) for t in getattr(self.tokenizer, "all_special_tokens", [])}
                          | set(getattr(self.tokenizer, "get_added_vocab", dict)()), key=len, reverse=True)
        out = []
        for start, end in spans:
            if not full[end:].strip() and eos:
                full = full[:end] + eos  # the conversation ends with this reply (trailing whitespace is never trained)
                out.append((start, end + len(eos)))
                continue
            token = next((t for t in specials if t and full.startswith(t, end)), None)
            out.append((start, end + len(token)) if token else (start, end))
        return full, out

    def ends_turns(self) -> bool:
        """Whether the template writes an end-of-turn marker after an assistant reply (ChatML's ``<|im_end|>``,
        Llama 3's ``<|eot_id|>``...); GLM-4's ends with the reply itself."""
        if self._ends_turns is None:
            marker = "REPLY_END_PROBE_5c1e"
            try:
                text = self.render([{"role": "user", "content": "x"}, {"role": "assistant", "content": marker}])
            except DataError:  # a template that refuses this probe: keep what it renders
                text = ""
            self._ends_turns = not text.rstrip().endswith(marker)
        return self._ends_turns

    def _reply_spans(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                     full: str) -> list[tuple[int, int]]:
        spans = []
        for index, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prefix = (self.render(messages[:index], add_generation_prompt=True, tools=tools) if index
                      else self.generation_prompt())
            upto = self.render(messages[: index + 1], tools=tools)
            if not upto.startswith(prefix):
                raise DataError("the chat template renders a conversation prefix differently from the whole; "
                                "cannot locate assistant replies for label masking"
                                + (" (the conversation starts with an assistant message)" if not index else ""))
            reply = upto[len(prefix):]
            closing = self.closing_suffix()
            if closing and index < len(messages) - 1 and reply.endswith(closing):
                reply = reply[:-len(closing)]  # written only after the last turn (Phi-3's eos_token)
            # The reply span ends after the template's end-of-turn marker but not its trailing newline.
            stripped = reply.rstrip("\n")
            if full[len(prefix):len(prefix) + len(stripped)] != stripped:
                raise DataError(f"the chat template renders assistant message {index} differently when the conversation "
                                "goes on; cannot locate assistant replies for label masking")
            spans.append((len(prefix), len(prefix) + len(stripped)))
        return spans

    def closing_suffix(self) -> str:
        """What the template writes only after a conversation's last turn ('' for most; Phi-3's ``eos_token``):
        ``render([u, a]) = P + closing`` where ``render([u, a, u2]) = P + render([u2])``."""
        if self._closing is None:
            self._closing = ""
            turns = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
            follow = [{"role": "user", "content": "z"}]
            try:
                ended, continued, alone = self.render(turns), self.render(turns + follow), self.render(follow)
            except DataError:  # a template that refuses this probe (a required system turn...): nothing to take off
                return self._closing
            head = continued[:-len(alone)] if continued.endswith(alone) else None
            if head is not None and ended.startswith(head) and len(ended) > len(head):
                self._closing = ended[len(head):]
        return self._closing

    def generation_prompt(self) -> str:
        """What the template adds to open an assistant turn (templates refuse to render an empty conversation)."""
        probe = [{"role": "user", "content": "x"}]
        return self.render(probe, add_generation_prompt=True)[len(self.render(probe)):]

    def encode_messages(self, messages: list[dict[str, Any]],
                        tools: list[dict[str, Any]] | None = None) -> tuple[list[int], list[int]]:
        text, spans = self.assistant_spans(messages, tools)
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


def normalise_messages(messages: Any, where: str, system: Any = None) -> list[dict[str, Any]]:
    """Checked messages; ``system`` (a record's system-prompt column) opens the conversation when given."""
    if not isinstance(messages, list) or not messages:
        got = "an empty list" if isinstance(messages, list) else type(messages).__name__
        hint = " (a CSV cell holds only text: keep conversations in .jsonl, .json or .parquet)" if isinstance(messages, str) else ""
        raise DataError(f"{where}: expected a non-empty list of messages, got {got}{hint}")
    out = [normalise_message(message, f"message {i}", where) for i, message in enumerate(messages)]
    if system not in (None, ""):
        if out[0]["role"] == "system":
            raise DataError(f"{where}: the record has a 'system' column and its conversation opens with a system "
                            "message too; keep one of them")
        out.insert(0, {"role": "system", "content": text_value(system, "column 'system'", where)})
    if not any(m["role"] == "assistant" for m in out):
        raise DataError(f"{where}: the conversation has no assistant message to train on")
    return out


def normalise_message(message: Any, label: str, where: str) -> dict[str, Any]:
    """One OpenAI-style message: ``content`` as text (text parts joined), ``tool_calls`` checked and kept."""
    if not isinstance(message, dict) or "role" not in message:
        raise DataError(f"{where}: {label} needs 'role' and 'content', got {message!r:.120}")
    role = message["role"]
    if role not in ROLES:
        raise DataError(f"{where}: {label} has role {role!r}; roles: {', '.join(ROLES)}")
    calls = message.get("tool_calls")
    out: dict[str, Any] = {"role": role}
    if calls:
        if role != "assistant":
            raise DataError(f"{where}: {label} has tool_calls, which only an assistant message can make")
        out["tool_calls"] = [_tool_call(call, f"{label}, tool call {j}", where) for j, call in enumerate(_list(calls, label, where))]
    content = message.get("content")  # a null the reading layer dropped is missing: refused like null
    if content is None and calls:  # the OpenAI format's assistant turn that only calls tools
        out["content"] = ""
    else:
        out["content"] = content_text(content, label, where)
    for key in ("tool_call_id", "name"):
        if isinstance(message.get(key), str) and role == "tool":
            out[key] = message[key]
    return out


def content_text(content: Any, label: str, where: str) -> str:
    """A message's content as text: a string, or a list of ``{"type": "text", "text": ...}`` parts."""
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                shown = f"type {kind!r}" if kind is not None else f"{part!r:.60}"
                raise DataError(f"{where}: {label}, content part {j} is {shown}; only text parts "
                                "({\"type\": \"text\", \"text\": ...}) can train a text model")
            texts.append(text_value(part.get("text"), f"{label}, content part {j} 'text'", where))
        return "\n".join(texts)
    return text_value(content, f"{label} 'content'", where)


def text_value(value: Any, label: str, where: str) -> str:
    """A field that must hold text; null, numbers, lists and mappings are refused, not trained on as their repr."""
    if isinstance(value, str):
        return value
    got = "null" if value is None else type(value).__name__
    raise DataError(f"{where}: {label} must be text, got {got}" + (f" ({value!r:.60})" if value is not None else "")
                    + "; fix the record or drop it")


def _list(value: Any, label: str, where: str) -> list:
    if not isinstance(value, list):
        raise DataError(f"{where}: {label} 'tool_calls' must be a list, got {type(value).__name__}")
    return value


def _tool_call(call: Any, label: str, where: str) -> dict[str, Any]:
    """Kept as written, except JSON-string ``arguments`` (OpenAI's form) become a mapping, the form
    Hugging Face chat templates expect (they apply ``tojson`` to it)."""
    import json

    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise DataError(f"{where}: {label} needs {{\"type\": \"function\", \"function\": {{\"name\": ..., \"arguments\": ...}}}}, "
                        f"got {call!r:.120}")
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            raise DataError(f"{where}: {label} 'arguments' is not valid JSON: {arguments!r:.80}") from None
    if not isinstance(arguments, dict):
        raise DataError(f"{where}: {label} 'arguments' must be a JSON object, got {type(arguments).__name__}")
    return {**call, "type": call.get("type", "function"), "function": {**function, "arguments": arguments}}


def record_tools(record: dict[str, Any], where: str, column: str = "tools") -> list[dict[str, Any]] | None:
    """A record's ``tools`` column: a list of tool schemas, or the JSON text of one (as LLaMA-Factory stores it)."""
    import json

    tools = record.get(column)
    if tools in (None, "", []):
        return None
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except ValueError:
            raise DataError(f"{where}: column {column!r} is not valid JSON") from None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise DataError(f"{where}: column {column!r} must be a list of tool schemas (mappings), got {type(tools).__name__}")
    return tools
