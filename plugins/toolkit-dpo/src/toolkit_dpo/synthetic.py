"""A scorable synthetic preference task (number parity) behind the bundled ``parity-prefs`` datasets.

Prompt ``Even or odd: 347``; the chosen reply ``347 odd`` states the correct parity, the rejected
one (``347 even``) the other. Restating the number puts its last digit right before the answer,
so a tiny model can learn the task in a few dozen steps, with or without a chat template.
The held-out file uses numbers the training file never shows; ``parity-kto`` holds the training
pairs as unpaired KTO records. Regenerate both with
``python -m toolkit_dpo.synthetic``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

ASSETS = Path(__file__).resolve().parent / "assets"


def parity(number: int) -> str:
    return "even" if number % 2 == 0 else "odd"


def score(prompt: str, completion: str) -> bool:
    """True when ``completion`` states the parity of the number that ends ``prompt``."""
    number = int(prompt.rsplit(" ", 1)[-1])
    words = completion.strip().lower().rstrip(".").split()
    return bool(words) and words[-1] == parity(number)


def records(numbers: list[int]) -> list[dict[str, str]]:
    out = []
    for number in numbers:
        right = parity(number)
        wrong = "odd" if right == "even" else "even"
        out.append({"prompt": f"Even or odd: {number}", "chosen": f"{number} {right}", "rejected": f"{number} {wrong}"})
    return out


def split(seed: int = 0, train: int = 600, held_out: int = 200) -> tuple[list[dict], list[dict]]:
    numbers = list(range(100, 1000))
    random.Random(seed).shuffle(numbers)
    return records(numbers[:train]), records(numbers[train:train + held_out])


def unpaired(pairs: list[dict[str, str]], seed: int = 0) -> list[dict]:
    """KTO records: each pair's chosen as desirable and rejected as undesirable, shuffled."""
    rows = [{"prompt": p["prompt"], "completion": p[side], "label": side == "chosen"}
            for p in pairs for side in ("chosen", "rejected")]
    random.Random(seed).shuffle(rows)
    return rows


def write(directory: Path = ASSETS) -> None:
    train, held_out = split()
    for name, rows in (("parity-prefs", train), ("parity-prefs-eval", held_out), ("parity-kto", unpaired(train))):
        with (directory / f"{name}.jsonl").open("w") as handle:
            handle.writelines(json.dumps(row) + "\n" for row in rows)


if __name__ == "__main__":
    write()
