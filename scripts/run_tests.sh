#!/usr/bin/env bash
# Set up (or reuse) .venv and run the test suite. Extra arguments go to pytest.
#   bash scripts/run_tests.sh            # everything, slow end-to-end tests included
#   bash scripts/run_tests.sh -m "not slow"
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$REPO/scripts/setup_env.sh"
cd "$REPO"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"
exec "${RFA_VENV:-$REPO/.venv}/bin/python" -m pytest "$@"
