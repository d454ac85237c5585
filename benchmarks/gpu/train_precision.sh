#!/usr/bin/env bash
# fairseq-train of the Multi30k EN-DE recipe on one GPU in fp32, fp16 and bf16, side by side, through
# scripts/quality_study.py (the study's schedule: --lr 0.001 --warmup-updates 800, seed 1): the default
# rfa_transformer in all three precisions (causal RFA through fla's chunked kernel) and the softmax twin in
# fp16 (the speed comparison: both fp16 runs share the device the same way). Each precision has its own
# CSV (the study's row key has no precision), in ${OUT:-outputs/gpu}/train_multi30k_cuda_<precision>.csv:
# test_2016_flickr BLEU/chrF, valid loss per epoch, words/s. Needs .gpu/multi30k (pack_carry.py).
#
# LIMIT_S bounds each training and each translation (quality_study's timeouts: a run still going is stopped
# and reported as failed), since the trainings run in process groups of their own. DEVICE=cpu runs the
# fp32 and bf16 studies on the CPU (a smoke test of the script; fp16 needs CUDA).
#
#   OUT=/path UPDATES=1000 LIMIT_S=300 bash benchmarks/gpu/train_precision.sh
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$REPO"
OUT="${OUT:-$REPO/outputs/gpu}"
PREP="${PREP:-$REPO/.gpu/multi30k}"
WORK="${WORK:-/tmp/rfa-train-precision}"
UPDATES="${UPDATES:-1000}"
LIMIT_H=$(python3 -c "print(${LIMIT_S:-3600} / 3600)")
[ -f "$PREP/data-bin/dict.en.txt" ] || { echo "train_precision.sh: no $PREP/data-bin (run benchmarks/gpu/pack_carry.py here, carry .gpu)" >&2; exit 1; }
mkdir -p "$OUT" "$WORK"

DEFAULT=$(python3 -c "import sys; sys.path.insert(0, 'scripts'); import quality_study; print(quality_study.default_model_variant())")
RUNS=4  # every run below shares the GPU: threads per run and the CSVs' runs_sharing_device

study() {  # study PRECISION LOG TRAIN_ARGS VARIANTS...: one quality_study into that precision's CSV
    local precision="$1" log="$2" train_args="$3"
    shift 3
    python3 scripts/quality_study.py --device "${DEVICE:-cuda}" --prep "$PREP" --max-update "$UPDATES" --seed 1 \
        --variants "$@" --parallel $# --runs-sharing-device "$RUNS" --train-args="$train_args" \
        --train-timeout-h "$LIMIT_H" --decode-timeout-h "$LIMIT_H" \
        --work-dir "$WORK/$precision" --csv "$OUT/train_multi30k_cuda_$precision.csv" \
        --bleu-png "$WORK/$log.png" > "$OUT/train_$log.log" 2>&1
}

# RFA_ARGS: more flags for the rfa_transformer runs only (e.g. --rfa-sequence-kernel torch)
pids=()
study fp32 fp32 "${RFA_ARGS:-}" "$DEFAULT" & pids+=($!)
study fp16 fp16 "--fp16 ${RFA_ARGS:-}" "$DEFAULT" & pids+=($!)
study fp16 fp16_softmax "--fp16" softmax & pids+=($!)
study bf16 bf16 "--bf16 ${RFA_ARGS:-}" "$DEFAULT" & pids+=($!)
failed=0
for pid in "${pids[@]}"; do wait "$pid" || failed=$((failed + 1)); done
tail -n 4 "$OUT"/train_*.log
[ "$failed" = 0 ] || { echo "train_precision.sh: $failed of ${#pids[@]} studies failed (logs: $OUT/train_*.log)" >&2; exit 1; }
