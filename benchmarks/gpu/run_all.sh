#!/usr/bin/env bash
# The CUDA path on one GPU machine, in one command, its stages one after the other (nothing else runs while one is
# timed), each under a time limit:
#   1. wheels from .whl/ (fairseq, hydra, omegaconf, antlr4, bitarray, sacremoses; fla-core, the peer of the
#      attention benchmark) into /tmp/site
#   2. kernel_tests: tests/test_cuda.py's Triton kernels (training's causal RFA forward and backward, the decoding
#      step's causal update) against the references, and the static beam search's graph replays of the default;
#      self_check: the kernels' self-check as the default model (base dims, fp16) trains, scores and decodes, each
#      variant's outcome and milliseconds in gpu_self_check_<gpu>.csv (benchmarks/gpu/self_check.py); where every
#      check passed, profile and generate_real (timed from their first batch) skip theirs (--no-triton-self-check)
#   3. attention: causal attention forward + backward at translation lengths (benchmark_train.py: the Triton kernels,
#      the chunked torch path, fla's chunk_simple_gla, softmax SDPA)
#   4. train: fairseq-train --fp16 of the Multi30k recipe to RFA_GPU_TRAIN_UPDATES (default 1,000), the softmax twin
#      then the default rfa_transformer, one at a time (words/s from fairseq's log), each scored on test_2016_flickr
#      (scripts/quality_study.py, train_multi30k_cuda_fp16.csv); the checkpoints as decode-only copies rfa_fp16.pt and
#      softmax_fp16.pt in RFA_GPU_CHECKPOINT_DIR (default: the output folder)
#   5. profile: real-data batches of 32 and 128 through fairseq-generate's generator with and without graphs, batch by
#      batch, and torch's profiler over one (profile_batches.py)
#   6. generate_real: fairseq-generate --fp16 on test_2016_flickr (beam 4, batch 32 / 128 / 512): softmax, rfa, and
#      rfa_eager at batch 128 (the same step uncaptured)
#   7. decode_forced: forced output lengths 64 / 256 / 2,048, 64 sentences x beam 4, fp16, base model: softmax through
#      fairseq's SequenceGenerator, rfa_static through the static beam search (RFA_GPU_FORCED_BATCHES,
#      RFA_GPU_FORCED_MODELS)
#   8. test_cuda: the rest of tests/test_cuda.py, while time is left
#   and, named in RFA_GPU_STAGES only: base (the base architecture's RFA and softmax on Multi30k, fp16, the same
#   updates: quality_multi30k_base_cuda_fp16.csv), decode_batch8 / decode_batch64 (fp32 up to 4,096 tokens, the
#   paper's maps too) and train_attention (causal attention fwd+bwd 512 ... 16,384 tokens).
# Everything goes under ${OUT:-outputs/gpu}: progress.log, status.txt, env.txt, the stage logs, CSVs and PNGs (file
# names carry the GPU, e.g. decode_cuda_h100_base_fp16.csv), summary.txt; with RFA_GPU_ARCHIVE=path.tar.gz that
# folder (checkpoints aside) is also packed there after every stage (a run cut short keeps what it finished). The
# whole run stops by RFA_GPU_BUDGET_S seconds (default 560): each stage gets at most its cap and what is left after
# the reserve of the stages after it; a benchmark cut short keeps the points it measured. RFA_GPU_STAGES picks stages
# (default "kernel_tests self_check attention train profile generate_real decode_forced test_cuda").
#
#   python benchmarks/gpu/pack_carry.py --prep outputs/multi30k     # here: .gpu/multi30k (the data)
#   OUT=/path bash benchmarks/gpu/run_all.sh                          # there, with .whl and .gpu carried
#   RFA_GPU_STAGES="decode_batch64" RFA_GPU_BUDGET_S=500 bash benchmarks/gpu/run_all.sh
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$REPO"
OUT="${OUT:-$REPO/outputs/gpu}"
mkdir -p "$OUT"
BUDGET_S="${RFA_GPU_BUDGET_S:-560}"
STAGES=" ${RFA_GPU_STAGES:-kernel_tests self_check attention train profile generate_real decode_forced test_cuda} "
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
if ! python3 -c "import fairseq, hydra, omegaconf" 2>/dev/null; then
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
import importlib.metadata, sys, torch, triton, fairseq
try:
    fla = importlib.metadata.version("fla-core")
except importlib.metadata.PackageNotFoundError:
    fla = "absent"
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, triton {triton.__version__}, "
      f"fairseq {fairseq.__version__}, fla-core {fla}, cuda {torch.version.cuda}")
print(torch.cuda.get_device_name(), f"{torch.cuda.get_device_properties(0).total_memory / 2**30:.1f} GiB")
EOF
    # CTranslate2's PyPI wheel loads CUDA 12's cuBLAS (libcublas.so.12) at run time
    echo "libcublas.so.12: $(ldconfig -p | grep -c 'libcublas.so.12' || true) in ldconfig; files: $(find / -xdev -name 'libcublas.so.12*' 2>/dev/null | head -n 3 | tr '\n' ' ')"
    echo "other processes: $(ps -eo pid,pcpu,args --sort=-pcpu | sed -n '2,6p' | tr '\n' ';')"
} > "$OUT/env.txt" 2>&1 || true
log "environment: $(tr '\n' ' ' < "$OUT/env.txt")"

# ---------------------------------------------------------------- 2. kernels
GRACE=20
stage kernel_tests "$(budget 480 60)" python3 -m pytest -q -s -p no:cacheprovider --junitxml="$OUT/kernel_tests.xml" \
    tests/test_cuda.py -k "triton or dispatch or (graph_replays and hedgehog-gated)"

# the kernels' self-check on this GPU (what is left of kernel_tests' slot); the timed stages below skip their own
# check only where this one ran whole and every check passed
stage self_check "$(budget 455 45)" python3 benchmarks/gpu/self_check.py --models rfa --dims base --dtypes fp16 \
    --out-dir "$OUT"
CHECKED=()
if grep -qx "self_check: exit code 0" "$OUT/status.txt"; then
    CHECKED=(--no-triton-self-check)
fi

# ---------------------------------------------------------------- 3. causal attention, forward + backward
secs=$(budget 420 35)
stage attention "$secs" python3 benchmarks/benchmark_train.py --device cuda --dims base --batch 64 --dtype fp16 \
    --kinds softmax_sdpa rfa_gated rfa_gated_torch rfa rfa_fla --lengths 32 64 256 1024 --repeats 10 --skip-e2e \
    --time-budget $(( secs - 10 )) --out-dir "$OUT"

# ---------------------------------------------------------------- 4. training, one run at a time
TRAIN_WORK=/tmp/rfa-train
UPDATES="${RFA_GPU_TRAIN_UPDATES:-1000}"
DEFAULT=$(python3 -c "import sys; sys.path.insert(0, 'scripts'); import quality_study; print(quality_study.default_model_variant())")
secs=$(budget 250 190)
LIMIT_H=$(python3 -c "print(max($secs - 15, 10) / 3600)")
stage train "$secs" python3 scripts/quality_study.py --device cuda --prep .gpu/multi30k --max-update "$UPDATES" --seed 1 \
    --variants softmax "$DEFAULT" --parallel 1 --runs-sharing-device 1 --train-args="--fp16" \
    --train-timeout-h "$LIMIT_H" --decode-timeout-h "$LIMIT_H" --work-dir "$TRAIN_WORK/fp16" \
    --csv "$OUT/train_multi30k_cuda_fp16.csv" --bleu-png "$TRAIN_WORK/bleu.png"
# the fp16 recipe checkpoints, decode-only (fp16 weights, no optimizer): CPU studies decode them too
for pair in "rfa $DEFAULT" "softmax softmax"; do
    set -- $pair
    src="$TRAIN_WORK/fp16/${2}_u${UPDATES}_s1/checkpoint_best.pt"
    if [ -f "$src" ]; then
        python3 -c "import sys; sys.path.insert(0, 'benchmarks/gpu'); from pack_carry import decode_only_copy; decode_only_copy(*sys.argv[1:])" \
            "$src" "${RFA_GPU_CHECKPOINT_DIR:-$OUT}/${1}_fp16.pt" >> "$OUT/progress.log" 2>&1 || log "decode-only copy of $src failed"
    fi
done

# ---------------------------------------------------------------- 5-7. decoding: the batches' profile, real data, forced lengths
RFA_CHECKPOINT="$TRAIN_WORK/fp16/${DEFAULT}_u${UPDATES}_s1/checkpoint_best.pt"
stage profile "$(budget 170 60)" python3 benchmarks/gpu/profile_batches.py --prep .gpu/multi30k --checkpoint "$RFA_CHECKPOINT" \
    --batch-sizes 32 128 --out-dir "$OUT" ${CHECKED[@]+"${CHECKED[@]}"}

GENERATE=(python3 benchmarks/benchmark_generate.py --device cuda --fp16 --prep .gpu/multi30k --study-dir "$TRAIN_WORK/fp16"
          --max-update "$UPDATES" --seed 1 --threads 1 --repeats 1 --train-timeout 0.001
          --csv "$OUT/generate_multi30k_cuda.csv" ${CHECKED[@]+"${CHECKED[@]}"})
stage generate_real "$(budget 75 120)" bash -c "$(printf '%q ' "${GENERATE[@]}") --models softmax rfa rfa_eager --batch-sizes 128 &&
    $(printf '%q ' "${GENERATE[@]}") --models softmax rfa --batch-sizes 32 512"

secs=$(budget 0 75)
stage decode_forced "$secs" python3 benchmarks/benchmark_decode.py --device cuda --one-run --dims base --dtype fp16 \
    --beam 4 --src-len 32 --models ${RFA_GPU_FORCED_MODELS:-softmax rfa_static} --batch-sizes ${RFA_GPU_FORCED_BATCHES:-64} \
    --lengths 64 256 2048 --out-dir "$OUT" --time-budget $(( secs - GRACE )) --run-budget 20

# ---------------------------------------------------------------- 8. the other CUDA tests, while time is left
stage test_cuda "$(budget 0 300)" python3 -m pytest -q -s -p no:cacheprovider --junitxml="$OUT/test_cuda.xml" tests/test_cuda.py \
    -k "not (triton or dispatch or (graph_replays and hedgehog-gated))"

# ---------------------------------------------------------------- named in RFA_GPU_STAGES only
BASE_ARGS="--encoder-embed-dim 512 --encoder-ffn-embed-dim 2048 --encoder-layers 6 --encoder-attention-heads 8
    --decoder-embed-dim 512 --decoder-ffn-embed-dim 2048 --decoder-layers 6 --decoder-attention-heads 8
    --dropout 0.1 --weight-decay 0.0 --max-tokens 3584 --fp16"
secs=$(budget 0 400)
stage base "$secs" python3 scripts/quality_study.py --device cuda --prep .gpu/multi30k --max-update "$UPDATES" --seed 1 \
    --variants softmax "$DEFAULT" --parallel 1 --runs-sharing-device 1 --train-args="$(echo $BASE_ARGS)" \
    --train-timeout-h "$(python3 -c "print(max($secs - 15, 10) / 3600)")" --decode-timeout-h 0.05 \
    --work-dir "$TRAIN_WORK/base" --csv "$OUT/quality_multi30k_base_cuda_fp16.csv" --bleu-png "$TRAIN_WORK/base.png"

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
