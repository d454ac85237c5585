#!/usr/bin/env bash
# CI's second job: the package on the newest release of every dependency its ranges admit (setup.cfg), beside the
# pinned versions of the first. scripts/constraints.txt's "newest-torch" line pins torch, and its ve-fairseq line
# fairseq; pip's resolver picks everything else, each time, as a user's `pip install` into a fresh environment
# would, so a range whose newest release fails turns CI red. On Python 3.12 where one is found (numpy 2.5 and
# later need it), else on Python 3.11, saying so. In a virtual environment of its own, kept across runs as a cache
# (a run whose resolved versions are those of the last installs nothing), it runs the fast tests and the demo end
# to end (fairseq-train -> fairseq-generate -> sacreBLEU), after printing the versions it runs on.
#
#   bash scripts/test_newest_torch.sh            # extra arguments go to pytest
#   RFA_NEWEST_PYTHON=/path/to/python3.12 bash scripts/test_newest_torch.sh
#   RFA_NEWEST_TORCH_VENV=DIR bash scripts/test_newest_torch.sh
#
# Python 3.12 is looked for as RFA_NEWEST_PYTHON, python3.12 on PATH, pyenv's versions, /usr/local/bin and
# /usr/bin. The venv defaults to ${XDG_CACHE_HOME:-~/.cache}/rfa-fairseq/venv-newest-py3.<minor>. On Linux x86-64
# PyPI's torch is a CUDA build (about 3 GB with its CUDA libraries), which runs on the CPU as well.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
die() { echo "test_newest_torch.sh: error: $*" >&2; exit 1; }
say() { echo "test_newest_torch.sh: $*"; }

CONSTRAINTS="$REPO/scripts/constraints.txt"
TORCH_VERSION="$(sed -n 's/^# newest-torch==\([0-9][0-9.]*\)$/\1/p' "$CONSTRAINTS")"
[[ -n "$TORCH_VERSION" ]] || die "$CONSTRAINTS has no '# newest-torch==X.Y.Z' line (the newest torch the range admits)"
FAIRSEQ_PIN="$(grep -m1 '^ve-fairseq==' "$CONSTRAINTS")" || die "$CONSTRAINTS has no 've-fairseq==X.Y.Z' line"

# 0 when $1 is a Python 3.$2 with the venv module and pip's bootstrap (Debian ships them apart)
is_python() {
    "$1" -c 'import sys, venv, ensurepip; sys.exit(0 if sys.version_info[:2] == (3, int(sys.argv[1])) else 1)' "$2" \
        >/dev/null 2>&1
}

find_python() {
    local minor="$1" pyenv_root candidate
    pyenv_root="$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")"
    # a pyenv shim on PATH can exist and refuse to run (a version not selected): every candidate is run once
    for candidate in "python3.$minor" "$pyenv_root"/versions/3."$minor".*/bin/python3."$minor" \
        /usr/local/bin/python3."$minor" /usr/bin/python3."$minor"; do
        if is_python "$candidate" "$minor"; then
            command -v "$candidate"
            return 0
        fi
    done
    return 1
}

if [[ -n "${RFA_NEWEST_PYTHON:-}" ]]; then
    PY="$RFA_NEWEST_PYTHON"
    is_python "$PY" 12 || is_python "$PY" 11 ||
        die "RFA_NEWEST_PYTHON=$PY is not a Python 3.11 or 3.12 with the venv module"
elif PY="$(find_python 12)"; then
    :
elif PY="$(find_python 11)"; then
    say "no Python 3.12 found (python3.12 on PATH, pyenv's versions, /usr/local/bin, /usr/bin): running on" \
        "Python 3.11 ($PY), where releases that need Python 3.12 (numpy 2.5 and later) cannot be tried"
else
    die "need Python 3.12 (or 3.11) with the venv module; found neither (RFA_NEWEST_PYTHON=/path/to/python3.12)"
fi
PY_VERSION="$("$PY" -c 'import platform; print(platform.python_version())')"
PY_MINOR="${PY_VERSION%.*}"

VENV="${RFA_NEWEST_TORCH_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/rfa-fairseq/venv-newest-py$PY_MINOR}"
mkdir -p "$(dirname "$VENV")" || die "cannot create $(dirname "$VENV")"
if [[ -x "$VENV/bin/python" ]]; then
    venv_version="$("$VENV/bin/python" -c 'import platform; print(platform.python_version())')" ||
        die "$VENV/bin/python does not run: remove $VENV"
    [[ "${venv_version%.*}" == "$PY_MINOR" ]] ||
        die "$VENV holds Python $venv_version, not $PY_MINOR: remove it or set RFA_NEWEST_TORCH_VENV"
else
    say "creating $VENV with Python $PY_VERSION ($PY)"
    "$PY" -m venv "$VENV" || die "could not create a virtual environment at $VENV"
fi

# What pip installs today into a fresh environment: the package with its extras test and bench, and the build
# backend, with torch and fairseq pinned. --ignore-installed: the cached venv's versions play no part.
REQUEST="$VENV/constraints-newest-request.txt"
RESOLVED="$VENV/constraints-newest.txt"
REPORT="$VENV/newest-report.json"
printf 'torch==%s\n%s\n' "$TORCH_VERSION" "$FAIRSEQ_PIN" >"$REQUEST" || die "cannot write $REQUEST"
say "resolving the newest releases setup.cfg admits (torch $TORCH_VERSION and $FAIRSEQ_PIN pinned)"
PIP_CONSTRAINT=/dev/null "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --dry-run \
    --ignore-installed --report "$REPORT" -c "$REQUEST" "$REPO[test,bench]" setuptools wheel ||
    die "pip could not resolve the newest releases setup.cfg's ranges admit (see above)"
"$VENV/bin/python" - "$REPORT" "$RESOLVED" "$FAIRSEQ_PIN" <<'EOF' || die "cannot read pip's report $REPORT"
import json, sys
report, resolved, fairseq_pin = sys.argv[1:]
pins = sorted(f"{item['metadata']['name']}=={item['metadata']['version']}" for item in json.load(open(report))["install"]
              if item["metadata"]["name"] != "rfa-fairseq")
with open(resolved, "w") as out:
    out.write("# pip's resolution of rfa-fairseq[test,bench], setuptools and wheel (scripts/test_newest_torch.sh)\n")
    out.write("\n".join(pins + [fairseq_pin]) + "\n")
EOF

export RFA_VENV="$VENV" RFA_CONSTRAINTS="$RESOLVED" RFA_EXTRAS="test,bench"
unset RFA_TORCH
# PYTHON for setup_env.sh alone: the project's scripts read PYTHON as the interpreter to run
PYTHON="$PY" bash "$REPO/scripts/setup_env.sh" || die "could not set up $VENV with the newest releases ($RESOLVED)"

# the versions it runs on: each requirement of the package (its extras test and bench included), as installed,
# checked against the resolution
"$VENV/bin/python" - "$RESOLVED" "$TORCH_VERSION" <<'EOF' || die "$VENV does not hold the resolved versions ($RESOLVED)"
import platform, re, sys
from importlib import metadata
resolved_file, torch_version = sys.argv[1:]
resolved = dict(line.strip().split("==") for line in open(resolved_file) if "==" in line)
canon = lambda name: re.sub(r"[-_.]+", "-", name).lower()
resolved = {canon(name): version for name, version in resolved.items()}
names = []
for requirement in metadata.requires("rfa-fairseq"):
    name, marker = re.match(r"\s*([A-Za-z0-9_.-]+)[^;]*(?:;(.*))?$", requirement).group(1, 2)
    if marker is None or re.search(r"extra == ['\"](test|bench)['\"]", marker):
        names.append(canon(name))
wrong, shown = [], []
for name in ["ve-fairseq"] + sorted(set(names), key=lambda n: (n not in ("torch", "numpy"), n)):
    installed = metadata.version(name)
    shown.append(f"{name} {installed}")
    if installed.split("+")[0] != resolved.get(name, "").split("+")[0]:
        wrong.append(f"{name}: installed {installed}, resolved {resolved.get(name)}")
if metadata.version("torch").split("+")[0] != torch_version:
    wrong.append(f"torch: installed {metadata.version('torch')}, wanted {torch_version}")
print(f"test_newest_torch.sh: versions: Python {platform.python_version()}, " + ", ".join(shown))
if wrong:
    sys.exit("test_newest_torch.sh: " + "; ".join(wrong))
EOF

say "the fast tests on these versions"
bash "$REPO/scripts/run_tests.sh" -m "not slow" -q -p no:cacheprovider "$@" ||
    die "the fast tests failed on the newest releases (Python $PY_VERSION; versions above)"

DEMO="$(mktemp -d "${TMPDIR:-/tmp}/rfa-newest-demo.XXXXXX")" || die "cannot create a temporary directory"
trap 'rm -rf "$DEMO"' EXIT
say "train -> generate -> score on these versions (scripts/run_demo.sh, in $DEMO)"
RFA_DEMO_DIR="$DEMO" bash "$REPO/scripts/run_demo.sh" || die "the demo failed on the newest releases (versions above)"
say "passed on Python $PY_VERSION with the newest releases setup.cfg admits (versions above)"
