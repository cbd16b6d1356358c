"""Score a model on the demo task: the share of made-up countries whose capital it names correctly.

    python examples/score_demo.py runs/demo/export      # after training
    python examples/score_demo.py tiny-llama            # the untrained preset, for comparison
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from toolkit.builtins.inference import GenerateConfig, HFBackend
from toolkit.inference import model_directory


def main(reference: str) -> float:
    spec = importlib.util.spec_from_file_location("make_assets", Path(__file__).resolve().parents[1] / "scripts" / "make_assets.py")
    assets = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(assets)
    pairs = assets.capitals()
    prompts = [f"What is the capital of {country}?" for country, _ in pairs]
    directory = model_directory(reference, Path("/tmp"))
    answers = HFBackend().generate(directory, prompts, GenerateConfig(max_new_tokens=16))
    correct = sum(city in answer for (_, city), answer in zip(pairs, answers))
    print(f"example: {prompts[0]!r} -> {answers[0]!r}")
    print(f"demo accuracy: {correct}/{len(pairs)} capitals named correctly")
    return correct / len(pairs)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "runs/demo/export")
