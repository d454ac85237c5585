#!/usr/bin/env bash
# One decoding step of a tiny model through the native runtime on aarch64, compared with this machine's (issue 73):
# a CI step of .ci/run beside the suite (the suite runs the NEON kernels themselves under qemu-user:
# tests/test_aarch64_emulated.py). On an x86-64 machine it sets up the emulated aarch64 environment
# (scripts/setup_aarch64_emulation.sh: Debian's arm64 Python, PyPI's aarch64 torch, fairseq and the C++ module built
# for aarch64; cached), decodes with fresh weights here (tests/aarch64_native_step.py --write), then the same weights
# on aarch64 under qemu-user with an ARMv8 CPU that has the dot-product extension (-cpu max: the neon_dotprod level),
# and compares.
#
#   bash scripts/test_aarch64_native_step.sh
#
# Exit status: 0 when the steps agree (or, saying why, where no emulation can be had: not x86-64, no apt-get / root
# to install qemu-user and the cross compiler, RFA_NO_APT set; RFA_REQUIRE_AARCH64=1 makes that a failure), non-zero
# with the reason otherwise.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
die() { echo "test_aarch64_native_step.sh: error: $*" >&2; exit 1; }
say() { echo "test_aarch64_native_step.sh: $*"; }
skip() {
    [[ -z "${RFA_REQUIRE_AARCH64:-}" ]] || die "no aarch64 emulation here ($*), and RFA_REQUIRE_AARCH64 is set"
    say "skipped: $*"
    exit 0
}
UNAVAILABLE=3  # setup_aarch64_emulation.sh's status where the tools are missing and cannot be installed

[[ "$(uname -m)" == x86_64 ]] || skip "the emulated run is made from an x86-64 machine; this one is $(uname -m)"
HOST_PYTHON="${RFA_VENV:-$REPO/.venv}/bin/python"
[[ -x "$HOST_PYTHON" ]] || die "no $HOST_PYTHON: run bash scripts/setup_env.sh first"

start=$SECONDS
set +e
setup_out="$(bash "$REPO/scripts/setup_aarch64_emulation.sh")"
status=$?
set -e
echo "$setup_out"
[[ $status -ne $UNAVAILABLE ]] || skip "setup_aarch64_emulation.sh found no emulation (its message above)"
[[ $status -eq 0 ]] || die "scripts/setup_aarch64_emulation.sh failed (exit $status)"
ENV_DIR="$(sed -n 's/^setup_aarch64_emulation.sh: ready: //p' <<<"$setup_out" | tail -n 1)"
[[ -d "$ENV_DIR/checkout" ]] || die "setup_aarch64_emulation.sh named no environment directory (its last line: ready: DIR)"
say "aarch64 environment ready in $((SECONDS - start)) s: $ENV_DIR"

WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
REFERENCE="$WORK/x86_64_step.pt"
(cd "$REPO" && OMP_NUM_THREADS=1 RFA_CACHE_DIR="$WORK/cache" "$HOST_PYTHON" tests/aarch64_native_step.py \
    --write "$REFERENCE") || die "the x86-64 step failed"

start=$SECONDS
(cd "$ENV_DIR/checkout" && OMP_NUM_THREADS=1 RFA_CACHE_DIR="$WORK/cache_aarch64" "$ENV_DIR/python" \
    tests/aarch64_native_step.py --compare "$REFERENCE") ||
    die "the aarch64 step differs from x86-64's or did not run (its output above)"
say "aarch64 (emulated) native step equals x86-64's: compared in $((SECONDS - start)) s"
