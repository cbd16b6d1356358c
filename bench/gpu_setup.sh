#!/usr/bin/env bash
# Install the repository (no dependencies: the GPU image has torch/transformers/peft) on the lent GPU machine.
# Source it at the start of a device command: `source bench/gpu_setup.sh`.
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
packages=(-e .)
for p in plugins/*/; do packages+=(-e "$p"); done
python3 -m pip install -q --no-deps --no-build-isolation "${packages[@]}" 2>&1 | grep -v -i warning | tail -3
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
