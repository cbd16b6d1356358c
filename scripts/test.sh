#!/usr/bin/env bash
# The test command of the README and of CI (.ci/run): installs the core and every plugin under
# plugins/ with their [test] extras (-c constraints.txt) into fresh venvs and runs every
# package's tests, through the `tests`-tagged nox sessions (noxfile.py discovers the plugins).
#   TOOLKIT_TEST_FAST=1 bash scripts/test.sh       skip tests marked slow
#   TOOLKIT_TEST_WORKERS=4 bash scripts/test.sh    pytest-xdist workers per suite (default: 2 for the shared
#                                                  session's suites, one process for the plugins' own sessions)
#   TOOLKIT_TEST_LANES=1 bash scripts/test.sh      suites one at a time (default 2 lanes: scripts/test_pool.py runs
#                                                  each suite in its own nox call, the costliest first, its output
#                                                  printed in one piece when it ends)
#   bash scripts/test.sh -k focal                  extra arguments go to pytest
# The wheels are built once (nox -s build); every session installs them (TOOLKIT_PREBUILT_WHEELS).
set -euo pipefail
cd "$(dirname "$0")/.."
# one intra-op thread per process: the lanes and the tests' own ranks already fill the cores, and torch's OpenMP
# threads spin while they wait for each other, so two per process on a busy 2-core machine more than doubled the CPU
# time of the same tests (test_engine + test_numerics: 170 against 77 CPU-s, 757 against 253 s, 2026-12-06)
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
python3 -m venv .venv-nox
# uv beside nox: the sessions create and fill their venvs with it (noxfile.py: several times faster than pip)
.venv-nox/bin/pip install -q -c constraints.txt "nox>=2024.4" "uv>=0.5"
nox=(.venv-nox/bin/nox --no-reuse-existing-virtualenvs)
"${nox[@]}" -s build
export TOOLKIT_PREBUILT_WHEELS=1
# every suite of every tests-tagged session in a pool of lanes, the costliest first (scripts/test_pool.py)
exec .venv-nox/bin/python scripts/test_pool.py -- "$@"
