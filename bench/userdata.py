"""Realistic training data for bench/userpath.py: what users bring, not uniform random rows.

    python bench/userdata.py [DIR] [--chats 3000] [--docs 400] [--pairs 1500] [--tiny]

Writes ``chats.jsonl`` (``messages``; total lengths log-normal like public instruction sets: median about
600 tokens, most between 100 and 1500, a tail to 8k; one in five has several turns), ``docs.jsonl``
(``text``; long documents for PT, median about 3k tokens, a tail past 30k) and ``prefs.jsonl``
(``prompt``/``chosen``/``rejected`` chats, each pair within 2048 tokens). Text is made of words drawn from
a Zipf distribution over a fixed vocabulary so a real tokenizer sees real words; lengths are counted in
the toolkit's tokenizer tokens (about 1.6 per word). Seeded: the same arguments write the same files.
"""

from __future__ import annotations

import argparse
import json
import math
import random
from pathlib import Path

WORDS = ("the of and to in is was for that with as on by at from it his an were are which this be or has had not "
         "but first one their its new after who they have her she two been other when there all during into "
         "school time may years more most only over city some world would where later up such used many can "
         "state about national out known university united then made group also system model data train "
         "language network value table river music house water light paper market energy number answer "
         "question because between through under against without before should could people little great "
         "capital country history science computer program function result method theory process design").split()
TOKENS_PER_WORD = 1.6


def words(rng: random.Random, tokens: int) -> str:
    count = max(1, int(tokens / TOKENS_PER_WORD))
    weights = [1.0 / (rank + 1) for rank in range(len(WORDS))]
    chosen = rng.choices(WORDS, weights=weights, k=count)
    sentences, start = [], 0
    while start < count:
        n = rng.randint(6, 20)
        sentences.append(" ".join(chosen[start:start + n]).capitalize() + ".")
        start += n
    return " ".join(sentences)


def log_normal(rng: random.Random, median: float, sigma: float, low: int, high: int) -> int:
    return int(min(high, max(low, rng.lognormvariate(math.log(median), sigma))))


def chat(rng: random.Random, total: int) -> list[dict[str, str]]:
    turns = 1 if rng.random() < 0.8 else rng.randint(2, 4)
    messages = []
    if rng.random() < 0.3:
        messages.append({"role": "system", "content": words(rng, rng.randint(10, 60))})
    for _ in range(turns):
        share = total / turns
        prompt = max(8, int(share * rng.uniform(0.15, 0.45)))
        messages.append({"role": "user", "content": words(rng, prompt)})
        messages.append({"role": "assistant", "content": words(rng, max(8, int(share) - prompt))})
    return messages


def write(directory: Path, chats: int, docs: int, pairs: int, seed: int = 0, max_chat: int = 8000) -> dict[str, Path]:
    rng = random.Random(seed)
    directory.mkdir(parents=True, exist_ok=True)
    paths = {name: directory / f"{name}.jsonl" for name in ("chats", "docs", "prefs")}
    with paths["chats"].open("w") as out:
        for _ in range(chats):
            out.write(json.dumps({"messages": chat(rng, log_normal(rng, 600, 0.85, 40, max_chat))}) + "\n")
    with paths["docs"].open("w") as out:
        for _ in range(docs):
            out.write(json.dumps({"text": words(rng, log_normal(rng, 3000, 1.0, 200, 60000))}) + "\n")
    with paths["prefs"].open("w") as out:
        for _ in range(pairs):
            prompt = log_normal(rng, 250, 0.7, 16, 900)
            answers = [log_normal(rng, 350, 0.7, 8, 1000) for _ in range(2)]
            question = [{"role": "user", "content": words(rng, prompt)}]
            out.write(json.dumps({"prompt": question,
                                  "chosen": [{"role": "assistant", "content": words(rng, answers[0])}],
                                  "rejected": [{"role": "assistant", "content": words(rng, answers[1])}]}) + "\n")
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path, nargs="?", default=None, help="where to write (default: a temporary folder)")
    parser.add_argument("--chats", type=int, default=3000)
    parser.add_argument("--docs", type=int, default=400)
    parser.add_argument("--pairs", type=int, default=1500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tiny", action="store_true", help="a few records of each (nox -s bench)")
    args = parser.parse_args()
    if args.tiny:
        args.chats, args.docs, args.pairs = 20, 4, 10
    import tempfile

    directory = args.directory or Path(tempfile.mkdtemp(prefix="userdata-"))
    for name, path in write(directory, args.chats, args.docs, args.pairs, args.seed).items():
        lines = path.read_text().splitlines()
        print(f"{name}: {path} ({len(lines)} records)")


if __name__ == "__main__":
    main()
