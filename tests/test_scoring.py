"""``toolkit eval``: metrics against their definitions, batched generation against transformers one prompt at a
time, the files it writes, a plugin's metric through the hook, and bad input before any model loads."""

from __future__ import annotations

import json

import pytest

from toolkit import hookimpl
from toolkit.errors import ToolkitError
from toolkit.testing import write_jsonl

QA = [{"question": "What is the capital of Lopehes?", "answer": "Pefen"},
      {"question": "Name a colour.", "answers": ["red", "blue"]},
      {"prompt": [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Capital of Pevita?"}],
       "answer": "Vimi"},
      {"instruction": "Add the numbers.", "input": "2 and 3", "output": 5},
      {"messages": [{"role": "user", "content": "Capital of Zejinlo?"}, {"role": "assistant", "content": "Nope."}]}]


def metric(name, **options):
    from toolkit.plugins import get_plugin_manager

    cls = get_plugin_manager().get("metric", name)
    instance = cls(cls.Config(**options))
    instance.prepare()
    return instance


def test_match_metrics_follow_their_definitions():
    predictions = ["The Pefen.", "it is pefen city", "Blue", "answer is 42!", "no"]
    references = [["pefen"], ["Pefen"], ["red", "blue"], ["42"], ["yes"]]
    assert metric("exact").score(predictions, references) == [1.0, 0.0, 1.0, 0.0, 0.0]
    assert metric("exact", normalise=False).score(predictions, references) == [0.0, 0.0, 0.0, 0.0, 0.0]
    assert metric("contains").score(predictions, references) == [1.0, 1.0, 1.0, 1.0, 0.0]
    assert metric("contains").score(["pefenia"], [["pefen"]]) == [0.0]  # whole words only
    assert metric("regex", pattern=r"answer is (\d+)").score(predictions, references) == [0.0, 0.0, 0.0, 1.0, 0.0]


def lcs(a, b):
    table = [[0] * (len(b) + 1) for _ in range(len(a) + 1)]
    for i, x in enumerate(a):
        for j, y in enumerate(b):
            table[i + 1][j + 1] = table[i][j] + 1 if x == y else max(table[i][j + 1], table[i + 1][j])
    return table[-1][-1]


def test_rouge_l_is_the_lcs_f_measure():
    pytest.importorskip("rouge_score", reason="rouge-score is not installed: pip install 'toolkit-core[eval]'")
    prediction, reference = "the cat was found under the bed", "the cat was under the bed"
    common = lcs(prediction.split(), reference.split())
    p, r = common / len(prediction.split()), common / len(reference.split())
    ours = metric("rouge", stemmer=False).score([prediction], [[reference, "unrelated words"]])
    assert ours == [pytest.approx(2 * p * r / (p + r))]


def test_bad_metric_options_and_data_are_refused_before_the_model_loads(tmp_path, monkeypatch):
    import toolkit.inference as inference
    from toolkit.scoring import run_eval

    monkeypatch.setattr(inference, "model_directory", lambda *a, **k: pytest.fail("the model was loaded"))
    good = write_jsonl(tmp_path / "qa.jsonl", QA)
    with pytest.raises(ToolkitError, match="--metric regex needs --regex-pattern"):
        run_eval("tiny-llama", good, ["regex"])
    with pytest.raises(ToolkitError, match=r"not a valid regular expression"):
        run_eval("tiny-llama", good, ["regex"], metric_options={"regex": {"pattern": "(unclosed"}})
    with pytest.raises(ToolkitError, match="unknown metric 'bleu'"):
        run_eval("tiny-llama", good, ["bleu"])
    bad = write_jsonl(tmp_path / "bad.jsonl", [QA[0], {"question": "Where?", "label": "x"}])
    with pytest.raises(ToolkitError, match=r"bad.jsonl, line 2: none of the columns answer, answers"):
        run_eval("tiny-llama", bad, ["exact"])


def test_batched_predictions_equal_transformers_one_prompt_at_a_time(tmp_path, cli_runner):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from toolkit.builtins.loaders import materialize_preset
    from toolkit.data.template import ChatTemplate

    dataset = write_jsonl(tmp_path / "qa.jsonl", QA)
    result = cli_runner.invoke("eval", "tiny-llama", "--dataset", dataset, "--metric", "exact", "--metric", "contains",
                               "--batch-size", "3", "--max-new-tokens", "6", "--output", str(tmp_path / "out"))
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in (tmp_path / "out/predictions.jsonl").read_text().splitlines()]
    scores = json.loads((tmp_path / "out/scores.json").read_text())
    directory = materialize_preset("tiny-llama")
    tokenizer = AutoTokenizer.from_pretrained(directory)
    model = AutoModelForCausalLM.from_pretrained(directory).eval()
    template = ChatTemplate(tokenizer)
    for line, record in zip(lines, QA, strict=True):
        messages = record["prompt"] if "prompt" in record else record["messages"][:-1] if "messages" in record else [
            {"role": "user", "content": record.get("question") or f"{record['instruction']}\n\n{record['input']}"}]
        ids = tokenizer(template.render(messages, add_generation_prompt=True), return_tensors="pt",
                        add_special_tokens=False).input_ids
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id)
        assert line["prediction"] == tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert [line["references"] for line in lines] == [["Pefen"], ["red", "blue"], ["Vimi"], ["5"], ["Nope."]]
    assert scores["count"] == 5
    for name in ("exact", "contains"):
        assert scores["metrics"][name] == pytest.approx(sum(line[name] for line in lines) / 5)
        assert scores["matches"][name] == sum(line[name] for line in lines)
    assert "exact: " in result.output and str(tmp_path / "out") in result.output


class Length:
    """A plugin's metric: 1 for a prediction of at most ``words`` words."""

    name = "short"

    import dataclasses as _dc

    @_dc.dataclass(kw_only=True)
    class Config:
        words: int = 3

    def __init__(self, config):
        self.config = config

    def prepare(self):
        pass

    def score(self, predictions, references):
        return [float(len(p.split()) <= self.config.words) for p in predictions]


class LengthPlugin:
    @hookimpl
    def toolkit_register_metrics(self, register):
        register(Length)


def test_a_plugin_registers_a_metric_with_its_own_flag(tmp_path, toolkit_manager, monkeypatch, cli_runner):
    import toolkit.inference as inference

    class Echo:  # a backend that answers without a model: only the metric is under test
        config = type("Options", (), {"chat_template": True})()

        def generate(self, directory, prompts, config):
            return ["one two", "one two three four", "x", "y"][:len(prompts)]

    toolkit_manager(LengthPlugin())
    monkeypatch.setattr(inference, "backend_instance", lambda name, values: Echo())
    monkeypatch.setattr(inference, "model_directory", lambda *a, **k: tmp_path)
    dataset = write_jsonl(tmp_path / "qa.jsonl", [r for r in QA if "prompt" not in r and "messages" not in r] + [QA[0]])
    result = cli_runner.invoke("eval", "m", "--dataset", dataset, "--metric", "short", "--short-words", "2",
                               "--output", str(tmp_path / "o"))
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "o/scores.json").read_text())["metrics"]["short"] == 0.75
    assert "short: 0.7500 (3/4)" in result.output
