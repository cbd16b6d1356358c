"""``sample_segments`` (what ``toolkit data inspect`` brackets and toolkit-webui highlights): a token is
marked trained exactly when the label before it predicts it (labels are shifted by one)."""

from __future__ import annotations

import random

from toolkit.contracts import IGNORE_INDEX
from toolkit.data.inspect import render_sample, sample_segments


class Letters:
    """A tokenizer whose token i decodes to one letter: segments map back to token positions."""

    @staticmethod
    def decode(ids: list[int]) -> str:
        return "".join(chr(ord("a") + i) for i in ids)


def test_segments_mark_the_tokens_some_label_predicts():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 30)
        ids = [rng.randrange(26) for _ in range(n)]
        labels = [ids[i + 1] if i + 1 < n and rng.random() < 0.5 else IGNORE_INDEX for i in range(n)]
        expected = [i > 0 and labels[i - 1] != IGNORE_INDEX for i in range(n)]
        segments = sample_segments(Letters, ids, labels)
        flags = [trained for text, trained in segments for _ in text]
        assert "".join(text for text, _ in segments) == Letters.decode(ids)
        assert flags == expected
        assert all(a[1] != b[1] for a, b in zip(segments, segments[1:]))  # runs are maximal
        assert render_sample(Letters, ids, labels) == "".join(f"[[{t}]]" if k else t for t, k in segments)
