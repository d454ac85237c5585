#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment with pinned dependencies.
#
#   bash scripts/setup_env.sh            # -> .venv next to this repo (RFA_VENV overrides)
#
# Idempotent: a stamp in the venv records a hash of setup.cfg and this script; when it
# matches, nothing is installed again. fairseq comes from `ve-fairseq==0.12.3`
# (binary wheels for cp311/cp312, works with torch 2.13) installed with --no-deps, so
# that its torchaudio requirement cannot replace our torch build; its real
# dependencies are pinned in setup.cfg.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${RFA_VENV:-$REPO/.venv}"
FAIRSEQ_PIN="ve-fairseq==0.12.3"
TORCH_PIN="torch==2.13.0"

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

stamp_value() {
    cat "$REPO/setup.cfg" "${BASH_SOURCE[0]}" | sha256sum | cut -d' ' -f1
}

STAMP="$VENV/.rfa-setup-stamp"
if [[ -x "$VENV/bin/python" && -f "$STAMP" && "$(cat "$STAMP")" == "$(stamp_value)" ]]; then
    echo "setup_env.sh: reusing $VENV"
    exit 0
fi

PY="$(pick_python)" || die "need Python 3.11 or 3.12 (set PYTHON=/path/to/python3.11); found none"
echo "setup_env.sh: creating/updating $VENV with $("$PY" --version)"
if [[ ! -x "$VENV/bin/python" ]]; then
    "$PY" -m venv "$VENV" || die "could not create a virtual environment at $VENV (is the venv module installed?)"
fi
rm -f "$STAMP"  # an interrupted install must not look finished
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)

# torch first and pinned: an unpinned torch would pull the CUDA build (several GB)
"${PIP[@]}" "$TORCH_PIN" || die "pip could not install $TORCH_PIN"
"${PIP[@]}" -e "$REPO[test,bench]" || die "pip could not install rfa-fairseq and its pinned dependencies (setup.cfg)"
"${PIP[@]}" --no-deps "$FAIRSEQ_PIN" || die "pip could not install $FAIRSEQ_PIN"

"$VENV/bin/python" - <<'EOF' || die "the environment does not import fairseq + rfa_fairseq"
import fairseq, torch, rfa_fairseq  # noqa: F401
from fairseq.models import ARCH_MODEL_REGISTRY
assert "rfa_transformer" in ARCH_MODEL_REGISTRY
print(f"setup_env.sh: fairseq {fairseq.__version__}, torch {torch.__version__}, rfa_fairseq {rfa_fairseq.__version__}")
EOF
# Build the fused C++ decoding step now (once; cached under TORCH_EXTENSIONS_DIR, default
# ~/.cache/torch_extensions) so the first fairseq-generate does not pause for it. Without a C++
# compiler decoding still works on the torch path (same results, slower): a warning, not an error.
if "$VENV/bin/python" -c 'import sys; from rfa_fairseq.ops import load_fused_extension; sys.exit(load_fused_extension() is None)'; then
    echo "setup_env.sh: fused C++ decoding step built"
else
    echo "setup_env.sh: warning: the fused C++ decoding step was not built (no C++ compiler?); decoding uses the slower torch path" >&2
fi
stamp_value >"$STAMP"
echo "setup_env.sh: ready: $VENV"
