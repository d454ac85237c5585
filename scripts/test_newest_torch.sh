#!/usr/bin/env bash
# The package on the newest torch its range admits (setup.cfg), beside the constraints' pinned one: CI's second
# job. In a virtual environment of its own, kept across runs as a cache (a second run on the same machine installs
# only the package: torch and its CUDA libraries stay), it runs the fast tests and the demo end to end
# (fairseq-train -> fairseq-generate -> sacreBLEU).
#
#   bash scripts/test_newest_torch.sh            # torch = scripts/constraints.txt's "newest-torch" line
#   RFA_NEWEST_TORCH_VENV=DIR bash scripts/test_newest_torch.sh
#
# The venv defaults to ${XDG_CACHE_HOME:-~/.cache}/rfa-fairseq/venv-torch-<version>. On Linux x86-64 PyPI's torch is
# a CUDA build (about 3 GB with its CUDA libraries), which runs on the CPU as well.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
die() { echo "test_newest_torch.sh: error: $*" >&2; exit 1; }

CONSTRAINTS="$REPO/scripts/constraints.txt"
TORCH_VERSION="$(sed -n 's/^# newest-torch==\([0-9][0-9.]*\)$/\1/p' "$CONSTRAINTS")"
[[ -n "$TORCH_VERSION" ]] || die "$CONSTRAINTS has no '# newest-torch==X.Y.Z' line (the newest torch the range admits)"
VENV="${RFA_NEWEST_TORCH_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/rfa-fairseq/venv-torch-$TORCH_VERSION}"
mkdir -p "$(dirname "$VENV")" || die "cannot create $(dirname "$VENV")"

export RFA_VENV="$VENV" RFA_TORCH="$TORCH_VERSION" RFA_EXTRAS="test,bench"
echo "test_newest_torch.sh: torch $TORCH_VERSION in $VENV"
bash "$REPO/scripts/setup_env.sh" || die "could not set up $VENV with torch $TORCH_VERSION"
installed="$("$VENV/bin/python" -c 'import torch; print(torch.__version__.split("+")[0])')" ||
    die "torch does not import in $VENV"
[[ "$installed" == "$TORCH_VERSION" ]] || die "$VENV holds torch $installed, not $TORCH_VERSION"

echo "test_newest_torch.sh: the fast tests on torch $TORCH_VERSION"
bash "$REPO/scripts/run_tests.sh" -m "not slow" -q -p no:cacheprovider "$@" ||
    die "the fast tests failed on torch $TORCH_VERSION"

DEMO="$(mktemp -d "${TMPDIR:-/tmp}/rfa-newest-torch-demo.XXXXXX")" || die "cannot create a temporary directory"
trap 'rm -rf "$DEMO"' EXIT
echo "test_newest_torch.sh: train -> generate -> score on torch $TORCH_VERSION (scripts/run_demo.sh, in $DEMO)"
RFA_DEMO_DIR="$DEMO" bash "$REPO/scripts/run_demo.sh" || die "the demo failed on torch $TORCH_VERSION"
echo "test_newest_torch.sh: torch $TORCH_VERSION passed"
