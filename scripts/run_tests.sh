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
# The aarch64 checks (tests/test_cpu_levels.py's build, tests/test_aarch64_emulated.py's kernels run under qemu-user)
# need Debian's cross compiler and qemu-user: installed here where apt-get can (as root; RFA_NO_APT=1 skips it);
# elsewhere those tests skip, saying why.
missing=()
command -v aarch64-linux-gnu-g++ >/dev/null 2>&1 || missing+=(g++-aarch64-linux-gnu)
command -v qemu-aarch64 >/dev/null 2>&1 || command -v qemu-aarch64-static >/dev/null 2>&1 || missing+=(qemu-user)
if ((${#missing[@]})) && [[ -z "${RFA_NO_APT:-}" ]] && command -v apt-get >/dev/null 2>&1 && [[ $(id -u) -eq 0 ]]; then
    echo "run_tests.sh: installing ${missing[*]} (the aarch64 checks)" >&2
    if ! { apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null 2>&1 ||
        { apt-get update -q >/dev/null 2>&1 &&
            apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null 2>&1; }; }; then
        echo "run_tests.sh: warning: apt-get could not install ${missing[*]}: the aarch64 checks skip" >&2
    fi
fi
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
