#!/usr/bin/env bash
# Train one recipe with fairseq-train: the command-line twin of configs/<RECIPE>.yaml (MODEL=rfa)
# and configs/<RECIPE>_softmax.yaml (MODEL=softmax). Same model, optimizer, schedule and batch;
# tests/test_configs.py checks that the two agree field by field.
#
#   DATA=/path/to/data-bin RECIPE=iwslt14_de_en MODEL=rfa scripts/train.sh [fairseq-train args ...]
#   scripts/train.sh --help      # every setting, the recipes, DRY_RUN=1 (print the command, train nothing)
#
# Extra arguments go to fairseq-train after the recipe's flags, so they override them (fairseq's
# argparse keeps the last occurrence), e.g.  scripts/train.sh --dropout 0.2 --rfa-gate
#
# Resumable: fairseq-train restores SAVE_DIR/checkpoint_last.pt (model, optimizer, scheduler, data
# position, elapsed time) when it exists, so re-running the same command continues the run; a run
# that already reached MAX_UPDATE stops at once. The log of every run is appended to
# SAVE_DIR/train.log. Keep SAVE_DIR per recipe and model: a checkpoint of another architecture
# cannot be resumed.
#
# Fine-tuning a converted model: FINETUNE_FROM=RFA.pt (written by rfa-convert-transformer) starts from its
# weights (fairseq-train --finetune-from-model: fresh optimizer, schedule and data position), builds the
# model with the checkpoint's own --rfa-* options and applies the fine-tuning recipe FINETUNE_ARGS below
# instead of the recipe's schedule (docs/quality.md, "Converting a softmax model"). A resumed run
# (SAVE_DIR/checkpoint_last.pt exists) continues from its own checkpoint, as fairseq does.
#
# Numbers and their sources are documented in the configs/*.yaml files.
set -euo pipefail
# The whole script is one block, read before it runs: a study's runs keep running the version they started
# with when this file is edited under them (bash otherwise reads a script as it goes).
{

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

usage() {
    cat <<'EOF'
Usage: DATA=DIR [RECIPE=NAME] [MODEL=rfa|softmax] [VAR=value ...] scripts/train.sh [fairseq-train args ...]

Trains one recipe with fairseq-train: the command-line twin of configs/<RECIPE>.yaml (MODEL=rfa) and
configs/<RECIPE>_softmax.yaml (MODEL=softmax). Arguments after the script go to fairseq-train after the
recipe's flags, so they override them (e.g. --dropout 0.2, --max-tokens 2048). Re-running the same command
resumes from SAVE_DIR/checkpoint_last.pt; every run's log is appended to SAVE_DIR/train.log.

Settings (environment variables):
  DATA            binarized data, a fairseq-preprocess --destdir (required)
  RECIPE          iwslt14_de_en (default) | wmt14_en_de | wmt14_en_de_big | wmt14_en_fr_big |
                  multi30k_en_de | multi30k_en_fr
  MODEL           rfa (default) | softmax: the softmax transformer of the same size
  ARCH            architecture (default: the recipe's, for MODEL)
  SAVE_DIR        checkpoint folder (default: checkpoints/<RECIPE>[_softmax])
  SRC_LANG, TGT_LANG   language pair (default: the recipe's)
  MAX_UPDATE      number of updates (default: the recipe's)
  MAX_TIME_HOURS  > 0: stop after this much training time, summed over resumes (default 0: no limit)
  UPDATE_FREQ     gradient accumulation (default 1); the WMT recipes assume 8 GPUs: 8/N on N GPUs
  FP16            1 | 0 (default: 1 for the WMT recipes where torch sees a CUDA GPU, else 0, saying so;
                  FP16=1 without a CUDA GPU is an error)
  USER_DIR        the plugin folder (default: rfa_fairseq of this checkout)
  FINETUNE_FROM   a converted rfa_transformer checkpoint (rfa-convert-transformer) to fine-tune
  CHECK_DATA      1 (default): check DATA with rfa-check-data first; 0 skips the check
  DRY_RUN         1: check the settings, print the fairseq-train command and exit without training
  PYTHON          Python of the environment (default: python3)

GPUs: fairseq-train uses every visible GPU (one process each); CUDA_VISIBLE_DEVICES picks them.
SLURM or several machines: DRY_RUN=1 prints the fairseq-train command; run it under
  srun --ntasks-per-node G ... --distributed-world-size N --distributed-port 12345 (docs/reliability.md)

Examples:
  DATA=prep/data-bin RECIPE=multi30k_en_de scripts/train.sh
  DATA=prep/data-bin RECIPE=multi30k_en_de DRY_RUN=1 scripts/train.sh --max-tokens 2048
  DATA=wmt/data-bin RECIPE=wmt14_en_de UPDATE_FREQ=2 scripts/train.sh        # on 4 GPUs
EOF
}
case "${1:-}" in
    -h | --help) usage; exit 0 ;;
esac

# ------------------------------------------------------------------ settings (environment)
DATA="${DATA:-}"                      # binarized data (fairseq-preprocess --destdir); required
RECIPE="${RECIPE:-iwslt14_de_en}"     # iwslt14_de_en | wmt14_en_de | wmt14_en_de_big | wmt14_en_fr_big | multi30k_en_de | multi30k_en_fr
MODEL="${MODEL:-rfa}"                 # rfa | softmax (the baseline of the same size)
ARCH="${ARCH:-}"                      # default: the recipe's architecture for MODEL
SAVE_DIR="${SAVE_DIR:-}"              # default: checkpoints/<config name>, as the config
SRC_LANG="${SRC_LANG:-}"              # default: the recipe's language pair
TGT_LANG="${TGT_LANG:-}"
MAX_UPDATE="${MAX_UPDATE:-}"          # default: the recipe's number of updates
MAX_TIME_HOURS="${MAX_TIME_HOURS:-0}" # > 0: stop after this much training time (summed over resumes)
UPDATE_FREQ="${UPDATE_FREQ:-1}"       # gradient accumulation; WMT recipes assume 8 GPUs (on N GPUs: 8/N)
FP16="${FP16:-}"                      # 1 | 0; default: 1 for the WMT recipes (scaling_nmt) where CUDA is
FP16_GIVEN="$FP16"
USER_DIR="${USER_DIR:-$REPO/rfa_fairseq}"  # the plugin; loaded for softmax runs too (checkpoint loading)
FINETUNE_FROM="${FINETUNE_FROM:-}"    # converted rfa_transformer checkpoint to fine-tune (MODEL=rfa only)
DRY_RUN="${DRY_RUN:-0}"               # 1: check the inputs, print the fairseq-train command, exit

die() { echo "train.sh: error: $*" >&2; exit 1; }

# ------------------------------------------------------------------ recipes
# Flags shared by all recipes (fairseq examples/translation and scaling_nmt READMEs, Vaswani et al.).
COMMON_ARGS=(
    --task translation
    --optimizer adam --adam-betas "(0.9,0.98)" --adam-eps 1e-08 --clip-norm 0.0
    --lr-scheduler inverse_sqrt --warmup-updates 4000
    --criterion label_smoothed_cross_entropy --label-smoothing 0.1
    --max-source-positions 1024 --max-target-positions 1024
    --seed 1 --log-format simple --log-interval 100
)
# Fine-tuning a converted model (FINETUNE_FROM): every parameter trains, a short warm-up to a peak below the
# from-scratch recipe's (the weights are already good); chosen by scripts/quality_study.py --conversion.
FINETUNE_ARGS=(--lr 0.0005 --warmup-updates 50)
WMT_ARGS=(--share-all-embeddings --share-decoder-input-output-embed --weight-decay 0.0 --warmup-init-lr 1e-07 --stop-min-lr 1e-09 --max-tokens 3584)

case "$RECIPE" in
    iwslt14_de_en)
        rfa_arch=rfa_transformer_iwslt_de_en; softmax_arch=transformer_iwslt_de_en
        src=de; tgt=en; max_update=50000; fp16=0
        RECIPE_ARGS=(--share-decoder-input-output-embed --dropout 0.3 --weight-decay 0.0001 --lr 0.0005
                     --max-tokens 4096) ;;
    wmt14_en_de)
        rfa_arch=rfa_transformer_wmt_en_de; softmax_arch=transformer_wmt_en_de
        src=en; tgt=de; max_update=100000; fp16=1
        RECIPE_ARGS=("${WMT_ARGS[@]}" --dropout 0.1 --lr 0.0007) ;;
    wmt14_en_de_big)
        rfa_arch=rfa_transformer_vaswani_wmt_en_de_big; softmax_arch=transformer_vaswani_wmt_en_de_big
        src=en; tgt=de; max_update=300000; fp16=1
        RECIPE_ARGS=("${WMT_ARGS[@]}" --dropout 0.3 --lr 0.0005) ;;
    wmt14_en_fr_big)
        rfa_arch=rfa_transformer_vaswani_wmt_en_fr_big; softmax_arch=transformer_vaswani_wmt_en_fr_big
        src=en; tgt=fr; max_update=300000; fp16=1
        RECIPE_ARGS=("${WMT_ARGS[@]}" --dropout 0.1 --lr 0.0005) ;;
    multi30k_en_de | multi30k_en_fr)  # one model and schedule for both Multi30k pairs
        rfa_arch=rfa_transformer; softmax_arch=transformer
        src=en; tgt=${RECIPE##*_}; max_update=10000; fp16=0
        RECIPE_ARGS=(--encoder-embed-dim 256 --encoder-ffn-embed-dim 1024 --encoder-layers 3 --encoder-attention-heads 4
                     --decoder-embed-dim 256 --decoder-ffn-embed-dim 1024 --decoder-layers 3 --decoder-attention-heads 4
                     --share-all-embeddings --share-decoder-input-output-embed --dropout 0.3 --weight-decay 0.0001 --lr 0.0005 --max-tokens 4096) ;;
    *) die "unknown RECIPE='$RECIPE' (one of: iwslt14_de_en wmt14_en_de wmt14_en_de_big wmt14_en_fr_big multi30k_en_de multi30k_en_fr)" ;;
esac

case "$MODEL" in
    rfa) config_name="$RECIPE"; ARCH="${ARCH:-$rfa_arch}" ;;
    softmax) config_name="${RECIPE}_softmax"; ARCH="${ARCH:-$softmax_arch}" ;;
    *) die "unknown MODEL='$MODEL' (rfa or softmax)" ;;
esac
SAVE_DIR="${SAVE_DIR:-checkpoints/$config_name}"
SRC_LANG="${SRC_LANG:-$src}"
TGT_LANG="${TGT_LANG:-$tgt}"
MAX_UPDATE="${MAX_UPDATE:-$max_update}"
FP16="${FP16:-$fp16}"

# ------------------------------------------------------------------ checks
[[ -n "$DATA" ]] || die "DATA is not set: DATA=/path/to/data-bin (the fairseq-preprocess --destdir); scripts/train.sh --help lists the settings"
[[ -d "$DATA" ]] || die "data directory DATA='$DATA' does not exist"
for lang in "$SRC_LANG" "$TGT_LANG"; do
    if [[ ! -f "$DATA/dict.$lang.txt" ]]; then
        found=$(cd "$DATA" && ls dict.*.txt 2>/dev/null | paste -sd ' ' - || true)
        die "no dictionary '$DATA/dict.$lang.txt' for the $SRC_LANG-$TGT_LANG pair of RECIPE=$RECIPE" \
            "(found: ${found:-none}); binarize with fairseq-preprocess, or set SRC_LANG/TGT_LANG"
    fi
done
for split in train valid; do
    [[ -f "$DATA/$split.$SRC_LANG-$TGT_LANG.$SRC_LANG.idx" || -f "$DATA/$split.$TGT_LANG-$SRC_LANG.$SRC_LANG.idx" ]] ||
        die "no '$split' split for $SRC_LANG-$TGT_LANG in DATA='$DATA' (expected $split.$SRC_LANG-$TGT_LANG.$SRC_LANG.idx)"
done
[[ -f "$USER_DIR/__init__.py" ]] || die "USER_DIR='$USER_DIR' is not the rfa_fairseq plugin package"
[[ "$MAX_UPDATE" =~ ^[0-9]+$ ]] || die "MAX_UPDATE must be a whole number, got '$MAX_UPDATE'"
[[ "$FP16" == 0 || "$FP16" == 1 ]] || die "FP16 must be 0 or 1, got '$FP16'"
# fp16 training runs on CUDA only (fairseq's fp16 optimizer on the CPU dies in torch: "Torch not compiled with CUDA")
if [[ "$FP16" == 1 ]] && ! "${PYTHON:-python3}" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    [[ -z "$FP16_GIVEN" ]] || die "FP16=1 trains in fp16, which needs a CUDA GPU, and torch sees none here: set FP16=0 (fp32)"
    echo "train.sh: torch sees no CUDA GPU: RECIPE=$RECIPE trains in fp32, not its fp16 (FP16=0 sets this; FP16=1 refuses to run without a GPU)" >&2
    FP16=0
fi

FINETUNE_CMD=()
if [[ -n "$FINETUNE_FROM" ]]; then
    [[ "$MODEL" == rfa ]] || die "FINETUNE_FROM needs MODEL=rfa (it starts from a converted rfa_transformer checkpoint), got MODEL=$MODEL"
    [[ -f "$FINETUNE_FROM" ]] || die "FINETUNE_FROM='$FINETUNE_FROM' does not exist (write it with rfa-convert-transformer --output)"
    # the checkpoint's architecture and --rfa-* options, so that the model built here is the one it holds
    source_model=$(PYTHONPATH="$(dirname "$USER_DIR")${PYTHONPATH:+:$PYTHONPATH}" "${PYTHON:-python3}" \
        -m rfa_fairseq.cli.finetune_flags "$FINETUNE_FROM") || die "cannot fine-tune from FINETUNE_FROM='$FINETUNE_FROM' (see above)"
    source_arch=$(sed -n 1p <<<"$source_model")
    [[ "$source_arch" == "$ARCH" ]] ||
        die "FINETUNE_FROM='$FINETUNE_FROM' holds a $source_arch model, but RECIPE=$RECIPE trains $ARCH; pick the recipe of the converted model (or set ARCH=$source_arch)"
    read -r -a source_flags <<<"$(sed -n 2p <<<"$source_model")"
    FINETUNE_CMD=("${source_flags[@]}" "${FINETUNE_ARGS[@]}" --finetune-from-model "$FINETUNE_FROM")
fi

CMD=(
    fairseq-train "$DATA" --user-dir "$USER_DIR" --arch "$ARCH"
    --source-lang "$SRC_LANG" --target-lang "$TGT_LANG"
    "${COMMON_ARGS[@]}" "${RECIPE_ARGS[@]}" "${FINETUNE_CMD[@]}"
    --update-freq "$UPDATE_FREQ" --max-update "$MAX_UPDATE" --stop-time-hours "$MAX_TIME_HOURS"
    --save-dir "$SAVE_DIR"
)
if [[ "$FP16" == 1 ]]; then CMD+=(--fp16); fi
CMD+=("$@")
# fairseq-train reads --bf16 as a TPU run; rfa-train's module is fairseq-train with bf16 on the GPU or CPU
if [[ " $* " == *" --bf16 "* ]]; then
    CMD=(env "PYTHONPATH=$(dirname "$USER_DIR")${PYTHONPATH:+:$PYTHONPATH}" "${PYTHON:-python3}" -m rfa_fairseq.cli.train
         "${CMD[@]:1}")
fi

if [[ "$DRY_RUN" == 1 ]]; then
    printf '%q ' "${CMD[@]}"
    echo
    exit 0
fi

command -v fairseq-train >/dev/null 2>&1 || die "fairseq-train not found on PATH (activate the environment: scripts/setup_env.sh)"
# Check the binarized data before anything is written: dictionaries, splits, equal sentence counts,
# empty or too long sentences (fairseq reports these late, vaguely, or not at all). CHECK_DATA=0 skips.
if [[ "${CHECK_DATA:-1}" == 1 ]]; then
    PYTHONPATH="$(dirname "$USER_DIR")${PYTHONPATH:+:$PYTHONPATH}" "${PYTHON:-python3}" -m rfa_fairseq.cli.check_data bin "$DATA" \
        -s "$SRC_LANG" -t "$TGT_LANG" --splits train valid --max-positions 1024 ||
        die "problems in DATA='$DATA' (listed above); fix them, or skip this check with CHECK_DATA=0"
fi
mkdir -p "$SAVE_DIR"
if [[ -f "$SAVE_DIR/checkpoint_last.pt" ]]; then
    echo "train.sh: resuming from $SAVE_DIR/checkpoint_last.pt" | tee -a "$SAVE_DIR/train.log"
fi
{ printf 'train.sh: %s: ' "$(date -u +%Y-%m-%dT%H:%M:%SZ)"; printf '%q ' "${CMD[@]}"; echo; } | tee -a "$SAVE_DIR/train.log"
"${CMD[@]}" 2>&1 | tee -a "$SAVE_DIR/train.log"
exit
}
