#!/usr/bin/env bash
# Everything built but not yet measured on a GPU (docs/benchmarks.md, "Built, not yet measured"), split into
# parts that each fit one device call (10 minutes) and share one warm machine. Run from the repository root
# on the lent machine, carrying .whl (bash bench/wheels.sh fills it). In order of what the open issues need:
#
#   bash bench/gpu_pending.sh speed      # nvidia-h200, ~8 min: local defaults (full, LoRA), pure bf16, and compiled
#                                        #   bf16 (master and pure) beside HF: issue 12's 1.3x
#   bash bench/gpu_pending.sh megatron   # nvidia-h200, ~6 min: megatron speed-default/-unfused/-compiled vs HF, packed rows
#   bash bench/gpu_pending.sh moe        # nvidia-h200, ~9 min: MoE: hf vs toolkit-moe (pure bf16, blocks+logps); hf vs
#                                        #   megatron grouped / sequential experts
#   bash bench/gpu_pending.sh x2         # nvidia-h200-x2, ~9 min: MoE EP2 (toolkit-moe, megatron), 2-GPU layouts
#   bash bench/gpu_pending.sh optim      # nvidia-h100-x1 or h200, ~5 min: optimizer state and peak memory of adamw-8bit,
#                                        #   adafactor, galore (rank 512), lisa against AdamW on the 1.24B Llama
#                                        #   (issue 28; .whl from WITH_BNB=1 bash bench/wheels.sh for adamw-8bit)
#
# Each command runs its baseline in the same script and has its own time limit, so one slow case cannot eat
# the part; every JSON lands in $OUT (bench/results/ is where they are kept, renamed <kind>-<gpu>-<date>.json).
set -uo pipefail
cd "$(dirname "$0")/.."
part=${1:?usage: bash bench/gpu_pending.sh speed|megatron|moe|x2|optim}
: "${OUT:=/tmp/gpu_pending}"
mkdir -p "$OUT"
source bench/gpu_setup.sh

run() {  # run LIMIT NAME COMMAND...: one measurement, its log in $OUT/NAME.log, its JSON moved to $OUT/NAME.json
  local limit=$1 name=$2
  shift 2
  echo "=== $name ($(date -u +%H:%M:%S), limit ${limit}s): $*"
  local scratch="$OUT/.$name"
  mkdir -p "$scratch"
  OUT="$scratch" timeout --signal=INT --kill-after=20 "$limit" "$@" 2>&1 | tee "$OUT/$name.log" | tail -25
  echo "=== $name: rc ${PIPESTATUS[0]}"
  for json in "$scratch"/*.json; do [ -e "$json" ] && mv "$json" "$OUT/$name-$(basename "$json")"; done
  rm -rf "$scratch"
}

case "$part" in
  speed)
    run 200 defaults python3 bench/speed.py --group defaults --timeout 100
    run 360 compiled python3 bench/speed.py --cases 'hf,local+kernels+fused+compile,local pure+compile' --timeout 100 --long-steps 15 --no-check
    ;;
  megatron)
    run 170 megatron python3 bench/scaling.py --gpus 1 --shapes 1b --serial --cases '1b/speed-default,1b/speed-unfused,1b/speed-compiled,1b/hf' --case-timeout 120
    run 170 packed python3 bench/speed.py --group packed --timeout 80
    ;;
  moe)
    run 280 moe-local python3 bench/moe.py --cases hf,toolkit-pure,blocks+logps --timeout 120
    run 280 moe-megatron python3 bench/moe.py --cases hf,megatron,megatron-seq --timeout 120
    ;;
  x2)
    run 240 moe-ep2 python3 bench/moe.py --cases hf,toolkit-ep2,megatron-ep2 --timeout 100
    run 300 scaling-2gpu python3 bench/scaling.py --gpus 2 --no-speed --budget 240 --case-timeout 100
    ;;
  optim)
    run 420 optimizers python3 bench/optimizers.py
    ;;
  *)
    echo "unknown part '$part': use speed, megatron, moe, x2 or optim" >&2
    exit 2
    ;;
esac
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
