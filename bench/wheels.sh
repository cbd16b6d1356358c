#!/usr/bin/env bash
# Fill .whl/ (git-ignored; carry it to the GPU machine, where bench/gpu_setup.sh installs it) with what the
# GPU image lacks for bench/fsdp_2gpu.py and the other multi-strategy benches. Run here, with registry access:
#   bash bench/wheels.sh            (PYTHON=... picks the interpreter whose pip is used; default .venv/bin/python)
# - megatron-core: a cp312 wheel from the registry.
# - deepspeed: published as an sdist only; built here into a pure-Python wheel with DS_BUILD_OPS=0 (no op
#   compiled; the toolkit's deepspeed engine steps torch's AdamW, fused on GPU, so ZeRO-3 needs no DeepSpeed op).
# - liger-kernel and torchao (pure-Python wheels) for bench/speed.py's liger and fp8 cases.
# - trl and datasets for bench/userpath.py (the TRL baselines; the toolkit reads data through datasets); peft 0.22.
# - deepspeed's imports that the image may lack (hjson, msgpack, einops, py-cpuinfo, pydantic and its pins),
#   as cp312 / pure-Python wheels in .whl/deps/: gpu_setup.sh installs each one only if it does not import.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
GPU_PLATFORM=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_24_x86_64)
mkdir -p .whl/deps
if ! ls .whl/megatron_core-*.whl >/dev/null 2>&1; then
  "$PY" -m pip download -q --no-deps "${GPU_PLATFORM[@]}" -d .whl 'megatron-core==0.19.2'
fi
if ! ls .whl/deepspeed-*.whl >/dev/null 2>&1; then
  DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation -w .whl 'deepspeed==0.19.8'
fi
# bench/speed.py's optional levers: liger-kernel (--local-kernels liger) and torchao (--local-fp8)
if ! ls .whl/liger_kernel-*.whl .whl/torchao-*.whl >/dev/null 2>&1; then
  "$PY" -m pip download -q --no-deps "${GPU_PLATFORM[@]}" -d .whl 'liger-kernel==0.8.5' 'torchao==0.18.0'
fi
# bench/userpath.py's baselines and the toolkit's reading layer: datasets (+ dill, multiprocess) and trl; peft at
# the release toolkit-peft requires (the image's may be older: 0.21 adapts other modules of MoE models)
if ! ls .whl/trl-*.whl .whl/datasets-*.whl .whl/peft-*.whl >/dev/null 2>&1; then
  "$PY" -m pip download -q --no-deps "${GPU_PLATFORM[@]}" -d .whl 'trl==1.16.0' 'datasets==5.2.0' 'peft==0.22.0'
fi
# bitsandbytes (--tuner qlora, --optimizer adamw-8bit) only when asked: its wheel is large (WITH_BNB=1 bash bench/wheels.sh)
if [ "${WITH_BNB:-0}" = 1 ] && ! ls .whl/bitsandbytes-*.whl >/dev/null 2>&1; then
  "$PY" -m pip download -q --no-deps "${GPU_PLATFORM[@]}" -d .whl 'bitsandbytes==0.50.2'
fi
# galore-torch (pure Python, a few KiB) for bench/optimizers.py's galore variant (bash bench/gpu_pending.sh optim)
"$PY" -m pip download -q "${GPU_PLATFORM[@]}" -d .whl/deps dill multiprocess hjson msgpack einops py-cpuinfo 'pydantic>=2'
# galore-torch with --no-deps: its own requirements (torch, transformers, bitsandbytes) are the image's or above
"$PY" -m pip download -q --no-deps "${GPU_PLATFORM[@]}" -d .whl/deps 'galore-torch==1.0'
ls -la .whl .whl/deps
