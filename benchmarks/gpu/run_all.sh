#!/usr/bin/env bash
# The CUDA path on one GPU machine, in one command, most important results first:
#   1. wheels from .whl/ (fairseq, hydra, omegaconf, antlr4, bitarray, fla-core, sacrebleu, sacremoses) into /tmp/site
#   2. graph_tests: the static beam search's whole step and the decoder's step replayed as CUDA graphs == the
#      eager steps (every feature map, gated and ungated, fp32 and fp16, batches of other shapes through one
#      generator), beam reorders, and no host synchronisation in the decoder's step
#   3. train (in the background) beside 4. test_cuda: fairseq-train of the Multi30k recipe to 1,000 updates, the
#      default in RFA_GPU_PRECISIONS (default "fp16 bf16") and the softmax twin in fp16, and with
#      RFA_GPU_BASE=1 (default) the base architecture's RFA and softmax in fp16, each scored on test_2016_flickr
#      and valid (benchmarks/gpu/train_precision.sh); the rest of tests/test_cuda.py (fla against the
#      references, decoding on CUDA, fairseq-train/generate); then the fp16 recipe checkpoints as decode-only
#      copies into RFA_GPU_CHECKPOINT_DIR (default: the output folder): rfa_fp16.pt, softmax_fp16.pt
#   5. decode_forced: forced output lengths 64 / 256 / 2,048, 8 and 64 sentences x beam 4, fp16, base model:
#      softmax and rfa through fairseq's SequenceGenerator, rfa_static through the static beam search (the
#      generator fairseq-generate gives an rfa_transformer: its whole step one graph)
#      (RFA_GPU_FORCED_BATCHES, default "8 64", and RFA_GPU_FORCED_MODELS pick the points)
#   6. generate_real: fairseq-generate --fp16 on Multi30k test_2016_flickr (beam 4, batch 32 / 128 / 512) with the
#      checkpoints stage 3 trained: softmax, rfa, and rfa_eager at batch 128 (the same step uncaptured)
#   (warm_fla compiles fla's kernels on the CPU cores from the start, beside stage 2)
#   and, named in RFA_GPU_STAGES only: decode_batch8 /
#   decode_batch64 (fp32 up to 4,096 tokens, the paper's maps too) and train_attention (causal attention
#   fwd+bwd 512 ... 16,384 tokens).
# Everything goes under ${OUT:-outputs/gpu}: progress.log, status.txt, env.txt, the stage logs, CSVs and PNGs
# (file names carry the GPU, e.g. decode_cuda_h100_base_fp16.csv), summary.txt; with RFA_GPU_ARCHIVE=path.tar.gz
# that folder (checkpoints aside) is also packed there after every stage (a run cut short keeps what it
# finished). RFA_GPU_TRAIN_S caps the training stage (default 280 s). The whole run stops by RFA_GPU_BUDGET_S
# seconds (default 540): each stage gets what is left, a benchmark cut short keeps the points it measured. RFA_GPU_STAGES picks stages (default
# "warm_fla graph_tests train test_cuda decode_forced generate_real").
#
#   python benchmarks/gpu/pack_carry.py --prep outputs/multi30k     # here: .gpu/multi30k (the data)
#   OUT=/path bash benchmarks/gpu/run_all.sh                          # there, with .whl and .gpu carried
#   RFA_GPU_STAGES="warm_fla decode_batch64" RFA_GPU_BUDGET_S=500 bash benchmarks/gpu/run_all.sh
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$REPO"
OUT="${OUT:-$REPO/outputs/gpu}"
mkdir -p "$OUT"
BUDGET_S="${RFA_GPU_BUDGET_S:-540}"
STAGES=" ${RFA_GPU_STAGES:-warm_fla graph_tests train test_cuda decode_forced generate_real} "
START=$(date +%s)
: > "$OUT/status.txt"  # a line per stage (stages in the background write here too)

log() { echo "[$(date +%H:%M:%S) +$(( $(date +%s) - START ))s] $*" | tee -a "$OUT/progress.log"; }
left() { echo $(( BUDGET_S - ($(date +%s) - START) )); }
# budget RESERVE CAP: seconds for the next stage, keeping RESERVE for the stages after it
budget() { local b=$(( $(left) - $1 )); echo $(( b > $2 ? $2 : b )); }

# stage NAME SECONDS CMD...: run CMD under a hard time limit (SIGINT to its whole process group, as
# Ctrl-C: pytest still writes its summary), log its output, never abort the script
stage() {
    local name="$1" seconds="$2"
    shift 2
    if [[ "$STAGES" != *" $name "* ]]; then
        return 0
    fi
    if [ "$seconds" -le 25 ]; then
        log "$name: skipped (time budget spent)"
        echo "$name: skipped (time budget)" >> "$OUT/status.txt"
        return 0
    fi
    log "$name: start (at most ${seconds}s)"
    local rc=0
    timeout --signal=INT --kill-after=15 "$seconds" "$@" > >(tee "$OUT/$name.log") 2>&1 || rc=$?
    log "$name: exit code $rc$([ "$rc" = 124 ] && echo ' (time limit)')"
    echo "$name: exit code $rc" >> "$OUT/status.txt"
    archive
}

archive() {
    if [ -n "${RFA_GPU_ARCHIVE:-}" ]; then
        local tmp="$RFA_GPU_ARCHIVE.$BASHPID.tmp"  # stages in the background archive too
        tar czf "$tmp" -C "$OUT" --exclude='*.tmp' --exclude='*.pt' --exclude="$(basename "$RFA_GPU_ARCHIVE")" . &&
            mv "$tmp" "$RFA_GPU_ARCHIVE" || log "archive failed"
    fi
}

# ---------------------------------------------------------------- 1. environment
if ! python3 -c "import fairseq, fla, hydra, omegaconf" 2>/dev/null; then
    log "installing wheels from .whl/ into /tmp/site"
    if ! python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl; then
        log "wheel install failed (is .whl/ carried?)"
        exit 1
    fi
    export PYTHONPATH="/tmp/site:$REPO${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export PATH="/tmp/site/bin:$PATH"
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-/tmp/rfa-triton-cache}"  # shared by every process below
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
    python3 - <<'EOF'
import sys, torch, triton, fairseq, fla
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, triton {triton.__version__}, "
      f"fairseq {fairseq.__version__}, fla {fla.__version__}, cuda {torch.version.cuda}")
print(torch.cuda.get_device_name(), f"{torch.cuda.get_device_properties(0).total_memory / 2**30:.1f} GiB")
EOF
    # CTranslate2's PyPI wheel loads CUDA 12's cuBLAS (libcublas.so.12) at run time
    echo "libcublas.so.12: $(ldconfig -p | grep -c 'libcublas.so.12' || true) in ldconfig; files: $(find / -xdev -name 'libcublas.so.12*' 2>/dev/null | head -n 3 | tr '\n' ' ')"
} > "$OUT/env.txt" 2>&1 || true
log "environment: $(tr '\n' ' ' < "$OUT/env.txt")"

# ---------------------------------------------------------------- 2. the steps as CUDA graphs
# fla's Triton kernels (F = 64, head dim 64: the tests', the recipes' and the benchmarks') compile on first use,
# up to 48 autotuning configurations each: warm_fla compiles them in parallel on the CPU cores meanwhile (the
# graph tests use no fla), into the cache every later process reads
stage warm_fla 150 python3 benchmarks/gpu/warm_fla.py --phase-timeout-s 110 &
WARMING=$!
# first and short: no time is held back from it for the stages after it
GRAPH_TESTS="graph_replays or do_not_synchronize or beam_reorder or beam_grouped"
stage graph_tests "$(budget 0 100)" python3 -m pytest -q -s -p no:cacheprovider --junitxml="$OUT/graph_tests.xml" \
    tests/test_cuda.py -k "$GRAPH_TESTS"

# ---------------------------------------------------------------- 3. training beside 4. the other tests
TRAIN_WORK=/tmp/rfa-train-precision
secs=$(budget 215 "${RFA_GPU_TRAIN_S:-280}")
stage train "$secs" env OUT="$OUT" WORK="$TRAIN_WORK" UPDATES="${RFA_GPU_TRAIN_UPDATES:-1000}" LIMIT_S=$(( secs - 25 )) \
    PRECISIONS="${RFA_GPU_PRECISIONS:-fp16 bf16}" BASE="${RFA_GPU_BASE:-1}" bash benchmarks/gpu/train_precision.sh &
TRAINING=$!
if [[ "$STAGES" == *" graph_tests "* ]]; then
    OTHER_TESTS=(-k "not ($GRAPH_TESTS)")  # run in stage 2 already
else
    OTHER_TESTS=()
fi
stage test_cuda "$secs" python3 -m pytest -q -s -p no:cacheprovider --junitxml="$OUT/test_cuda.xml" tests/test_cuda.py \
    "${OTHER_TESTS[@]}"
wait "$TRAINING" || true
wait "$WARMING" || true
# the fp16 recipe checkpoints, decode-only (fp16 weights, no optimizer): CPU studies decode them too
DEFAULT=$(python3 -c "import sys; sys.path.insert(0, 'scripts'); import quality_study; print(quality_study.default_model_variant())")
for pair in "rfa $DEFAULT" "softmax softmax"; do
    set -- $pair
    src="$TRAIN_WORK/fp16/${2}_u${RFA_GPU_TRAIN_UPDATES:-1000}_s1/checkpoint_best.pt"
    if [ -f "$src" ]; then
        python3 -c "import sys; sys.path.insert(0, 'benchmarks/gpu'); from pack_carry import decode_only_copy; decode_only_copy(*sys.argv[1:])" \
            "$src" "${RFA_GPU_CHECKPOINT_DIR:-$OUT}/${1}_fp16.pt" >> "$OUT/progress.log" 2>&1 || log "decode-only copy of $src failed"
    fi
done

# ---------------------------------------------------------------- 5-6. decoding speed
GRACE=20
secs=$(budget 105 110)
stage decode_forced "$secs" python3 benchmarks/benchmark_decode.py --device cuda --one-run --dims base --dtype fp16 \
    --beam 4 --src-len 32 --models ${RFA_GPU_FORCED_MODELS:-softmax rfa rfa_static} --batch-sizes ${RFA_GPU_FORCED_BATCHES:-8 64} \
    --lengths 64 256 2048 --out-dir "$OUT" \
    --time-budget $(( secs - GRACE )) --run-budget 20

GENERATE=(python3 benchmarks/benchmark_generate.py --device cuda --fp16 --prep .gpu/multi30k --study-dir "$TRAIN_WORK/fp16"
          --max-update "${RFA_GPU_TRAIN_UPDATES:-1000}" --seed 1 --threads 1 --repeats 1 --train-timeout 0.001
          --csv "$OUT/generate_multi30k_cuda.csv")
stage generate_real "$(budget 0 120)" bash -c "$(printf '%q ' "${GENERATE[@]}") --models softmax rfa rfa_eager --batch-sizes 128 &&
    $(printf '%q ' "${GENERATE[@]}") --models softmax rfa --batch-sizes 32 512"

# ---------------------------------------------------------------- earlier benchmarks (named in RFA_GPU_STAGES)
# each script stops itself by --time-budget (GRACE s before its stage's hard limit) and keeps what it
# measured; a decoding worker sets up once (STARTUP s) and gives each model an equal share of the rest
STARTUP=12
MODELS=(softmax rfa rfa_paper rfa_paper_gated)
DECODE=(python3 benchmarks/benchmark_decode.py --device cuda --one-run --dims base --beam 4 --src-len 32
        --models "${MODELS[@]}" --out-dir "$OUT")
secs=$(budget 100 400)
stage decode_batch8 "$secs" "${DECODE[@]}" --resume --batch-sizes 8 --lengths 64 256 1024 2048 4096 \
    --time-budget $(( secs - GRACE )) --run-budget $(( (secs - GRACE - STARTUP) / ${#MODELS[@]} ))

secs=$(budget 50 65)
stage train_attention "$secs" python3 benchmarks/benchmark_train.py --device cuda --dims base --batch 1 \
    --kinds softmax_sdpa rfa rfa_gated --lengths 512 1024 2048 4096 8192 16384 --repeats 3 --skip-e2e \
    --time-budget $(( secs - GRACE )) --out-dir "$OUT"

secs=$(budget 5 400)
stage decode_batch64 "$secs" "${DECODE[@]}" --resume --batch-sizes 64 --lengths 64 256 1024 2048 --max-batch-at 2048 \
    --time-budget $(( secs - GRACE )) --run-budget $(( (secs - GRACE - STARTUP) / ${#MODELS[@]} ))

# ---------------------------------------------------------------- summary
{
    echo "elapsed: $(( $(date +%s) - START )) s of ${BUDGET_S} s"
    cat "$OUT/status.txt"
    grep -hE "passed|failed|skipped|error" "$OUT/test_cuda.log" 2>/dev/null | tail -n 3 || true
    ls -1 "$OUT"
} > "$OUT/summary.txt"
log "done: $(paste -sd ';' "$OUT/summary.txt")"
