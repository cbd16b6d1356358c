#!/usr/bin/env bash
# Install the repository (no dependencies: the GPU image has torch/transformers/peft) on the lent GPU machine.
# Source it at the start of a device command: `source bench/gpu_setup.sh`.
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
# .whl/deps (bench/wheels.sh): dependencies of those wheels, each installed only when the image cannot import it
if ls .whl/deps/*.whl >/dev/null 2>&1; then
  missing=()
  for wheel in .whl/deps/*.whl; do
    module=$(basename "$wheel" | cut -d- -f1 | tr 'A-Z' 'a-z')
    [ "$module" = py_cpuinfo ] && module=cpuinfo
    PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} python3 -c "import $module" 2>/dev/null || missing+=("$wheel")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    echo "installing from .whl/deps: ${missing[*]##*/}"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site-deps "${missing[@]}" \
      && export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}/tmp/site-deps
  fi
fi
packages=(-e .)
for p in plugins/*/; do packages+=(-e "$p"); done
python3 -m pip install -q --no-deps --no-build-isolation "${packages[@]}" 2>&1 | grep -v -i warning | tail -3
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
