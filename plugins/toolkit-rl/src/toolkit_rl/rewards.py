"""Built-in rewards (answer match, regex format, length, DAPO's overlong penalty, a reward model) and ``--reward`` parsing.

A reward is a registered class (hook ``toolkit_register_rewards``) called on a batch of completions:
``reward(prompts, completions, completion_ids, records) -> list[float | None]``. ``--reward
module:function`` wraps a user's function with TRL's reward-function signature
(``f(prompts, completions, completion_ids, **columns)``), so TRL reward functions work unchanged.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from toolkit.config import option
from toolkit.errors import ConfigError, ToolkitError
from toolkit.scoring import normalise_answer  # the one SQuAD normalisation, shared with toolkit eval


@dataclasses.dataclass(kw_only=True)
class AnswerConfig:
    column: str = option("answer", help="Record column holding the reference answer (a string or a list of accepted ones).")
    mode: Literal["exact", "normalised", "contains"] = option(
        "normalised", help="exact: the stripped completion equals the answer; normalised: equal after SQuAD normalisation; "
                           "contains: the normalised answer occurs in the normalised completion.")


class AnswerReward:
    """1.0 when the completion matches the record's answer, else 0.0 (None for records without one)."""

    name = "answer"
    Config = AnswerConfig

    def __init__(self, config: AnswerConfig | None = None):
        self.config = config or AnswerConfig()

    def matches(self, completion: str, answer: str) -> bool:
        mode = self.config.mode
        if mode == "exact":
            return completion.strip() == answer.strip()
        if mode == "normalised":
            return normalise_answer(completion) == normalise_answer(answer)
        return f" {normalise_answer(answer)} " in f" {normalise_answer(completion)} "

    def __call__(self, prompts, completions, completion_ids, records) -> list[float | None]:
        scores: list[float | None] = []
        for completion, record in zip(completions, records):
            answer = record.get(self.config.column)
            if answer is None:
                scores.append(None)
                continue
            accepted = answer if isinstance(answer, list) else [answer]
            scores.append(1.0 if any(self.matches(completion, str(a)) for a in accepted) else 0.0)
        return scores


@dataclasses.dataclass(kw_only=True)
class FormatConfig:
    pattern: str = option(r"<think>.*?</think>\s*<answer>.*?</answer>",
                          help="Regular expression the whole completion must match (dot matches newlines).")

    def check(self) -> list[str]:
        try:
            re.compile(self.pattern)
        except re.error as exc:
            return [f"pattern {self.pattern!r} is not a valid regular expression: {exc}"]
        return []


class FormatReward:
    """1.0 when the stripped completion matches ``--format-pattern`` entirely, else 0.0."""

    name = "format"
    Config = FormatConfig

    def __init__(self, config: FormatConfig | None = None):
        self.config = config or FormatConfig()
        problems = self.config.check()
        if problems:
            raise ConfigError(problems, source="--reward format")
        self.regex = re.compile(self.config.pattern, re.DOTALL)

    def __call__(self, prompts, completions, completion_ids, records) -> list[float | None]:
        return [1.0 if self.regex.fullmatch(c.strip()) else 0.0 for c in completions]


@dataclasses.dataclass(kw_only=True)
class LengthConfig:
    target: int = option(0, help="Target completion length in tokens; the reward is -|tokens - target| / max(target, 1).")


class LengthReward:
    """Negative distance of the completion's token count from ``target`` (0 prefers short completions)."""

    name = "length"
    Config = LengthConfig

    def __init__(self, config: LengthConfig | None = None):
        self.config = config or LengthConfig()

    def __call__(self, prompts, completions, completion_ids, records) -> list[float | None]:
        target = self.config.target
        return [-abs(len(ids) - target) / max(target, 1) for ids in completion_ids]


@dataclasses.dataclass(kw_only=True)
class OverlongConfig:
    max_length: int = option(0, help="L_max in tokens (0: --max-new-tokens).")
    cache: int = option(8, help="L_cache: completions longer than L_max - L_cache are penalised linearly, down to -1.")


class OverlongReward:
    """DAPO's soft overlong punishment (eq. 13): 0 up to L_max - L_cache, then linear down to -1 at L_max."""

    name = "overlong"
    Config = OverlongConfig
    max_new_tokens = 0
    """Set by the run from ``--max-new-tokens`` when ``max_length`` is 0."""

    def __init__(self, config: OverlongConfig | None = None):
        self.config = config or OverlongConfig()

    def __call__(self, prompts, completions, completion_ids, records) -> list[float | None]:
        limit = self.config.max_length or self.max_new_tokens
        if limit <= 0:
            raise ConfigError("--reward overlong needs --overlong-max-length or --max-new-tokens", source="--reward")
        start = limit - self.config.cache
        scores: list[float | None] = []
        for ids in completion_ids:
            n = len(ids)
            scores.append(0.0 if n <= start else (start - n) / self.config.cache if n <= limit else -1.0)
        return scores


@dataclasses.dataclass(kw_only=True)
class RewardModelConfig:
    path: str = option("", help="Directory of a reward model (toolkit export --to hf-rm, or any HF *ForSequenceClassification).")
    batch_size: int = option(8, help="Completions scored per forward.")


class RewardModelReward:
    """The scalar score of a sequence-classification model on prompt + completion (toolkit-dpo's ``rm`` export).

    A conversation is scored as the reward model was trained (and as TRL's GRPOTrainer scores it): the
    prompt's messages plus the completion as the assistant's reply, rendered by the reward model's chat
    template, so its value head reads the token after the closed turn; a text prompt is prompt + completion.
    """

    name = "reward-model"
    Config = RewardModelConfig
    raw_prompts = False
    """Set by the run from ``--grpo-raw-prompts``: string prompts are text, not one user turn."""

    def __init__(self, config: RewardModelConfig | None = None):
        self.config = config or RewardModelConfig()
        path = Path(self.config.path)
        if not (path / "config.json").is_file():
            raise ConfigError(f"reward model directory {path} has no config.json; pass a directory written by "
                              "`toolkit export RUN --to hf-rm --output DIR` (or --reward DIR)", source="--reward")
        from toolkit.models import check_remote_code

        # transformers would ask on a terminal when the model names its own code: one "y" would run it
        check_remote_code(path, False, "A reward model's own code is never run: use a directory written by "
                                       "`toolkit export RUN --to hf-rm` or a model of an architecture transformers has")
        self.model = self.tokenizer = None

    def _load(self) -> None:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        from toolkit_rl.rollout import whole_models

        with whole_models():  # safetensors only: never unpickle weights from a directory; never run its code
            self.model = AutoModelForSequenceClassification.from_pretrained(self.config.path, use_safetensors=True,
                                                                            trust_remote_code=False).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(self.config.path, trust_remote_code=False)

    def __call__(self, prompts, completions, completion_ids, records) -> list[float | None]:
        import torch

        if self.model is None:
            self._load()
        scores: list[float | None] = []
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        texts = self.texts(prompts, completions, records)
        for start in range(0, len(texts), self.config.batch_size):
            encoded = [self.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts[start:start + self.config.batch_size]]
            width = max(len(e) for e in encoded)
            ids = torch.full((len(encoded), width), pad)
            attention = torch.zeros_like(ids)
            for i, e in enumerate(encoded):  # right padding: HF scores the last non-pad token
                ids[i, :len(e)], attention[i, :len(e)] = torch.tensor(e), 1
            with torch.no_grad():
                logits = self.model(input_ids=ids, attention_mask=attention).logits[:, 0].float()
            scores.extend(float(v) for v in logits)
        return scores


    def texts(self, prompts: list[str], completions: list[str], records: list[dict[str, Any]]) -> list[str]:
        """What the reward model reads: the conversation closed by the completion, or prompt text + completion."""
        from toolkit.data.template import ChatTemplate
        from toolkit_rl.prompts import prompt_messages

        template = ChatTemplate(self.tokenizer)
        texts = []
        for prompt, completion, record in zip(prompts, completions, records):
            messages = prompt_messages(record, "reward model", self.raw_prompts)[0] if record else prompt
            if isinstance(messages, str):
                texts.append(prompt + completion)
            else:
                texts.append(template.render([*messages, {"role": "assistant", "content": completion}]))
        return texts


class FunctionReward:
    """A user's Python function with TRL's signature: ``f(prompts, completions, completion_ids, **columns)``."""

    name = "function"
    Config = dataclasses.make_dataclass("FunctionConfig", [], kw_only=True)

    def __init__(self, function: Callable[..., Any], spec: str):
        self.function, self.spec = function, spec

    def __call__(self, prompts, completions, completion_ids, records) -> list[float | None]:
        columns = {key: [r.get(key) for r in records] for key in sorted({k for r in records for k in r})}
        columns.pop("prompt", None)
        try:
            scores = self.function(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
        except Exception as exc:
            raise ToolkitError(f"reward function {self.spec} raised {type(exc).__name__}: {exc}") from exc
        if not isinstance(scores, (list, tuple)) or len(scores) != len(completions):
            raise ToolkitError(f"reward function {self.spec} must return one number (or None) per completion: "
                               f"got {type(scores).__name__} for {len(completions)} completions")
        return [None if s is None else float(s) for s in scores]


REWARDS = (AnswerReward, FormatReward, LengthReward, OverlongReward, RewardModelReward)


@dataclasses.dataclass
class WeightedReward:
    label: str
    """The name metrics use (``answer``, ``mymodule.score``)."""
    reward: Any
    weight: float


def _split_weight(spec: str) -> tuple[str, float]:
    head, sep, tail = spec.rpartition(":")
    if sep:
        try:
            return head, float(tail)
        except ValueError:
            pass
    return spec, 1.0


def _import_function(spec: str) -> Callable[..., Any]:
    module_name, _, attribute = spec.rpartition(":")
    try:
        if module_name.endswith(".py"):
            path = Path(module_name)
            if not path.is_file():
                raise ConfigError(f"--reward {spec}: file {path} does not exist", source="--reward")
            loader = importlib.util.spec_from_file_location(f"toolkit_reward_{path.stem}", path)
            module = importlib.util.module_from_spec(loader)
            loader.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except ConfigError:
        raise
    except Exception as exc:
        raise ConfigError(f"--reward {spec}: cannot import {module_name!r}: {type(exc).__name__}: {exc}", source="--reward") from None
    function = getattr(module, attribute, None)
    if not callable(function):
        raise ConfigError(f"--reward {spec}: {module_name} has no function {attribute!r}", source="--reward")
    return function


def build_rewards(specs: list[str], recipe: Any, manager: Any) -> list[WeightedReward]:
    """``--reward`` values -> reward objects with weights; every problem named before any model loads."""
    from toolkit.recipe import thing_options

    if not specs:
        names = ", ".join(manager.registry("reward").names())
        raise ConfigError(f"toolkit grpo needs at least one --reward (registered: {names}; or module:function, "
                          "or a reward-model directory)", source="--reward")
    built = []
    for spec in specs:
        target, weight = _split_weight(spec)
        if Path(target).is_dir():
            built.append(WeightedReward(Path(target).name, RewardModelReward(RewardModelConfig(path=target)), weight))
        elif ":" in target:
            label = target.rpartition(":")[2]
            built.append(WeightedReward(label, FunctionReward(_import_function(target), target), weight))
        else:
            cls = manager.get("reward", target)
            built.append(WeightedReward(target, cls(thing_options(recipe, cls)), weight))
    return built
