#!/usr/bin/env bash
# An aarch64 Linux user-space, run under emulation (qemu's user mode), in which one decoding step of a tiny model runs
# through the native runtime: scripts/test_aarch64_native_step.sh (a CI step of .ci/run). Every step is idempotent
# and cached (a stamp per step in the cache directory: a second run whose inputs are unchanged installs nothing and
# rebuilds only what changed).
#
#   bash scripts/setup_aarch64_emulation.sh      # prints the environment's directory last
#   RFA_AARCH64_DIR=DIR                          # the cache (default ${XDG_CACHE_HOME:-~/.cache}/rfa-fairseq/aarch64)
#
# 1. tools: qemu-aarch64 (Debian's qemu-user, or qemu-user-static's qemu-aarch64-static) and the cross compiler
#    g++-aarch64-linux-gnu (apt-get, as root; RFA_NO_APT=1 never installs). Without them it exits 3, saying what is
#    missing.
# 2. sysroot: Debian's arm64 python3.11 and the libraries it loads, unpacked (dpkg -x) from the packages of the
#    machine's own Debian release, resolved by apt in a private state directory (the machine's apt is not changed).
# 3. site: the aarch64 wheels from PyPI (pip --target --platform manylinux_2_28_aarch64): torch AARCH64_TORCH (the
#    newest torch whose PyPI aarch64 wheel is the CPU build: from 2.11 PyPI's aarch64 wheels are CUDA builds that need
#    several GB of CUDA libraries), every other package at scripts/constraints.txt's version.
# 4. fairseq: the fairseq-fixed sdist from PyPI (the same fairseq module as ve-fairseq, which has no aarch64 wheel
#    and no sdist), built for aarch64 by the emulated pip with the cross compiler (its Cython and C++ helpers).
# 5. checkout: the repository's files (git ls-files) copied into the cache, where the emulated Python runs the
#    project's own setup.py (build_ext --inplace) with the cross compiler as CXX: the C++ module for aarch64.
# Emulated Python runs as DIR/python (qemu-aarch64 -L DIR/root DIR/root/usr/bin/python3.11, PYTHONPATH=DIR/site...;
# scripts/test_aarch64_native_step.sh runs this script first; the last line printed is "ready: DIR").
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DIR="${RFA_AARCH64_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/rfa-fairseq/aarch64}"
AARCH64_TORCH=2.10.0
FAIRSEQ_SDIST="fairseq-fixed==0.12.3.1"
PLATFORM=(--platform manylinux_2_28_aarch64 --platform manylinux_2_17_aarch64 --platform manylinux2014_aarch64
    --only-binary=:all: --python-version 3.11 --implementation cp)
# Debian's arm64 packages: Python, its headers (the C++ module and fairseq's helpers are compiled against them), and
# the C++ runtime torch's libraries load
DEBIAN_PACKAGES=(python3.11 libpython3.11-dev libstdc++6)
# what the native step imports on aarch64: setup.cfg's requirements (scikit-learn: fairseq's audio_classification task
# imports it when fairseq loads its tasks; less ninja: the host's builds), torch's own, pytest (the tests' helpers
# import it), and the build tools of fairseq and the module
# pure-Python packages published only as sdists: made wheels here (they fit every platform)
PURE_SDISTS=(antlr4-python3-runtime)
PYPI_PACKAGES=(numpy scikit-learn hydra-core omegaconf sacrebleu regex tqdm bitarray cffi cython packaging sentencepiece sacremoses
    filelock typing_extensions sympy networkx Jinja2 fsspec pytest pytest-timeout setuptools wheel pip)

die() { echo "setup_aarch64_emulation.sh: error: $*" >&2; exit 1; }
unavailable() { echo "setup_aarch64_emulation.sh: unavailable: $*" >&2; exit 3; }
say() { echo "setup_aarch64_emulation.sh: $*"; }
# 0 when step $1's stamp holds $2
fresh() { [[ -f "$DIR/$1.stamp" && "$(cat "$DIR/$1.stamp")" == "$2" ]]; }
stamp() { echo "$2" >"$DIR/$1.stamp"; }

HOST_PYTHON="${RFA_VENV:-$REPO/.venv}/bin/python"  # its pip downloads; its torch reads the fairseq sdist's metadata
[[ -x "$HOST_PYTHON" ]] || die "no $HOST_PYTHON: run bash scripts/setup_env.sh first"
export PIP_CONSTRAINT=/dev/null  # a machine-wide cap must not refuse the versions pinned here
mkdir -p "$DIR" || die "cannot create $DIR (RFA_AARCH64_DIR)"
DIR="$(cd "$DIR" && pwd)"
ROOT="$DIR/root"

# ------------------------------------------------------------------------------------------------------ 1. tools
missing=()
QEMU="$(command -v qemu-aarch64 || command -v qemu-aarch64-static || true)"
[[ -n "$QEMU" ]] || missing+=(qemu-user)
command -v aarch64-linux-gnu-g++ >/dev/null 2>&1 || missing+=(g++-aarch64-linux-gnu)
command -v dpkg >/dev/null 2>&1 || unavailable "dpkg is not installed (the sysroot is unpacked from Debian packages)"
if ((${#missing[@]})); then
    [[ -z "${RFA_NO_APT:-}" ]] || unavailable "${missing[*]} not installed, and RFA_NO_APT is set"
    command -v apt-get >/dev/null 2>&1 || unavailable "${missing[*]} not installed, and this machine has no apt-get"
    [[ $(id -u) -eq 0 ]] || unavailable "${missing[*]} not installed, and apt-get needs root (sudo apt-get install ${missing[*]})"
    say "installing ${missing[*]} (apt-get)"
    apt-get install -y -q "${missing[@]}" >/dev/null 2>&1 ||
        { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q "${missing[@]}" >/dev/null 2>&1; } ||
        die "apt-get could not install ${missing[*]}"
    QEMU="$(command -v qemu-aarch64 || command -v qemu-aarch64-static)" || die "apt-get installed no qemu-aarch64"
fi
# the emulated Python, written once as DIR/python (what scripts/test_aarch64_native_step.sh runs too): none of the
# host venv's Python settings, the aarch64 site directories first; -cpu max: an ARMv8 CPU with the dot-product
# extension (the neon_dotprod level)
EMULATED=("$DIR/python")
cat >"$DIR/python.new" <<LAUNCHER
#!/bin/sh
exec env -u PYTHONHOME -u VIRTUAL_ENV PYTHONPATH="$DIR/site-fairseq:$DIR/site:$DIR/site-torch" "$QEMU" -cpu max \\
    -L "$ROOT" "$ROOT/usr/bin/python3.11" "\$@"
LAUNCHER
chmod +x "$DIR/python.new" && mv "$DIR/python.new" "$DIR/python" || die "cannot write $DIR/python"

# ---------------------------------------------------------------------------------------------------- 2. sysroot
RELEASE="$(cat /etc/debian_version 2>/dev/null || echo unknown)"
want="release=$RELEASE packages=${DEBIAN_PACKAGES[*]}"
if ! fresh sysroot "$want" || [[ ! -x "$ROOT/usr/bin/python3.11" ]]; then
    say "unpacking Debian's arm64 ${DEBIAN_PACKAGES[*]} into $ROOT"
    APT="$DIR/apt"
    rm -rf "$APT" "$ROOT.new"
    mkdir -p "$APT/lists/partial" "$APT/archives/partial" "$APT/cache" "$ROOT.new"
    : >"$APT/status"  # nothing installed: apt resolves every dependency
    apt_options=(-o "Dir::State::Lists=$APT/lists" -o "Dir::State::status=$APT/status" -o "Dir::Cache=$APT/cache"
        -o "Dir::Cache::Archives=$APT/archives" -o APT::Architecture=arm64 -o APT::Architectures::=arm64
        -o Debug::NoLocking=1 -q)
    apt-get "${apt_options[@]}" update >"$APT/update.log" 2>&1 || die "apt-get update for arm64 failed ($APT/update.log)"
    apt-get "${apt_options[@]}" install -y --download-only --no-install-recommends "${DEBIAN_PACKAGES[@]}" \
        >"$APT/download.log" 2>&1 || die "apt-get could not download arm64 ${DEBIAN_PACKAGES[*]} ($APT/download.log)"
    for deb in "$APT"/archives/*.deb; do
        dpkg -x "$deb" "$ROOT.new" || die "dpkg could not unpack $deb"
    done
    rm -rf "$ROOT" && mv "$ROOT.new" "$ROOT"
    rm -rf "$APT/archives"  # the unpacked tree is what is kept
    "${EMULATED[@]}" -c 'import platform, ctypes, ssl; assert platform.machine() == "aarch64"' ||
        die "the emulated python3.11 in $ROOT does not run"
    stamp sysroot "$want"
fi

# ------------------------------------------------------------------------------------------------------- 3. site
CONSTRAINTS="$DIR/constraints.txt"  # scripts/constraints.txt with the aarch64 torch
sed -e "s/^torch==.*/torch==$AARCH64_TORCH/" -e "/^triton==/d" "$REPO/scripts/constraints.txt" >"$CONSTRAINTS.new"
mv "$CONSTRAINTS.new" "$CONSTRAINTS"
want="$(cat "$CONSTRAINTS"; echo "${PYPI_PACKAGES[*]} ${PURE_SDISTS[*]}")"
if ! fresh site "$want"; then
    say "installing torch $AARCH64_TORCH and ${PYPI_PACKAGES[*]} (PyPI's aarch64 wheels) into $DIR/site"
    rm -rf "$DIR/site" "$DIR/site-torch"
    # torch alone, without its requirements: pip reads their markers for this machine (x86-64: CUDA libraries)
    "$HOST_PYTHON" -m pip install --quiet --disable-pip-version-check --no-deps --target "$DIR/site-torch" "${PLATFORM[@]}" \
        "torch==$AARCH64_TORCH" || die "pip could not install torch $AARCH64_TORCH for aarch64"
    rm -rf "$DIR/wheels"
    "$HOST_PYTHON" -m pip wheel --quiet --disable-pip-version-check --no-deps -w "$DIR/wheels" -c "$CONSTRAINTS" \
        "${PURE_SDISTS[@]}" || die "pip could not make wheels of ${PURE_SDISTS[*]}"
    "$HOST_PYTHON" -m pip install --quiet --disable-pip-version-check --target "$DIR/site" "${PLATFORM[@]}" -c "$CONSTRAINTS" \
        --find-links "$DIR/wheels" "${PYPI_PACKAGES[@]}" || die "pip could not install ${PYPI_PACKAGES[*]} for aarch64 (-c $CONSTRAINTS)"
    stamp site "$want"
fi
# the emulated builds call the cross compiler (qemu runs a host program that the emulated one starts as it is) and
# find aarch64 Python's headers in the sysroot
export CC=aarch64-linux-gnu-gcc CXX=aarch64-linux-gnu-g++
export CFLAGS="-I$ROOT/usr/include/python3.11 -idirafter $ROOT/usr/include"
export CXXFLAGS="$CFLAGS"

# ---------------------------------------------------------------------------------------------------- 4. fairseq
want="$FAIRSEQ_SDIST torch=$AARCH64_TORCH"
if ! fresh fairseq "$want"; then
    say "building $FAIRSEQ_SDIST for aarch64 (the emulated pip, the cross compiler) into $DIR/site-fairseq"
    rm -rf "$DIR/sdist" "$DIR/site-fairseq" "$DIR/fairseq-src"
    # the sdist itself (the host's pip reads its metadata with the host's torch)
    "$HOST_PYTHON" -m pip download --quiet --disable-pip-version-check --no-deps --no-binary :all: \
        --no-build-isolation -d "$DIR/sdist" "$FAIRSEQ_SDIST" >"$DIR/fairseq-download.log" 2>&1 ||
        die "pip could not download the $FAIRSEQ_SDIST sdist ($DIR/fairseq-download.log)"
    mkdir -p "$DIR/fairseq-src" && tar -xzf "$DIR"/sdist/*.tar.gz -C "$DIR/fairseq-src" --strip-components=1 ||
        die "cannot unpack $DIR/sdist"
    # built in place by its setup.py in one emulated process (pip would start the emulated Python again, which the
    # host cannot run without binfmt_misc), then found on PYTHONPATH as site-fairseq
    start=$SECONDS
    (cd "$DIR/fairseq-src" && MAX_JOBS="$(nproc 2>/dev/null || echo 2)" "${EMULATED[@]}" setup.py build_ext --inplace) \
        >"$DIR/fairseq-build.log" 2>&1 ||
        die "the emulated setup.py could not build $FAIRSEQ_SDIST for aarch64 ($DIR/fairseq-build.log)"
    echo "$FAIRSEQ_SDIST built for aarch64 in $((SECONDS - start)) s" | tee -a "$DIR/fairseq-build.log"
    ln -sfn fairseq-src "$DIR/site-fairseq"
    stamp fairseq "$want"
fi

# --------------------------------------------------------------------------------------------------- 5. checkout
CHECKOUT="$DIR/checkout"
mkdir -p "$CHECKOUT"
# a fresh copy of the repository's files, modification times kept (ninja then recompiles only what changed); the
# build directory and nothing else survives from the last copy
find "$CHECKOUT" -mindepth 1 -maxdepth 1 ! -name build -exec rm -rf {} +
git -C "$REPO" ls-files -z --cached --others --exclude-standard | (cd "$REPO" && tar --null -T - -cf -) |
    tar -xf - -C "$CHECKOUT" || die "cannot copy the repository's files (git ls-files) into $CHECKOUT"
# ninja (the host's: the venv's pip package) runs the compiler commands; torch's build finds it on PATH
PATH="$(dirname "$HOST_PYTHON"):$PATH"
(cd "$CHECKOUT" && MAX_JOBS="$(nproc 2>/dev/null || echo 2)" "${EMULATED[@]}" setup.py build_ext --inplace) \
    >"$DIR/module-build.log" 2>&1 || die "setup.py build_ext failed for aarch64 ($DIR/module-build.log)"
ls "$CHECKOUT"/rfa_fairseq/cpu/_cpp_kernels.cpython-311-aarch64-linux-gnu.so >/dev/null 2>&1 ||
    die "setup.py built no C++ module for aarch64 ($DIR/module-build.log says why)"
say "ready: $DIR"
