"""Regenerate the bundled assets: the demo datasets and the tiny tokenizer (offline, deterministic).

Run: python scripts/make_assets.py  (outputs under core/toolkit/assets/)
"""

from __future__ import annotations

import json
import random
from pathlib import Path

ASSETS = Path(__file__).resolve().parents[1] / "core" / "toolkit" / "assets"
SYLLABLES = ["ka", "lo", "mi", "ze", "ru", "ta", "no", "vi", "sha", "pe", "qu", "dor", "fen", "gal", "hes", "jin"]


def word(rng: random.Random, parts: int) -> str:
    return "".join(rng.choice(SYLLABLES) for _ in range(parts)).capitalize()


def capitals(seed: int = 7, count: int = 48) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    seen, pairs = set(), []
    while len(pairs) < count:
        country, city = word(rng, 3), word(rng, 2)
        if country not in seen:
            seen.add(country)
            pairs.append((country, city))
    return pairs


def demo_records() -> list[dict]:
    """A scorable synthetic task: made-up countries and their capitals, as chat messages."""
    questions = ["What is the capital of {c}?", "Name the capital city of {c}.", "Which city is the capital of {c}?"]
    records = []
    for country, city in capitals():
        for k, q in enumerate(questions):
            system = [{"role": "system", "content": "You answer geography questions in one sentence."}] if k == 1 else []
            records.append({"messages": system + [
                {"role": "user", "content": q.format(c=country)},
                {"role": "assistant", "content": f"The capital of {country} is {city}."},
            ]})
    random.Random(0).shuffle(records)
    return records


def demo_text() -> list[dict]:
    return [{"text": f"{city} is the capital of {country}. People in {country} travel to {city} for the markets."}
            for country, city in capitals()]


def train_tokenizer(texts: list[str]) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1024, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    out = ASSETS / "tokenizer"
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    chatml = (
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|im_end|>",
        "pad_token": "<|pad|>", "unk_token": None, "model_max_length": 4096, "chat_template": chatml,
        "clean_up_tokenization_spaces": False,
    }, indent=2) + "\n")


def corpus() -> list[str]:
    generic = [
        "The quick brown fox jumps over the lazy dog. Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000.",
        "def main():\n    print('hello world')\n    return 0\n",
        "Question: what is two plus two? Answer: four. Yes, no, maybe; good, bad, better.",
        "user assistant system You answer questions in one sentence. The capital city of the country is",
        "chosen rejected prompt completion instruction input output text messages role content",
    ]
    texts = generic * 20
    for r in demo_records():
        texts.extend(m["content"] for m in r["messages"])
    texts.extend(r["text"] for r in demo_text())
    return texts


def write_jsonl(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


if __name__ == "__main__":
    datasets = ASSETS / "datasets"
    datasets.mkdir(parents=True, exist_ok=True)
    write_jsonl(datasets / "demo.jsonl", demo_records())
    write_jsonl(datasets / "demo-text.jsonl", demo_text())
    train_tokenizer(corpus())
    print("assets written to", ASSETS)
