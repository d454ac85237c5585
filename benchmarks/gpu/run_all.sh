#!/usr/bin/env bash
# The CUDA path on one GPU machine, in one command, most important results first:
#   1. wheels from .whl/ (fairseq, hydra, omegaconf, antlr4, bitarray, fla-core, sacrebleu, sacremoses) into /tmp/site
#   2. graph_tests: the decoding step replayed as CUDA graphs == the eager step (every feature map, gated and
#      ungated, fp32 and fp16, both beam searches), beam reorders, and no host synchronisation in the step
#   3. warm_fla: fla's Triton kernels for F = 64, head dim 64 compiled in parallel (benchmarks/gpu/warm_fla.py);
#      the tests, the recipe models and the benchmarks all use that set
#   4. train_precision (in the background) beside 5. test_cuda: fairseq-train of the Multi30k recipe in
#      fp32 / fp16 / bf16 to 1,000 updates and the softmax twin in fp16, scored on test_2016_flickr
#      (benchmarks/gpu/train_precision.sh); the whole of tests/test_cuda.py
#   6. decode_forced: forced output lengths 64 / 256 / 2,048, 8 and 64 sentences x beam 4, fp16, base model:
#      softmax, rfa (the default, graphs) and rfa_eager (the same step uncaptured), one worker per batch size
#   7. generate_real: fairseq-generate --fp16 on Multi30k test_2016_flickr (beam 4, batch 32 / 128 / 512):
#      softmax, rfa, rfa_eager, from the decode-only checkpoints of .gpu/ (benchmarks/gpu/pack_carry.py)
#   and, named in RFA_GPU_STAGES only: decode_batch8 / decode_batch64 (fp32 up to 4,096 tokens, the paper's
#   maps too) and train_attention (causal attention fwd+bwd 512 ... 16,384 tokens).
# Everything goes under ${OUT:-outputs/gpu}: progress.log, status.txt, env.txt, the stage logs, CSVs and PNGs
# (file names carry the GPU, e.g. decode_cuda_h200_base_fp16.csv), summary.txt; with RFA_GPU_ARCHIVE=path.tar.gz
# that folder is also packed there after every stage (a run cut short keeps what it finished). The whole run
# stops by RFA_GPU_BUDGET_S seconds (default 540): each stage gets what is left, a benchmark cut short keeps the
# points it measured. RFA_GPU_STAGES picks stages (default
# "graph_tests warm_fla train_precision test_cuda decode_forced generate_real").
#
#   python benchmarks/gpu/pack_carry.py --max-update 4000 --seed 1   # here: .gpu/ (checkpoints, Multi30k)
#   OUT=/path bash benchmarks/gpu/run_all.sh                          # there, with .whl and .gpu carried
#   RFA_GPU_STAGES="warm_fla decode_batch64" RFA_GPU_BUDGET_S=500 bash benchmarks/gpu/run_all.sh
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$REPO"
OUT="${OUT:-$REPO/outputs/gpu}"
mkdir -p "$OUT"
BUDGET_S="${RFA_GPU_BUDGET_S:-540}"
STAGES=" ${RFA_GPU_STAGES:-graph_tests warm_fla train_precision test_cuda decode_forced generate_real} "
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
        tar czf "$tmp" -C "$OUT" --exclude='*.tmp' . && mv "$tmp" "$RFA_GPU_ARCHIVE" || log "archive failed"
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
} > "$OUT/env.txt" 2>&1 || true
log "environment: $(tr '\n' ' ' < "$OUT/env.txt")"

# ---------------------------------------------------------------- 2. the step as CUDA graphs
# first and short (about 35 s on an H200): no time is held back from it for the stages after it
stage graph_tests "$(budget 0 150)" python3 -m pytest -q -s -p no:cacheprovider --junitxml="$OUT/graph_tests.xml" \
    tests/test_cuda.py -k "graph_replays or do_not_synchronize or beam_reorder or beam_grouped"

# ---------------------------------------------------------------- 3. fla's kernels, then 4. training beside 5. the tests
# up to 48 autotuning configurations per kernel and specialization: compiled in parallel here
# (minutes one by one), then timed once; later processes find both on disk
stage warm_fla "$(budget 330 150)" python3 benchmarks/gpu/warm_fla.py --phase-timeout-s 110

secs=$(budget 30 330)
stage train_precision "$secs" env OUT="$OUT" UPDATES="${RFA_GPU_TRAIN_UPDATES:-1000}" LIMIT_S=$(( secs - 20 )) \
    bash benchmarks/gpu/train_precision.sh &
TRAINING=$!
stage test_cuda "$secs" python3 -m pytest -x -q -s -p no:cacheprovider --junitxml="$OUT/test_cuda.xml" tests/test_cuda.py
wait "$TRAINING" || true

# ---------------------------------------------------------------- 6-7. decoding speed
GRACE=20
secs=$(budget 130 240)
stage decode_forced "$secs" python3 benchmarks/benchmark_decode.py --device cuda --one-run --dims base --dtype fp16 \
    --beam 4 --src-len 32 --models softmax rfa rfa_eager --batch-sizes 8 64 --lengths 64 256 2048 --out-dir "$OUT" \
    --time-budget $(( secs - GRACE )) --run-budget $(( (secs - GRACE - 30) / 6 ))

stage generate_real "$(budget 40 150)" python3 benchmarks/benchmark_generate.py --device cuda --fp16 \
    --prep .gpu/multi30k --study-dir .gpu/quality --max-update "${RFA_GPU_UPDATES:-4000}" --seed "${RFA_GPU_SEED:-1}" \
    --models softmax rfa rfa_eager --batch-sizes 32 128 512 --threads 1 --repeats 1 --train-timeout 1 \
    --csv "$OUT/generate_multi30k_cuda.csv"

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
