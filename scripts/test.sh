#!/usr/bin/env bash
# The test command of the README and of CI (.ci/run): installs the core and every plugin under
# plugins/ with their [test] extras (-c constraints.txt) into fresh venvs and runs every
# package's tests, through the `tests`-tagged nox sessions (noxfile.py discovers the plugins).
#   TOOLKIT_TEST_FAST=1 bash scripts/test.sh     skip tests marked slow
#   TOOLKIT_TEST_WORKERS=4 bash scripts/test.sh  4 pytest-xdist workers per suite (many-core CI machines)
#   bash scripts/test.sh -k focal                extra arguments go to pytest
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"
python3 -m venv .venv-nox
.venv-nox/bin/pip install -q -c constraints.txt "nox>=2024.4"
exec .venv-nox/bin/nox --no-reuse-existing-virtualenvs -t tests -- "$@"
