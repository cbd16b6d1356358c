"""``toolkit eval``: generation-based evaluation of a run or model on question/answer records.

Records are read by the training data's readers (jsonl, json, parquet, csv, ``save_to_disk`` folders; errors
name the file and line), prompts go to an inference backend in batches (``hf``, or ``vllm`` when installed),
and each registered metric (hook ``toolkit_register_metrics``) scores every prediction against its references.
Written here because no library runs our backends over our readers: ``predictions.jsonl`` (one line per
record) and ``scores.json`` (the means) are each written aside and renamed, never left half-written.
"""

from __future__ import annotations

import json
import os
import re
import string
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from toolkit.errors import DataError, ToolkitError

PROMPT_COLUMNS = ("prompt", "question", "instruction", "query", "input")
ANSWER_COLUMNS = ("answer", "answers", "reference", "references", "output", "response", "completion", "target")


def normalise_answer(text: str) -> str:
    """Lower case, no punctuation, no articles, single spaces (the SQuAD normalisation)."""
    text = "".join(ch for ch in text.lower() if ch not in string.punctuation)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


@dataclass
class Item:
    """One record to evaluate: the prompt (text, or chat messages), its accepted answers, where it came from."""

    prompt: str | list[dict[str, Any]]
    references: list[str]
    source: str


def _column(record: dict[str, Any], wanted: str, candidates: tuple[str, ...], flag: str, where: str) -> str:
    if wanted:
        if wanted not in record:
            raise DataError(f"{where}: no column {wanted!r} ({flag}); its columns: {', '.join(record) or 'none'}")
        return wanted
    found = next((c for c in candidates if c in record), None)
    if found is None:
        raise DataError(f"{where}: none of the columns {', '.join(candidates)} is there (its columns: "
                        f"{', '.join(record) or 'none'}); name the column with {flag}")
    return found


def _references(value: Any, where: str) -> list[str]:
    values = value if isinstance(value, list) else [value]
    if not values or not all(isinstance(v, (str, int, float)) and not isinstance(v, bool) for v in values):
        raise DataError(f"{where}: the answer must be text, a number or a list of them, got {value!r}")
    return [str(v) for v in values]


def _prompt(record: dict[str, Any], column: str, where: str) -> str | list[dict[str, Any]]:
    value = record[column]
    if column == "instruction" and record.get("input"):  # alpaca: the input follows the instruction
        return f"{value}\n\n{record['input']}"
    if _is_chat(value):
        return value
    if not isinstance(value, str) or not value.strip():
        raise DataError(f"{where}: the prompt ({column!r}) must be non-empty text or a list of chat messages "
                        f"(role, content), got {value!r}")
    return value


def _is_chat(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(m, dict) and "role" in m and "content" in m
                                                           for m in value)


def _chat_item(messages: list[dict[str, Any]], where: str) -> Item:
    """An SFT conversation (``messages``): the turns before the last one are the prompt, the last (the
    assistant's) the reference answer."""
    if messages[-1]["role"] != "assistant" or len(messages) < 2:
        raise DataError(f"{where}: a 'messages' record is evaluated by its last turn, which must be the assistant's "
                        f"answer after at least one other turn; this one ends with a {messages[-1]['role']!r} turn")
    return Item(messages[:-1], [str(messages[-1]["content"])], where)


def read_items(dataset: str, prompt_column: str = "", answer_column: str = "", limit: int = 0) -> list[Item]:
    """The dataset's records as :class:`Item` s: a prompt and an answer column (found per record unless named),
    or a ``messages`` conversation whose last (assistant) turn is the reference."""
    from toolkit.data.reading import read_records

    path, records = read_records(dataset, limit=limit)
    if not records:
        raise DataError(f"{path} holds no records")
    items = []
    for record in records:
        where = f"{path}, line {record.pop('__line__', len(items) + 1)}"
        if not (prompt_column or answer_column) and _is_chat(record.get("messages")):
            items.append(_chat_item(record["messages"], where))
            continue
        prompt = _column(record, prompt_column, PROMPT_COLUMNS, "--prompt-column", where)
        answer = _column(record, answer_column, ANSWER_COLUMNS, "--answer-column", where)
        items.append(Item(_prompt(record, prompt, where), _references(record[answer], where), where))
    return items


def render_prompts(items: list[Item], directory: Path, system: str, trust_remote_code: bool) -> tuple[list[str], bool]:
    """``(prompts, rendered)``: text prompts as they are (the backend applies the chat template), or, when any
    prompt is a list of messages, every prompt rendered here with the model's template (``rendered``: the
    backend must take them raw)."""
    if all(isinstance(item.prompt, str) for item in items):
        return [item.prompt for item in items], False
    from transformers import AutoTokenizer

    from toolkit.data.template import ChatTemplate

    template = ChatTemplate(AutoTokenizer.from_pretrained(directory, trust_remote_code=trust_remote_code))
    head = [{"role": "system", "content": system}] if system else []
    prompts = []
    for item in items:
        messages = item.prompt if isinstance(item.prompt, list) else [{"role": "user", "content": item.prompt}]
        if not any(m["role"] == "system" for m in messages):
            messages = head + messages
        prompts.append(template.render(messages, add_generation_prompt=True))
    return prompts, True


def raw_prompts_config(config: Any, backend: str) -> Any:
    """The backend's options with its chat template off (the prompts are rendered already)."""
    import dataclasses

    names = {f.name for f in dataclasses.fields(config)}
    if "chat_template" not in names:
        raise ToolkitError(f"backend {backend!r} has no chat_template option, so it cannot take prompts given as chat "
                           "messages; give text prompts or use --backend hf")
    return dataclasses.replace(config, chat_template=False, **({"system": ""} if "system" in names else {}))


def metric_instances(names: list[str], options: dict[str, dict[str, Any]]) -> list[Any]:
    """The metrics asked for, prepared (options checked, optional packages imported) before any model loads."""
    from toolkit.contracts import member
    from toolkit.plugins import get_plugin_manager

    if not names:
        raise ToolkitError("give at least one --metric (e.g. --metric exact)")
    manager = get_plugin_manager()
    metrics = []
    for name in dict.fromkeys(names):
        cls = manager.get("metric", name)
        metric = cls(cls.Config(**options.get(name, {})))
        member(metric, "metric", "prepare")()
        metrics.append(metric)
    return metrics


def default_output(reference: str, dataset: str) -> Path:
    """``RUN/eval-<dataset>`` for a run directory, else ``eval-<dataset>`` here."""
    stem = Path(dataset).stem or "dataset"
    run = Path(reference)
    return run / f"eval-{stem}" if (run / "recipe.yaml").is_file() else Path(f"eval-{stem}")


def run_eval(reference: str, dataset: str, metric_names: list[str], *, backend: str = "hf", output: str | None = None,
             metric_options: dict[str, dict[str, Any]] | None = None, prompt_column: str = "", answer_column: str = "",
             max_samples: int = 0, extra: tuple[str, ...] = (), **generation: Any) -> dict[str, Any]:
    """Generate for every record of ``dataset`` and score it; returns what ``scores.json`` holds.

    ``generation`` holds the backend's options (``max_new_tokens``, ``temperature``, ``batch_size``,
    ``chat_template``, ``system``, ``dtype``, ``trust_remote_code``); ``extra`` its ``--option KEY=VALUE``."""
    from toolkit.inference import backend_instance, model_directory, stdout_to_stderr

    items = read_items(dataset, prompt_column, answer_column, max_samples)
    metrics = metric_instances(metric_names, metric_options or {})
    instance = backend_instance(backend, generation)
    if extra:
        from toolkit.serving import split_extra

        instance.config, rest = split_extra(instance.config, extra)
        if rest:
            raise ToolkitError(f"--option {', '.join(rest)}: not an option of backend {backend!r}")
    destination = Path(output) if output else default_output(reference, dataset)
    with tempfile.TemporaryDirectory(prefix="toolkit-eval-") as workdir, stdout_to_stderr():
        directory = model_directory(reference, Path(workdir), generation.get("trust_remote_code", False))
        prompts, rendered = render_prompts(items, directory, generation.get("system", ""),
                                           generation.get("trust_remote_code", False))
        config = raw_prompts_config(instance.config, backend) if rendered else instance.config
        predictions = instance.generate(directory, prompts, config)
    scores = {m.name: m.score(predictions, [item.references for item in items]) for m in metrics}
    summary = {"model": reference, "dataset": dataset, "backend": backend, "count": len(items),
               "metrics": {name: sum(values) / len(values) for name, values in scores.items()},
               "matches": {name: int(sum(values)) for name, values in scores.items() if set(values) <= {0.0, 1.0}}}
    write_results(destination, items, prompts, predictions, scores, summary)
    return summary


def write_results(destination: Path, items: list[Item], prompts: list[str], predictions: list[str],
                  scores: dict[str, list[float]], summary: dict[str, Any]) -> None:
    destination.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"source": item.source, "prompt": prompt, "references": item.references, "prediction": prediction,
                         **{name: values[i] for name, values in scores.items()}}, ensure_ascii=False)
             for i, (item, prompt, prediction) in enumerate(zip(items, prompts, predictions))]
    _write_aside(destination / "predictions.jsonl", "".join(line + "\n" for line in lines))
    _write_aside(destination / "scores.json", json.dumps(summary, indent=2) + "\n")


def _write_aside(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise ToolkitError(f"cannot write {path}: {exc.strerror or exc}; choose another --output") from None
