#!/usr/bin/env bash
# bench/userpath.py on the lent GPU machine, in two parts that each fit one device call (10 minutes), and the
# toolkit-megatron test suite against the image's megatron-core (0.19.x, Python 3.12) on its CPUs beside part 1.
# Carry .whl (bash bench/wheels.sh; WITH_BNB=1 adds bitsandbytes for the qlora case):
#   bash bench/gpu_userpath.sh 1    # pt, sft packed/unpacked, HF and TRL SFT baselines, megatron dense and MoE + the megatron tests
#   bash bench/gpu_userpath.sh 2    # sft packed (longer limit), megatron dense and MoE, dpo beside TRL DPO, LoRA
#   bash bench/gpu_userpath.sh 3    # fsdp, deepspeed, rm, MoE local + the megatron tests
#   bash bench/gpu_userpath.sh 4    # export + infer, QLoRA, DoRA, isolated PT
#   bash bench/gpu_userpath.sh 5    # megatron under torchrun, megatron MoE, unpacked SFT without length grouping
#   bash bench/gpu_userpath.sh 7    # ~3 minutes: every toolkit case on tiny models on CUDA (6 at once) + the megatron tests
#   bash bench/gpu_userpath.sh 8    # Gemma 2 / Gemma 3 at scale, local and megatron, + the megatron tests (CPU) and the
#                                   # GPU-only FlexAttention test of the soft-capped, windowed attention
#   bash bench/gpu_userpath.sh 9    # LoRA on the Qwen3-MoE experts: local + toolkit-peft vs megatron's per-expert adapters
#   bash bench/gpu_userpath.sh 10   # the megatron tests (CPU) beside MoE LoRA with the default targets, local vs megatron
#   bash bench/gpu_userpath.sh 11   # the same with megatron's expert adapters grouped, + megatron MoE without LoRA
#   bash bench/gpu_userpath.sh 12   # Gemma 2 local: FlexAttention (soft cap) vs eager; Gemma 3; the GPU-only megatron tests
#   bash bench/gpu_userpath.sh 13   # the megatron tests (CPU) beside part 12's Gemma 2 flex vs eager and the GPU-only tests
#   bash bench/gpu_userpath.sh 6    # one call of ~8 minutes: every toolkit case on tiny models on CUDA (5 at once: does
#                                   # each run), then at scale dpo-pure, MoE (megatron, toolkit-moe), fsdp, deepspeed
set -uo pipefail
cd "$(dirname "$0")/.."
part=${1:?usage: bash bench/gpu_userpath.sh 1|2|3|4|5|final}
: "${OUT:=/tmp/gpu_userpath}"
mkdir -p "$OUT"
source bench/gpu_setup.sh
python3 -c "import megatron.core, trl, datasets; print('megatron-core', megatron.core.__version__, 'trl', trl.__version__, 'datasets', datasets.__version__)"
case "$part" in
  1)
    (CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=1 timeout 480 python3 -m pytest -q -x -p no:cacheprovider -n 8 plugins/toolkit-megatron/tests \
      > "$OUT/megatron-tests.log" 2>&1; echo "megatron tests: rc $?" >> "$OUT/megatron-tests.log") &
    tests=$!
    timeout 500 python3 bench/userpath.py --case-timeout 110 --cases pt,sft-pack,sft-nopack,hf-sft,trl-sft-bfd,trl-sft-padded,sft-megatron,moe-megatron
    wait $tests
    tail -5 "$OUT/megatron-tests.log"
    ;;
  2)
    timeout 520 python3 bench/userpath.py --case-timeout 170 --cases sft-pack,sft-megatron,dpo,trl-dpo,sft-lora,moe-megatron
    ;;
  final)
    (CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=1 timeout 300 python3 -m pytest -q -p no:cacheprovider -n 10 plugins/toolkit-megatron/tests \
      > "$OUT/megatron-tests.log" 2>&1; echo "megatron tests: rc $?" >> "$OUT/megatron-tests.log") &
    tests=$!
    timeout 300 python3 bench/userpath.py --case-timeout 130 --cases sft-megatron,dpo,moe-megatron
    wait $tests
    tail -5 "$OUT/megatron-tests.log"
    ;;
  3)
    (CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=1 timeout 420 python3 -m pytest -q -p no:cacheprovider -n 8 plugins/toolkit-megatron/tests \
      > "$OUT/megatron-tests.log" 2>&1; echo "megatron tests: rc $?" >> "$OUT/megatron-tests.log") &
    tests=$!
    timeout 540 python3 bench/userpath.py --case-timeout 125 --cases sft-fsdp,sft-deepspeed,rm,moe-sft
    wait $tests
    tail -5 "$OUT/megatron-tests.log"
    ;;
  4)
    timeout 560 python3 bench/userpath.py --case-timeout 135 --cases export-infer,sft-qlora,sft-dora,pt-isolated
    ;;
  7)
    (CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=1 timeout ${MEGATRON_TESTS_TIMEOUT:-170} python3 -m pytest -q -p no:cacheprovider -n 8 plugins/toolkit-megatron/tests \
      > "$OUT/megatron-tests.log" 2>&1; echo "megatron tests: rc $?" >> "$OUT/megatron-tests.log") &
    tests=$!
    tiny=sft-qlora,moe-megatron,sft-megatron-torchrun,sft-deepspeed,sft-fsdp,export-infer,moe-sft,sft-dora,rm,dpo-pure
    tiny=$tiny,pt-isolated,sft-megatron,sft-lora,dpo,pt,sft-pack,sft-nopack,sft-nopack-ungrouped
    timeout 160 python3 bench/userpath.py --tiny --jobs 6 --case-timeout 140 --work /tmp/up-tiny --cases "$tiny"
    wait $tests
    tail -5 "$OUT/megatron-tests.log"
    ;;
  6)
    (CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=1 timeout 420 python3 -m pytest -q -p no:cacheprovider -n 8 plugins/toolkit-megatron/tests \
      > "$OUT/megatron-tests.log" 2>&1; echo "megatron tests: rc $?" >> "$OUT/megatron-tests.log") &
    tests=$!
    (timeout 200 python3 bench/userpath.py --prepare-only > "$OUT/prepare.log" 2>&1) &
    prep=$!
    tiny=pt,pt-isolated,sft-pack,sft-nopack,sft-nopack-ungrouped,sft-lora,sft-dora,sft-qlora,sft-fsdp,sft-deepspeed
    tiny=$tiny,sft-megatron,sft-megatron-torchrun,dpo,dpo-pure,rm,moe-sft,moe-megatron,export-infer
    timeout 140 python3 bench/userpath.py --tiny --jobs 5 --case-timeout 120 --work /tmp/up-tiny --cases "$tiny"
    wait $prep; tail -2 "$OUT/prepare.log"
    timeout "${SCALE_LIMIT:-290}" python3 bench/userpath.py --steps 8 --case-timeout 105 \
      --cases dpo-pure,moe-megatron,moe-sft,sft-fsdp,sft-deepspeed,trl-dpo
    wait $tests
    tail -5 "$OUT/megatron-tests.log"
    ;;
  8)
    (CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=1 timeout 420 python3 -m pytest -q -p no:cacheprovider -n 10 plugins/toolkit-megatron/tests \
      > "$OUT/megatron-tests.log" 2>&1; echo "megatron tests: rc $?" >> "$OUT/megatron-tests.log") &
    tests=$!
    # the GPU-only tests (skipif without CUDA, so the CPU run above skips them)
    timeout 150 python3 -m pytest -q -p no:cacheprovider plugins/toolkit-megatron/tests/test_families.py -k gpu 2>&1 | tail -3
    timeout 400 python3 bench/userpath.py --steps 8 --case-timeout 95 --cases gemma2-sft,gemma2-megatron,gemma3-sft,gemma3-megatron
    wait $tests
    tail -5 "$OUT/megatron-tests.log"
    ;;
  9)
    timeout 500 python3 bench/userpath.py --steps 10 --case-timeout 150 --cases moe-lora,moe-megatron-lora,moe-megatron
    ;;
  11)
    # the megatron tests (CPU) beside MoE LoRA with the experts' adapters in the grouped GEMM (was the per-expert loop)
    (CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=1 timeout 420 python3 -m pytest -q -p no:cacheprovider -n 10 plugins/toolkit-megatron/tests \
      > "$OUT/megatron-tests.log" 2>&1; echo "megatron tests: rc $?" >> "$OUT/megatron-tests.log") &
    tests=$!
    timeout 440 python3 bench/userpath.py --steps 10 --case-timeout 140 --cases moe-megatron-lora,moe-lora,moe-megatron
    wait $tests
    tail -5 "$OUT/megatron-tests.log"
    ;;
  12)
    # Gemma 2 under local: soft-capped attention through FlexAttention (--local-packed-attention flex) against eager (auto)
    timeout 150 python3 -m pytest -q -p no:cacheprovider plugins/toolkit-megatron/tests/test_families.py -k gpu 2>&1 | tail -3
    timeout 420 python3 bench/userpath.py --steps 10 --warmup 4 --case-timeout 130 --cases gemma2-sft-flex,gemma2-sft,gemma3-sft
    ;;
  13)
    (CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=1 timeout 400 python3 -m pytest -q -p no:cacheprovider -n 10 plugins/toolkit-megatron/tests \
      > "$OUT/megatron-tests.log" 2>&1; echo "megatron tests: rc $?" >> "$OUT/megatron-tests.log") &
    tests=$!
    timeout 150 python3 -m pytest -q -p no:cacheprovider plugins/toolkit-megatron/tests/test_families.py -k gpu 2>&1 | tail -3
    timeout 300 python3 bench/userpath.py --steps 10 --warmup 4 --case-timeout 130 --cases gemma2-sft-flex,gemma2-sft
    wait $tests
    tail -5 "$OUT/megatron-tests.log"
    ;;
  10)
    (CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=1 timeout 420 python3 -m pytest -q -p no:cacheprovider -n 10 plugins/toolkit-megatron/tests \
      > "$OUT/megatron-tests.log" 2>&1; echo "megatron tests: rc $?" >> "$OUT/megatron-tests.log") &
    tests=$!
    timeout 400 python3 bench/userpath.py --steps 10 --case-timeout 150 --cases moe-lora,moe-megatron-lora
    wait $tests
    tail -5 "$OUT/megatron-tests.log"
    ;;
  5)
    timeout 560 python3 bench/userpath.py --case-timeout 170 --cases sft-megatron-torchrun,moe-megatron,sft-nopack-ungrouped
    ;;
esac
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
