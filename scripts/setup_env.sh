#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment with pinned dependencies.
#
#   bash scripts/setup_env.sh                 # -> .venv next to this repo (RFA_VENV overrides)
#   bash scripts/setup_env.sh --print-stamp   # print the stamp of the current files and exit
#
# Idempotent: a stamp in the venv records a hash of what the install depends on (scripts/constraints.txt,
# setup.cfg, setup.py, pyproject.toml, this script, the C++ sources and rfa_fairseq/cpu/extension.py,
# which sets their compiler flags); when it matches, nothing is installed again, and a changed kernel
# is rebuilt on the next run. Every pip install runs with -c scripts/constraints.txt: the exact versions the
# project is tested with (setup.cfg states the ranges the package accepts). The package is installed
# with --no-build-isolation, so that setup.py sees the pinned torch and compiles the fused C++ kernels
# ahead of time (an isolated build would pull an unpinned torch); without a C++ compiler it installs
# without them (a warning). fairseq comes from `ve-fairseq` (binary wheels for cp311/cp312) installed
# with --no-deps, so that its torchaudio requirement cannot replace our torch build; its real
# dependencies are in setup.cfg. RFA_EXTRAS (default "test,bench") names the extras installed;
# RFA_TORCH=X.Y.Z installs that torch
# instead of the constraints' one (every other pin kept), into a venv of its own (RFA_VENV); it comes from PyPI
# (on Linux x86-64 a CUDA build, which also runs on the CPU). RFA_CONSTRAINTS=FILE installs with FILE instead of
# scripts/constraints.txt: CI's second job (scripts/test_newest_torch.sh) passes the newest releases setup.cfg's
# ranges admit; FILE's contents enter the stamp. With either, PIP_CONSTRAINT is emptied for the installs: some
# machines' global pip configuration caps torch below the releases the package supports.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${RFA_VENV:-$REPO/.venv}"
CONSTRAINTS="${RFA_CONSTRAINTS:-$REPO/scripts/constraints.txt}"
EXTRAS="${RFA_EXTRAS:-test,bench}"
TORCH_VERSION="${RFA_TORCH:-}"

die() { echo "setup_env.sh: error: $*" >&2; exit 1; }

pick_python() {
    local candidate
    for candidate in ${PYTHON:-} python3.11 python3.12 python3; do
        if command -v "$candidate" >/dev/null 2>&1 &&
            "$candidate" -c 'import sys; sys.exit(0 if sys.version_info[:2] in ((3, 11), (3, 12)) else 1)' 2>/dev/null; then
            echo "$candidate"
            return 0
        fi
    done
    return 1
}

# what the install depends on, relative to $REPO: names and contents enter the stamp
stamp_files() {
    (cd "$REPO" && printf '%s\n' scripts/constraints.txt setup.cfg setup.py pyproject.toml scripts/setup_env.sh \
        rfa_fairseq/cpu/extension.py && find rfa_fairseq/cpu/csrc -type f \( -name '*.cpp' -o -name '*.h' \) | LC_ALL=C sort)
}

stamp_value() {
    local file
    stamp_files | while IFS= read -r file; do
        printf '%s\0' "$file"
        cat "$REPO/$file"
    done | sha256sum | cut -d' ' -f1
}

[[ -f "$CONSTRAINTS" ]] || die "missing $CONSTRAINTS (the exact versions to install${RFA_CONSTRAINTS:+, RFA_CONSTRAINTS})"
RFA_CONSTRAINTS_SET="${RFA_CONSTRAINTS:+yes}"
[[ "$EXTRAS" =~ ^[a-z,]*$ ]] || die "RFA_EXTRAS must be a comma-separated list of extras (test, bench), got '$EXTRAS'"
[[ -z "$TORCH_VERSION" || "$TORCH_VERSION" =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]] ||
    die "RFA_TORCH must be a torch release such as 2.15.0, got '$TORCH_VERSION'"
# the checkout's path enters the stamp: an editable install points at it, and a venv kept elsewhere (CI's cache)
# must install the package again for another checkout
CURRENT_STAMP="$( (stamp_value; echo "extras=$EXTRAS"; echo "torch=$TORCH_VERSION"; echo "repo=$REPO"
    [[ -z "${RFA_CONSTRAINTS:-}" ]] || { echo "constraints="; cat "$CONSTRAINTS"; }) |
    sha256sum | cut -d' ' -f1)" || die "cannot read the files the stamp covers (see above)"
case "${1:-}" in
    "") ;;
    --print-stamp) echo "$CURRENT_STAMP"; exit 0 ;;
    *) die "unknown argument '$1' (usage: bash scripts/setup_env.sh [--print-stamp])" ;;
esac

# 0 when the source tree's prebuilt C++ module is this environment's, 1 when another environment (another torch)
# built it there last (an editable install compiles it into the tree), 2 when none was built
prebuilt_state() {
    "$VENV/bin/python" - "$REPO" <<'EOF'
import importlib.util, os, sys
spec = importlib.util.spec_from_file_location("rfa_extension", os.path.join(sys.argv[1], "rfa_fairseq/cpu/extension.py"))
extension = importlib.util.module_from_spec(spec)
spec.loader.exec_module(extension)
module, why_not = extension.import_prebuilt()
sys.exit(0 if module is not None else 2 if why_not.endswith("not built at install time") else 1)
EOF
}

STAMP="$VENV/.rfa-setup-stamp"
if [[ -x "$VENV/bin/python" && -f "$STAMP" && "$(cat "$STAMP")" == "$CURRENT_STAMP" ]]; then
    set +e
    prebuilt_state
    state=$?
    set -e
    if [[ $state -eq 1 ]]; then
        echo "setup_env.sh: the source tree's C++ decoding step was built for another environment: rebuilding it for $VENV"
        [[ -z "$TORCH_VERSION$RFA_CONSTRAINTS_SET" ]] || export PIP_CONSTRAINT=/dev/null
        "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e "$REPO" ||
            die "pip could not rebuild rfa-fairseq's C++ decoding step in $VENV"
    fi
    echo "setup_env.sh: reusing $VENV"
    exit 0
fi

PY="$(pick_python)" || die "need Python 3.11 or 3.12 (set PYTHON=/path/to/python3.11); found none"
echo "setup_env.sh: creating/updating $VENV with $("$PY" --version)"
if [[ ! -x "$VENV/bin/python" ]]; then
    "$PY" -m venv "$VENV" || die "could not create a virtual environment at $VENV (is the venv module installed?)"
fi
rm -f "$STAMP"  # an interrupted install must not look finished
if [[ -n "$TORCH_VERSION" ]]; then
    # the constraints with their torch pin replaced (and no triton pin: torch's CUDA builds require their own)
    grep -q '^torch==' "$CONSTRAINTS" || die "$CONSTRAINTS pins no torch (a line torch==X.Y.Z) for RFA_TORCH to replace"
    sed -e "s/^torch==.*/torch==$TORCH_VERSION/" -e "/^triton==/d" "$CONSTRAINTS" >"$VENV/constraints-torch-$TORCH_VERSION.txt" ||
        die "could not write $VENV/constraints-torch-$TORCH_VERSION.txt"
    CONSTRAINTS="$VENV/constraints-torch-$TORCH_VERSION.txt"
fi
if [[ -n "$TORCH_VERSION$RFA_CONSTRAINTS_SET" ]]; then
    export PIP_CONSTRAINT=/dev/null  # a machine-wide cap on torch must not refuse the release asked for
fi
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -c "$CONSTRAINTS")

# torch first and pinned: an unpinned torch would pull the CUDA build (several GB)
"${PIP[@]}" torch || die "pip could not install torch (pinned in $CONSTRAINTS)"
# the build backend, in the venv itself (--no-build-isolation); Python 3.12 venvs have no setuptools
"${PIP[@]}" setuptools wheel || die "pip could not install setuptools and wheel (pinned in $CONSTRAINTS)"
# --no-build-isolation: setup.py builds the C++ kernels with this venv's torch
"${PIP[@]}" --no-build-isolation -e "$REPO${EXTRAS:+[$EXTRAS]}" ||
    die "pip could not install rfa-fairseq${EXTRAS:+[$EXTRAS]} and its dependencies (setup.cfg, $CONSTRAINTS)"
"${PIP[@]}" --no-deps ve-fairseq || die "pip could not install ve-fairseq --no-deps (pinned in $CONSTRAINTS)"

"$VENV/bin/python" - <<'EOF' || die "the environment does not import fairseq + rfa_fairseq"
import platform
import fairseq, numpy, torch, rfa_fairseq  # noqa: F401
from fairseq.models import ARCH_MODEL_REGISTRY
assert "rfa_transformer" in ARCH_MODEL_REGISTRY
print(f"setup_env.sh: Python {platform.python_version()}, fairseq {fairseq.__version__}, torch {torch.__version__}, "
      f"numpy {numpy.__version__}, rfa_fairseq {rfa_fairseq.__version__}")
EOF
# setup.py built the fused C++ kernels unless it could not (no compiler): say which, so that a slow
# first decoding step (a JIT build) or the slower torch path is no surprise
"$VENV/bin/python" - <<'EOF' || die "the environment does not import rfa_fairseq.cpu.extension"
import sys
from rfa_fairseq.cpu import extension
module, why_not = extension.import_prebuilt()
if module is None:
    print(f"setup_env.sh: warning: the fused C++ decoding step was not built at install time ({why_not}); "
          "the first decoding step builds it just in time where a C++ compiler exists, else decoding uses "
          "the slower torch path", file=sys.stderr)
else:
    print(f"setup_env.sh: fused C++ decoding step built: {module.__file__}")
EOF
echo "$CURRENT_STAMP" >"$STAMP"
echo "setup_env.sh: ready: $VENV"
