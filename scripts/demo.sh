#!/usr/bin/env bash
# The main job on the embedded default, from a fresh machine: install, train, export, infer, score.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1
python3 -m venv .venv
.venv/bin/pip install -q -c constraints.txt -e .
.venv/bin/python examples/score_demo.py tiny-llama          # before training: ~0 correct
.venv/bin/toolkit sft --config examples/demo.yaml --overwrite
.venv/bin/toolkit infer runs/demo --prompt "What is the capital of Lopehes?"
.venv/bin/python examples/score_demo.py runs/demo/export    # after training
