"""Core built-in plugin: the generation metrics of ``toolkit eval`` (``exact``, ``contains``, ``regex``, ``rouge``).

ROUGE comes from Google's ``rouge-score`` package (the reference implementation; ``pip install rouge-score``,
also the core's ``[eval]`` extra); the match metrics are one line each on the SQuAD answer normalisation.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, ClassVar, Literal

from toolkit import hookimpl
from toolkit.config import option
from toolkit.errors import ConfigError, ToolkitError
from toolkit.scoring import normalise_answer


@dataclasses.dataclass(kw_only=True)
class MatchConfig:
    normalise: bool = option(True, help="Compare after SQuAD normalisation (lower case, no punctuation or articles, "
                                        "single spaces); --no-NAME-normalise compares the stripped text.")


class _Metric:
    """Scores the best match over a prediction's references; subclasses say what matching one means."""

    name: ClassVar[str] = ""
    Config: ClassVar[type] = MatchConfig

    def __init__(self, config: Any = None):
        self.config = config or self.Config()

    def prepare(self) -> None:
        """Nothing to check or import."""

    def score(self, predictions: list[str], references: list[list[str]]) -> list[float]:
        return [max((self.one(p, r) for r in refs), default=0.0) for p, refs in zip(predictions, references)]

    def clean(self, text: str) -> str:
        return normalise_answer(text) if self.config.normalise else text.strip()

    def one(self, prediction: str, reference: str) -> float:
        raise NotImplementedError


class ExactMatch(_Metric):
    """1 when the prediction equals a reference answer."""

    name: ClassVar[str] = "exact"

    def one(self, prediction: str, reference: str) -> float:
        return float(self.clean(prediction) == self.clean(reference))


class Contains(_Metric):
    """1 when a reference answer occurs in the prediction (as whole words when normalised)."""

    name: ClassVar[str] = "contains"

    def one(self, prediction: str, reference: str) -> float:
        if self.config.normalise:
            return float(f" {normalise_answer(reference)} " in f" {normalise_answer(prediction)} ")
        return float(reference.strip() in prediction)


@dataclasses.dataclass(kw_only=True)
class RegexConfig(MatchConfig):
    pattern: str = option("", help="Regular expression (Python re) that extracts the answer from a prediction: its "
                                   "first group if it has one, else the whole match, e.g. 'answer is (\\S+)'.")


class RegexMatch(_Metric):
    """1 when the answer the pattern extracts from the prediction (first match) equals a reference answer."""

    name: ClassVar[str] = "regex"
    Config: ClassVar[type] = RegexConfig

    def prepare(self) -> None:
        if not self.config.pattern:
            raise ConfigError("--metric regex needs --regex-pattern PATTERN (the answer is its first group, or the "
                              "whole match), e.g. --regex-pattern 'answer is (\\S+)'")
        try:
            self.compiled = re.compile(self.config.pattern)
        except re.error as exc:
            raise ConfigError(f"--regex-pattern {self.config.pattern!r} is not a valid regular expression: {exc}") from None

    def one(self, prediction: str, reference: str) -> float:
        found = self.compiled.search(prediction)
        if found is None:
            return 0.0
        answer = found.group(1) if self.compiled.groups else found.group(0)
        return float(self.clean(answer or "") == self.clean(reference))


@dataclasses.dataclass(kw_only=True)
class RougeConfig:
    type: Literal["rouge1", "rouge2", "rougeL", "rougeLsum"] = option("rougeL", help="Which ROUGE: unigram, bigram "
                                                                                  "or longest-common-subsequence overlap.")
    stemmer: bool = option(True, help="Porter-stem words before matching (rouge-score's use_stemmer).")


class Rouge(_Metric):
    """ROUGE F-measure against the best reference, by Google's rouge-score package."""

    name: ClassVar[str] = "rouge"
    Config: ClassVar[type] = RougeConfig

    def prepare(self) -> None:
        try:
            from rouge_score import rouge_scorer
        except ImportError:
            raise ToolkitError("--metric rouge needs the rouge-score package: pip install rouge-score "
                               "(or the core's eval extra; from a clone: pip install -c constraints.txt -e '.[eval]')") from None
        self.scorer = rouge_scorer.RougeScorer([self.config.type], use_stemmer=self.config.stemmer)

    def one(self, prediction: str, reference: str) -> float:
        return float(self.scorer.score(reference, prediction)[self.config.type].fmeasure)


@hookimpl
def toolkit_register_metrics(register):
    for cls in (ExactMatch, Contains, RegexMatch, Rouge):
        register(cls)
