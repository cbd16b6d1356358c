"""Score a model on the demo task: the share of made-up countries whose capital it names correctly.

    python examples/score_demo.py runs/demo/export      # after training
    python examples/score_demo.py tiny-llama            # the untrained preset, for comparison

It is one call of ``toolkit eval`` (the same as ``toolkit eval MODEL --dataset capitals-qa.jsonl --metric contains
--max-new-tokens 16``) on the demo's 48 capitals, written as question/answer records first.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import tempfile
from pathlib import Path

from toolkit.scoring import run_eval


def main(reference: str) -> float:
    spec = importlib.util.spec_from_file_location("make_assets", Path(__file__).resolve().parents[1] / "scripts" / "make_assets.py")
    assets = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(assets)
    with tempfile.TemporaryDirectory(prefix="score-demo-") as workdir:
        dataset = Path(workdir) / "capitals-qa.jsonl"
        dataset.write_text("".join(json.dumps({"question": f"What is the capital of {country}?", "answer": city}) + "\n"
                                   for country, city in assets.capitals()))
        summary = run_eval(reference, str(dataset), ["contains"], output=workdir, max_new_tokens=16, batch_size=16)
        first = json.loads((Path(workdir) / "predictions.jsonl").read_text().splitlines()[0])
    correct = summary["matches"]["contains"]
    print(f"example: {first['prompt']!r} -> {first['prediction']!r}")
    print(f"demo accuracy: {correct}/{summary['count']} capitals named correctly")
    return correct / summary["count"]


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "runs/demo/export")
