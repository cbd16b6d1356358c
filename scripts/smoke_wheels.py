"""Smoke test of an installed (not editable) toolkit: run by ``nox -s wheels`` in a fresh venv
holding only the wheels of ``nox -s build``, from a directory outside the repository.

    python scripts/smoke_wheels.py toolkit-core toolkit-peft ...   (the distributions installed)

Checks that ``toolkit`` is imported from site-packages (not the source tree), that every named
distribution is installed and each of its plugins loads without error, and that a two-step SFT
run on the bundled demo data writes metrics and a Hugging Face export that ``toolkit infer`` reads.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import sysconfig
import tempfile
from importlib import metadata
from pathlib import Path


def toolkit(*args: str) -> str:
    result = subprocess.run([sys.executable, "-m", "toolkit", *args], capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"toolkit {' '.join(args)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
    return result.stdout


def check_installed(distributions: list[str]) -> None:
    import toolkit as package

    location = Path(package.__file__).resolve()
    site_packages = Path(sysconfig.get_paths()["purelib"]).resolve()
    if site_packages not in location.parents:
        raise SystemExit(f"toolkit was imported from {location}, not from the installed wheel in {site_packages}")
    for name in distributions:
        dist = metadata.distribution(name)
        if dist.read_text("direct_url.json") and '"editable": true' in dist.read_text("direct_url.json"):
            raise SystemExit(f"{name} is an editable install; the smoke test needs the wheel")
    rows = json.loads(toolkit("plugins", "--json"))
    broken = [f"{row['name']} ({row['distribution']}): {row['error']}" for row in rows if row["error"]]
    missing = sorted(set(distributions) - {row["distribution"] for row in rows})
    if broken or missing:
        raise SystemExit(f"plugins that failed to load: {broken or 'none'}; distributions with no loaded plugin: {missing or 'none'}")
    print(f"installed from wheels: {', '.join(distributions)}; {len(rows)} plugins load")


def check_training() -> None:
    run = Path(tempfile.mkdtemp(prefix="toolkit-smoke-")) / "run"
    toolkit("sft", "--model", "tiny-llama", "--dataset", "demo", "--max-steps", "2", "--log-every", "1",
            "--output", str(run), "--export", "hf")
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    losses = [row["loss"] for row in steps if "loss" in row]
    if len(losses) != 2 or not all(math.isfinite(loss) for loss in losses):
        raise SystemExit(f"expected two finite losses in {run / 'metrics.jsonl'}, got {losses}")
    completion = toolkit("infer", str(run), "--prompt", "What is the capital of Lopehes?", "--max-new-tokens", "4")
    print(f"two SFT steps (losses {losses[0]:.3f}, {losses[1]:.3f}), exported and generated: {(completion.strip().splitlines() or [''])[-1]!r}")


if __name__ == "__main__":
    check_installed(sys.argv[1:] or ["toolkit-core"])
    check_training()
