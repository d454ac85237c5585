#!/usr/bin/env bash
# fairseq-train of the Multi30k EN-DE recipe on one GPU, side by side, through scripts/quality_study.py (the
# study's schedule: --lr 0.001 --warmup-updates 800, seed 1): the default rfa_transformer in each of PRECISIONS
# (default "fp32 fp16 bf16"; causal RFA through fla's chunked kernel where fla can differentiate it, the
# chunked torch path otherwise: the training log's warning says which) and the softmax twin in fp16 (the
# speed comparison: both fp16 runs share the device the same way). Each precision has its own CSV (the
# study's row key has no precision), in ${OUT:-outputs/gpu}/train_multi30k_cuda_<precision>.csv: test_2016_flickr
# BLEU/chrF, valid loss per epoch, words/s. BASE=1 adds the paper's base architecture (transformer_wmt_en_de's
# sizes: 6 + 6 layers, 512 wide, 8 heads, FFN 2,048, dropout 0.1, 3,584 tokens per update) on the same data and
# schedule, the default RFA and softmax in fp16 to the same UPDATES: quality_multi30k_base_cuda_fp16.csv.
# Needs .gpu/multi30k (pack_carry.py).
#
# LIMIT_S bounds each training and each translation (quality_study's timeouts: a run still going is stopped
# and reported as failed), since the trainings run in process groups of their own. DEVICE=cpu runs the
# fp32 and bf16 studies on the CPU (a smoke test of the script; fp16 needs CUDA).
#
#   OUT=/path UPDATES=1000 LIMIT_S=300 bash benchmarks/gpu/train_precision.sh
#   OUT=/path PRECISIONS="fp16 bf16" BASE=1 bash benchmarks/gpu/train_precision.sh
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
PRECISIONS="${PRECISIONS:-fp32 fp16 bf16}"
BASE="${BASE:-0}"
BASE_ARGS="--encoder-embed-dim 512 --encoder-ffn-embed-dim 2048 --encoder-layers 6 --encoder-attention-heads 8
    --decoder-embed-dim 512 --decoder-ffn-embed-dim 2048 --decoder-layers 6 --decoder-attention-heads 8
    --dropout 0.1 --weight-decay 0.0 --max-tokens 3584"
for precision in $PRECISIONS; do
    [[ "$precision" =~ ^(fp32|fp16|bf16)$ ]] || { echo "train_precision.sh: PRECISIONS: unknown '$precision' (fp32 fp16 bf16)" >&2; exit 2; }
done
[[ "$BASE" == 0 || "$BASE" == 1 ]] || { echo "train_precision.sh: BASE must be 0 or 1, got '$BASE'" >&2; exit 2; }
# every run below shares the GPU: threads per run and the CSVs' runs_sharing_device
RUNS=$(( $(wc -w <<<"$PRECISIONS") + 1 + 2 * BASE ))

study() {  # study WORK_NAME CSV LOG TRAIN_ARGS VARIANTS...: one quality_study into CSV
    local name="$1" csv="$2" log="$3" train_args="$4"
    shift 4
    python3 scripts/quality_study.py --device "${DEVICE:-cuda}" --prep "$PREP" --max-update "$UPDATES" --seed 1 \
        --variants "$@" --parallel $# --runs-sharing-device "$RUNS" --train-args="$train_args" \
        --train-timeout-h "$LIMIT_H" --decode-timeout-h "$LIMIT_H" \
        --work-dir "$WORK/$name" --csv "$OUT/$csv" --bleu-png "$WORK/$log.png" > "$OUT/train_$log.log" 2>&1
}

# RFA_ARGS: more flags for the rfa_transformer runs only (e.g. --rfa-sequence-kernel torch)
pids=()
for precision in $PRECISIONS; do
    flag=$([ "$precision" = fp32 ] || echo "--$precision")
    study "$precision" "train_multi30k_cuda_$precision.csv" "$precision" "$flag ${RFA_ARGS:-}" "$DEFAULT" & pids+=($!)
done
study fp16 train_multi30k_cuda_fp16.csv fp16_softmax "--fp16" softmax & pids+=($!)
if [ "$BASE" = 1 ]; then
    study base quality_multi30k_base_cuda_fp16.csv base "$(echo $BASE_ARGS) --fp16" softmax "$DEFAULT" & pids+=($!)
fi
failed=0
for pid in "${pids[@]}"; do wait "$pid" || failed=$((failed + 1)); done
tail -n 4 "$OUT"/train_*.log
[ "$failed" = 0 ] || { echo "train_precision.sh: $failed of ${#pids[@]} studies failed (logs: $OUT/train_*.log)" >&2; exit 1; }
