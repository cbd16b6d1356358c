"""Bad input that used to train on garbage or end in a torch traceback: refused before anything loads, with
one message listing every problem (recipe numbers) or naming the file and line (records)."""

from __future__ import annotations

import math

import pytest

from toolkit.errors import ConfigError
from toolkit.recipe import resolve_recipe

BAD_NUMBERS = {
    "lr": (math.inf, "lr must be a finite number, got inf"),
    "adam_beta1": (1.0, "adam_beta1 must be in [0, 1), got 1.0"),
    "adam_beta2": (-0.1, "adam_beta2 must be in [0, 1), got -0.1"),
    "epochs": (0, "epochs must be positive when max_steps is 0, got 0"),
    "weight_decay": (-0.01, "weight_decay must be 0 or more, got -0.01"),
    "min_lr_ratio": (1.5, "min_lr_ratio must be between 0 and 1 (a fraction of --lr), got 1.5"),
    "adam_eps": (0.0, "adam_eps must be positive, got 0.0"),
    "max_grad_norm": (-1.0, "max_grad_norm must be 0 (no clipping) or more, got -1.0"),
}


@pytest.mark.parametrize("key", BAD_NUMBERS)
def test_an_optimizer_number_torch_would_misuse_is_refused(key):
    value, expected = BAD_NUMBERS[key]
    with pytest.raises(ConfigError) as error:
        resolve_recipe({"model": "tiny-llama", key: value})
    assert any(expected in p for p in error.value.problems), error.value.problems


def test_nan_lr_is_refused_not_compared():
    with pytest.raises(ConfigError) as error:
        resolve_recipe({"lr": math.nan})
    assert any("lr must be a finite number, got nan" in p for p in error.value.problems)


def test_every_bad_number_and_the_unknown_exporter_come_in_one_error():
    values = {key: value for key, (value, _) in BAD_NUMBERS.items()} | {"export": "hff"}
    with pytest.raises(ConfigError) as error:
        resolve_recipe(values)
    problems = error.value.problems
    assert len(problems) == len(BAD_NUMBERS) + 1
    assert any(p.startswith("export: unknown exporter 'hff' (did you mean 'hf'?)") for p in problems), problems


def test_sane_numbers_pass():
    recipe = resolve_recipe({"lr": 3e-4, "epochs": 0, "max_steps": 5, "min_lr_ratio": 1.0, "adam_beta1": 0.0,
                             "weight_decay": 0.1, "export": "hf"})
    assert (recipe.epochs, recipe.max_steps, recipe.export) == (0, 5, "hf")


def test_the_cli_refuses_a_bad_lr_before_loading_the_model(cli_runner, monkeypatch, tmp_path):
    import toolkit.models as loaders

    monkeypatch.setattr(loaders, "resolve_model", lambda *a, **k: pytest.fail("the model was loaded"))
    result = cli_runner.invoke("sft", "--model", "tiny-llama", "--lr", "inf", "--adam-beta2", "1",
                               "--export", "nope", "--output", str(tmp_path / "run"))
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "lr must be a finite number, got inf" in result.stderr
    assert "adam_beta2 must be in [0, 1), got 1.0" in result.stderr and "unknown exporter 'nope'" in result.stderr
    assert not (tmp_path / "run").exists()


def test_eval_samples_larger_than_the_data_names_the_flag_and_the_count(tmp_path, monkeypatch):
    import toolkit.builtins.strategies as strategies
    from toolkit.data.pipeline import load_examples
    from toolkit.models import resolve_model
    from toolkit.train.runner import run_training

    count = len(load_examples(["demo"], resolve_model("tiny-llama").tokenizer, seq_len=64)[0])
    monkeypatch.setattr(strategies.LocalStrategy, "build", lambda *a, **k: pytest.fail("the model was built"))
    with pytest.raises(ConfigError) as error:
        run_training(resolve_recipe({"eval_samples": count, "seq_len": 64, "output": str(tmp_path / "run")}))
    assert f"--eval-samples {count} holds out every example: the data has {count}" in str(error.value)


# ----------------------------------------------------------------------------------------------- records
TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}"
    "{% for call in message.tool_calls or [] %}<tool_call>{{ call.function.name }} {{ call.function.arguments | tojson }}"
    "</tool_call>{% endfor %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "Weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


@pytest.fixture
def tokenizer():
    from transformers import AutoTokenizer

    from toolkit.models import TOKENIZER_DIR

    return AutoTokenizer.from_pretrained(TOKENIZER_DIR)


def write_jsonl(path, *records):
    import json

    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def encode(path, tokenizer, **kw):
    from toolkit.data.pipeline import load_examples

    return load_examples([path], tokenizer, seq_len=512, **kw)[0]


def refusal(path, tokenizer, **kw):
    from toolkit.errors import DataError

    with pytest.raises(DataError) as error:
        encode(path, tokenizer, **kw)
    return str(error.value)


GOOD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


def test_null_content_is_refused_with_file_and_line(tmp_path, tokenizer):
    bad = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}]}
    path = write_jsonl(tmp_path / "chat.jsonl", GOOD, bad)
    assert f"{path}, line 2: message 1 'content' must be text, got null" in refusal(path, tokenizer)


@pytest.mark.parametrize("field,value,got", [("output", ["a", "b"], "list"), ("output", {"a": 1}, "dict"),
                                              ("instruction", 7, "int"), ("input", [1], "list")])
def test_alpaca_fields_that_are_not_text_are_refused(tmp_path, tokenizer, field, value, got):
    record = {"instruction": "say", "input": "", "output": "ok", field: value}
    path = write_jsonl(tmp_path / "alpaca.jsonl", {"instruction": "a", "output": "b"}, record)
    assert f"{path}, line 2: column '{field}' must be text, got {got}" in refusal(path, tokenizer)


def test_text_content_parts_are_joined_like_the_string(tmp_path, tokenizer):
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]},
                          {"role": "assistant", "content": [{"type": "text", "text": "hello"}]}]}
    plain = {"messages": [{"role": "user", "content": "hi\nthere"}, {"role": "assistant", "content": "hello"}]}
    (a,), (b,) = encode(write_jsonl(tmp_path / "a.jsonl", parts), tokenizer), encode(write_jsonl(tmp_path / "b.jsonl", plain), tokenizer)
    assert a.sequences[0].input_ids == b.sequences[0].input_ids and a.sequences[0].labels == b.sequences[0].labels


def test_an_image_part_is_refused_naming_its_type(tmp_path, tokenizer):
    record = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x.png"}}]},
                           {"role": "assistant", "content": "a cat"}]}
    path = write_jsonl(tmp_path / "chat.jsonl", record)
    assert f"{path}, line 1: message 0, content part 0 is type 'image_url'" in refusal(path, tokenizer)


def test_tool_calls_and_tools_render_as_the_template_defines_them(tmp_path, tokenizer):
    tokenizer.chat_template = TOOL_TEMPLATE
    messages = [{"role": "user", "content": "weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "content": "sunny"}, {"role": "assistant", "content": "It is sunny."}]
    path = write_jsonl(tmp_path / "tools.jsonl", {"messages": messages, "tools": TOOLS, "system": "Be brief."})
    (example,) = encode(path, tokenizer)
    reference_messages = [{"role": "system", "content": "Be brief."}, messages[0],
                          {**messages[1], "content": "", "tool_calls": [
                              {"type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}]},
                          *messages[2:]]
    text = tokenizer.apply_chat_template(reference_messages, tools=TOOLS, tokenize=False)
    assert '<tool_call>weather {"city": "Paris"}</tool_call>' in text and '"name": "weather"' in text
    ids = example.sequences[0].input_ids
    assert ids == tokenizer(text, add_special_tokens=False)["input_ids"]
    trained = tokenizer.decode([label for label in example.sequences[0].labels if label >= 0])
    assert "<tool_call>weather" in trained and "It is sunny." in trained and "Paris?" not in trained and "sunny<" not in trained


def test_a_template_without_tool_support_is_refused_not_trained_without_the_calls(tmp_path, tokenizer):
    from toolkit.data.template import CHATML

    tokenizer.chat_template = CHATML  # plain ChatML: no tools, no calls
    record = {"messages": [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "weather", "arguments": {}}}]}, {"role": "assistant", "content": "ok"}]}
    path = write_jsonl(tmp_path / "tools.jsonl", record)
    assert (f"{path}, line 1: message 1 has tool_calls, but the tokenizer's chat template does not render tool calls"
            in refusal(path, tokenizer))
    path = write_jsonl(tmp_path / "tools2.jsonl", {**GOOD, "tools": TOOLS})
    assert f"{path}, line 1: the record has 'tools', but the tokenizer's chat template does not render tools" in refusal(path, tokenizer)


def _reference_messages(record: dict) -> list[dict]:
    """The record as transformers' chat templates take it: the system column first, JSON arguments parsed."""
    import json

    messages = [{"role": "system", "content": record["system"]}] if "system" in record else []
    for message in record["messages"]:
        calls = [{**call, "function": {**call["function"], "arguments": json.loads(call["function"]["arguments"])
                                       if isinstance(call["function"]["arguments"], str) else call["function"]["arguments"]}}
                 for call in message.get("tool_calls", [])]
        messages.append({**message, "content": message["content"] or "", **({"tool_calls": calls} if calls else {})})
    return messages


def test_agent_data_renders_through_the_presets_template_as_transformers_does(tokenizer):
    """examples/agent-tools.jsonl through the bundled tokenizer's template (the tiny presets'): the ids are those of
    transformers' own ``apply_chat_template(messages, tools=...)``; exactly the assistant turns train (content, every
    tool call, the end marker), never the tools block, the user turns or the tool results."""
    import json
    import re
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / "agent-tools.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()]
    examples = load(str(path), tokenizer)
    assert len(examples) == len(records) == 3
    for record, example in zip(records, examples, strict=True):
        text = tokenizer.apply_chat_template(_reference_messages(record), tools=record["tools"], tokenize=False)
        sequence = example.sequences[0]
        assert sequence.input_ids == tokenizer(text, add_special_tokens=False)["input_ids"]
        turns = re.findall(r"<\|im_start\|>assistant\n(.*?<\|im_end\|>)", text, re.S)  # from transformers' text
        assert len(turns) == sum(m["role"] == "assistant" for m in record["messages"])
        trained = tokenizer.decode([label for label in sequence.labels if label >= 0])
        assert trained == "".join(turns)
        assert '<tool_call>\n{"name": "' in trained and "<tools>" in text and "<tools>" not in trained
    assert '"arguments": {"city": "Oslo"}}' in tokenizer.decode(examples[1].sequences[0].input_ids)  # parallel calls


def load(path, tokenizer):
    from toolkit.data.pipeline import load_examples

    return load_examples([path], tokenizer, seq_len=4096)[0]


CALL = {"type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}


@pytest.mark.parametrize(("message", "expected"), [
    ({"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {"name": "weather", "arguments": "{city: Paris"}}]},
     "message 1, tool call 0 'arguments' is not valid JSON: '{city: Paris'"),
    ({"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {"name": "weather", "arguments": "[1]"}}]},
     "message 1, tool call 0 'arguments' must be a JSON object, got list"),
    ({"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {"arguments": "{}"}}]},
     'message 1, tool call 0 needs {"type": "function", "function": {"name": ..., "arguments": ...}}'),
    ({"role": "assistant", "content": None, "tool_calls": CALL}, "message 1 'tool_calls' must be a list, got dict"),
    ({"role": "user", "content": "hi", "tool_calls": [CALL]}, "message 1 has tool_calls, which only an assistant message can make"),
    ({"role": "assistant", "content": None}, "message 1 'content' must be text, got null"),
])
def test_malformed_tool_calls_are_refused_naming_file_line_and_call(tmp_path, tokenizer, message, expected):
    good = {"messages": [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": None, "tool_calls": [CALL]},
                         {"role": "tool", "content": "sunny"}, {"role": "assistant", "content": "Sunny."}], "tools": TOOLS}
    bad = {**good, "messages": [good["messages"][0], message, *good["messages"][2:]]}
    path = write_jsonl(tmp_path / "agent.jsonl", good, bad)
    assert f"{path}, line 2: {expected}" in refusal(path, tokenizer)


def test_a_tools_column_that_is_not_json_is_refused_with_file_and_line(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "agent.jsonl", {**GOOD, "tools": TOOLS}, {**GOOD, "tools": '[{"type": "function",'})
    assert f"{path}, line 2: column 'tools' is not valid JSON" in refusal(path, tokenizer)


def test_data_inspect_brackets_the_tool_calls_not_the_tool_results(cli_runner):
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / "agent-tools.jsonl"
    result = cli_runner.invoke("data", "inspect", str(path), "--model", "tiny-qwen2", "--seq-len", "2048", "-n", "1")
    assert result.exit_code == 0, result.output
    sample = result.stdout.split("--- sample 0", 1)[1]
    assert '[[<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call><|im_end|>]]' in sample
    assert '<|im_start|>tool\n{"temperature": 18, "sky": "cloudy"}<|im_end|>' in sample  # the tool's answer: not trained
    assert "[[It is 18 °C and cloudy in Paris.<|im_end|>]]" in sample and sample.count("[[") == 2


def test_a_chat_template_escaping_the_sandbox_is_a_one_line_refusal(tmp_path, tokenizer):
    tokenizer.chat_template = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    path = write_jsonl(tmp_path / "chat.jsonl", GOOD)
    assert "chat template tried something jinja's sandbox forbids" in refusal(path, tokenizer)


def test_preference_messages_with_null_content_are_refused(tmp_path, tokenizer):
    pytest.importorskip("toolkit_dpo")
    record = {"prompt": [{"role": "user", "content": "q"}], "chosen": [{"role": "assistant", "content": None}],
              "rejected": "no"}
    path = write_jsonl(tmp_path / "prefs.jsonl", record)
    message = refusal(path, tokenizer, example_kinds=("preference",))
    assert f"{path}, line 1: chosen[0] 'content' must be text, got null" in message


def test_preference_records_pass_tools_and_tool_calls_to_the_template(tmp_path, tokenizer):
    pytest.importorskip("toolkit_dpo")
    tokenizer.chat_template = TOOL_TEMPLATE
    call = {"type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}
    prompt = [{"role": "user", "content": "weather in Paris?"}]
    chosen = [{"role": "assistant", "content": None, "tool_calls": [call]}]
    record = {"prompt": prompt, "chosen": chosen, "rejected": "It rains.", "tools": TOOLS}
    (example,) = encode(write_jsonl(tmp_path / "prefs.jsonl", record), tokenizer, example_kinds=("preference",))
    text = tokenizer.apply_chat_template([*prompt, {**chosen[0], "content": ""}], tools=TOOLS, tokenize=False)
    assert example.sequences[0].input_ids == tokenizer(text, add_special_tokens=False)["input_ids"]
    trained = tokenizer.decode([label for label in example.sequences[0].labels if label >= 0])
    assert "<tool_call>weather" in trained and "Paris?" not in trained
