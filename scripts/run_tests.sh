#!/usr/bin/env bash
# Set up (or reuse) .venv and run the test suite. Extra arguments go to pytest.
#   bash scripts/run_tests.sh            # everything, slow end-to-end tests included
#   bash scripts/run_tests.sh -m "not slow"
#   RFA_TEST_WORKERS=1 bash scripts/run_tests.sh -x    # one process (pdb, -x stops at once)
# The tests run in RFA_TEST_WORKERS processes (default: one per core; pytest-xdist), each test file in
# one of them (its module fixtures, e.g. trained tiny models, are built once), one thread each, the heaviest files
# first (tests/conftest.py).
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$REPO/scripts/setup_env.sh"
cd "$REPO"
# PYTHON picked the interpreter that creates .venv; the project's scripts (train.sh, generate.sh, score.sh) read it as
# the interpreter to run, which in the tests is the environment's own (first on their PATH)
unset PYTHON
WORKERS="${RFA_TEST_WORKERS:-$(nproc 2>/dev/null || echo 1)}"
[[ $WORKERS =~ ^[0-9]+$ && $WORKERS -ge 1 ]] || { echo "run_tests.sh: RFA_TEST_WORKERS must be a positive integer, got '$WORKERS'" >&2; exit 2; }
if ((WORKERS > 1)); then
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"  # one thread per worker: the workers fill the cores
    exec "${RFA_VENV:-$REPO/.venv}/bin/python" -m pytest -n "$WORKERS" --dist loadfile --no-loadscope-reorder "$@"
fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"
exec "${RFA_VENV:-$REPO/.venv}/bin/python" -m pytest "$@"
