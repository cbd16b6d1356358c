"""A reward for RL (``toolkit grpo --reward sentence``, with toolkit-rl installed): does the completion end a sentence?

A reward is a class with a ``name``, a ``Config`` dataclass (its fields become ``--sentence-*`` flags
and a ``sentence:`` YAML section) and ``__call__`` returning one score per completion, or ``None``
where the reward does not apply. No torch needed: it reads the decoded text.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from toolkit.config import option


@dataclasses.dataclass(kw_only=True)
class SentenceConfig:
    endings: str = option(".!?", help="Characters that end a sentence.")


class SentenceReward:
    """1.0 when the stripped completion ends with one of ``endings``, else 0.0."""

    name: ClassVar[str] = "sentence"
    Config: ClassVar[type] = SentenceConfig

    def __init__(self, config: SentenceConfig | None = None):
        self.config = config or SentenceConfig()

    def __call__(self, prompts: list[str], completions: list[str], completion_ids: list[list[int]],
                 records: list[dict[str, Any]]) -> list[float | None]:
        return [1.0 if text.strip()[-1:] and text.strip()[-1] in self.config.endings else 0.0 for text in completions]
