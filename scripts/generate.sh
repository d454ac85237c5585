#!/usr/bin/env bash
# Translate a test set with fairseq-generate using paper-style decoding and write
# the detokenized hypotheses, ready for scripts/score.sh.
#
#   scripts/generate.sh --data-bin PREP/data-bin --checkpoint-dir CKPTS --recipe wmt14-en-de \
#       --average-last 5 --output RESULTS/test.hyp.de
#   scripts/score.sh --hyp RESULTS/test.hyp.de --ref PREP/test.raw.de --compound-split
#
# Decoding: beam 4 and length penalty 0.6 for WMT14 (Vaswani et al. 2017; fairseq's
# scaling_nmt recipe), length penalty 1.0 otherwise; output length <= 1 * source + 50
# (Vaswani et al.). Hypotheses are post-processed by fairseq-generate --post-process: sentencepiece
# when the data has a SentencePiece model (--spm-model, default DATA_BIN/../spm.model, as the data-prep
# scripts write it), else none (plain tokens, e.g. the demo's data); --post-process X picks another
# (subword_nmt for BPE '@@ ' data, ...).
# Optionally the last N epoch (or update) checkpoints are averaged first
# (rfa_fairseq/cli/average_checkpoints.py). The RFA plugin is loaded with --user-dir.
#
# Outputs, each written under a temporary name and renamed when complete:
#   OUTPUT                 hypotheses, one per line, in test-set order
#   OUTPUT.generate.log    the full fairseq-generate output (S-/T-/H-/D- lines)
#   CKPTS/checkpoint.avg_last<N>[_updates].pt   the averaged model, when averaging
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

# ------------------------------------------------------------------ settings (options override)
DATA_BIN=""               # binarized data: <prepare-*.sh OUT>/data-bin
CHECKPOINT=""             # checkpoint file; default CHECKPOINT_DIR/checkpoint_best.pt
CHECKPOINT_DIR=""
RECIPE=""                 # iwslt14 | wmt14-en-de | wmt14-en-fr | multi30k, or a configs/ name (sets LENPEN)
BEAM=4
LENPEN=""                 # default from RECIPE: 0.6 for wmt14-*, else 1.0
MAX_LEN_A=1               # max output length = MAX_LEN_A * source length + MAX_LEN_B
MAX_LEN_B=50
AVERAGE_LAST=0            # average the last N epoch checkpoints (0: no averaging)
AVERAGE_LAST_UPDATES=0    # ... or the last N update checkpoints (checkpoint_<E>_<U>.pt)
SUBSET=test
SRC_LANG=""               # default: fairseq infers the pair from DATA_BIN
TGT_LANG=""
MAX_TOKENS=4096
SPM_MODEL=""              # default: DATA_BIN/../spm.model
POST_PROCESS=auto         # auto: sentencepiece with an SPM model, else none; or any fairseq --post-process value
USER_DIR="$REPO/rfa_fairseq"
USE_CPU=0
OUTPUT=""
PYTHON="${PYTHON:-python3}"
EXTRA_ARGS=()             # after "--": passed to fairseq-generate unchanged

die() { echo "generate.sh: error: $*" >&2; exit 1; }

usage() {
    cat <<EOF
Usage: $(basename "$0") --data-bin DIR (--checkpoint-dir DIR | --checkpoint FILE) --output FILE [options] [-- FAIRSEQ_ARGS]
  --recipe R              iwslt14 | wmt14-en-de | wmt14-en-fr | multi30k (length penalty)
  --beam N                beam size (default $BEAM)
  --lenpen X              length penalty (default: 0.6 for wmt14-*, 1.0 otherwise)
  --average-last N        average the last N epoch checkpoints of --checkpoint-dir first
  --average-last-updates N  average the last N update checkpoints instead
  --subset S              split to translate (default $SUBSET)
  --source-lang L, --target-lang L
  --max-tokens N          batch size in tokens (default $MAX_TOKENS)
  --post-process P        fairseq-generate --post-process: sentencepiece, subword_nmt, none, ...
                          (default auto: sentencepiece when a SentencePiece model is found, else none)
  --spm-model FILE        SentencePiece model (default: DATA_BIN/../spm.model, when it exists)
  --user-dir DIR          fairseq plugin (default $USER_DIR); --no-user-dir for plain fairseq models
  --cpu                   decode on the CPU
EOF
}

need_value() { [[ $# -ge 2 && -n $2 ]] || die "$1 needs a value"; }
while (($#)); do
    case $1 in
        --data-bin) need_value "$@"; DATA_BIN=$2; shift 2 ;;
        --checkpoint) need_value "$@"; CHECKPOINT=$2; shift 2 ;;
        --checkpoint-dir) need_value "$@"; CHECKPOINT_DIR=$2; shift 2 ;;
        --recipe) need_value "$@"; RECIPE=$2; shift 2 ;;
        --beam) need_value "$@"; BEAM=$2; shift 2 ;;
        --lenpen) need_value "$@"; LENPEN=$2; shift 2 ;;
        --average-last) need_value "$@"; AVERAGE_LAST=$2; shift 2 ;;
        --average-last-updates) need_value "$@"; AVERAGE_LAST_UPDATES=$2; shift 2 ;;
        --subset) need_value "$@"; SUBSET=$2; shift 2 ;;
        --source-lang) need_value "$@"; SRC_LANG=$2; shift 2 ;;
        --target-lang) need_value "$@"; TGT_LANG=$2; shift 2 ;;
        --max-tokens) need_value "$@"; MAX_TOKENS=$2; shift 2 ;;
        --spm-model) need_value "$@"; SPM_MODEL=$2; shift 2 ;;
        --post-process) need_value "$@"; POST_PROCESS=$2; shift 2 ;;
        --user-dir) need_value "$@"; USER_DIR=$2; shift 2 ;;
        --no-user-dir) USER_DIR=""; shift ;;
        --cpu) USE_CPU=1; shift ;;
        --output) need_value "$@"; OUTPUT=$2; shift 2 ;;
        -h | --help) usage; exit 0 ;;
        --) shift; EXTRA_ARGS=("$@"); break ;;
        *) usage >&2; die "unknown argument '$1'" ;;
    esac
done

# ------------------------------------------------------------------ checks
[[ -n $DATA_BIN ]] || die "--data-bin is required"
[[ -n $OUTPUT ]] || die "--output is required"
[[ -d $DATA_BIN ]] || die "data directory not found: $DATA_BIN"
compgen -G "$DATA_BIN/dict.*.txt" >/dev/null || die "no dict.*.txt in $DATA_BIN: not a fairseq-preprocess output"
for number in "$BEAM" "$AVERAGE_LAST" "$AVERAGE_LAST_UPDATES" "$MAX_TOKENS"; do
    [[ $number =~ ^[0-9]+$ ]] || die "expected a non-negative integer, got '$number'"
done
((BEAM >= 1)) || die "--beam must be >= 1"
((AVERAGE_LAST == 0 || AVERAGE_LAST_UPDATES == 0)) || die "use --average-last or --average-last-updates, not both"
# Also accepts the config names of scripts/train.sh (wmt14_en_de_big, iwslt14_de_en, ...).
case $RECIPE in
    wmt14-en-de | wmt14-en-fr | wmt14_en_de* | wmt14_en_fr*) DEFAULT_LENPEN=0.6 ;;
    iwslt14 | iwslt14_de_en* | multi30k | multi30k_en_* | "") DEFAULT_LENPEN=1.0 ;;
    *) die "unknown --recipe '$RECIPE' (iwslt14, wmt14-en-de, wmt14-en-fr, multi30k or a configs/ name)" ;;
esac
LENPEN=${LENPEN:-$DEFAULT_LENPEN}
[[ $LENPEN =~ ^[0-9]*\.?[0-9]+$ ]] || die "--lenpen must be a number, got '$LENPEN'"
if [[ -n $SPM_MODEL ]]; then
    [[ -f $SPM_MODEL ]] || die "SentencePiece model not found: $SPM_MODEL (--spm-model)"
elif [[ -f $(dirname "$DATA_BIN")/spm.model ]]; then
    SPM_MODEL=$(dirname "$DATA_BIN")/spm.model
fi
case $POST_PROCESS in
    auto)
        if [[ -n $SPM_MODEL ]]; then
            POST_PROCESS=sentencepiece
        else
            POST_PROCESS=none
            echo "generate.sh: no SentencePiece model ($(dirname "$DATA_BIN")/spm.model, --spm-model): hypotheses are written as the model's tokens (--post-process none)" >&2
        fi ;;
    sentencepiece | wordpiece | letter | silence | _EOW | subword_nmt | @@ | "@@ " | none) ;;
    *) die "unknown --post-process '$POST_PROCESS' (auto, sentencepiece, subword_nmt, @@, wordpiece, letter, _EOW, silence or none)" ;;
esac
if [[ -n $USER_DIR ]]; then
    [[ -f $USER_DIR/__init__.py ]] || die "plugin directory not found: $USER_DIR (use --user-dir, or --no-user-dir)"
fi
command -v "$PYTHON" >/dev/null 2>&1 || die "Python interpreter '$PYTHON' not found (set PYTHON=...)"

if ((AVERAGE_LAST > 0 || AVERAGE_LAST_UPDATES > 0)); then
    [[ -n $CHECKPOINT_DIR ]] || die "averaging needs --checkpoint-dir"
    [[ -z $CHECKPOINT ]] || die "averaging builds its own checkpoint: drop --checkpoint"
    [[ -d $CHECKPOINT_DIR ]] || die "checkpoint directory not found: $CHECKPOINT_DIR"
    if ((AVERAGE_LAST > 0)); then
        CHECKPOINT=$CHECKPOINT_DIR/checkpoint.avg_last${AVERAGE_LAST}.pt
        AVERAGE_ARGS=(--num-epoch-checkpoints "$AVERAGE_LAST")
    else
        CHECKPOINT=$CHECKPOINT_DIR/checkpoint.avg_last${AVERAGE_LAST_UPDATES}_updates.pt
        AVERAGE_ARGS=(--num-update-checkpoints "$AVERAGE_LAST_UPDATES")
    fi
    # Always re-averaged: the checkpoints may have changed since the last run.
    PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -m rfa_fairseq.cli.average_checkpoints \
        --inputs "$CHECKPOINT_DIR" "${AVERAGE_ARGS[@]}" --output "$CHECKPOINT" ||
        die "checkpoint averaging failed"
elif [[ -z $CHECKPOINT ]]; then
    [[ -n $CHECKPOINT_DIR ]] || die "give --checkpoint FILE or --checkpoint-dir DIR"
    CHECKPOINT=$CHECKPOINT_DIR/checkpoint_best.pt
fi
[[ -f $CHECKPOINT ]] || die "checkpoint not found: $CHECKPOINT"

# ------------------------------------------------------------------ generate
GENERATE_ARGS=(
    "$DATA_BIN" --path "$CHECKPOINT" --gen-subset "$SUBSET"
    --beam "$BEAM" --lenpen "$LENPEN" --max-len-a "$MAX_LEN_A" --max-len-b "$MAX_LEN_B"
    --max-tokens "$MAX_TOKENS" --required-batch-size-multiple 1
    --post-process "$POST_PROCESS"
)
[[ -n $USER_DIR ]] && GENERATE_ARGS+=(--user-dir "$USER_DIR")
[[ -n $SRC_LANG ]] && GENERATE_ARGS+=(--source-lang "$SRC_LANG")
[[ -n $TGT_LANG ]] && GENERATE_ARGS+=(--target-lang "$TGT_LANG")
((USE_CPU)) && GENERATE_ARGS+=(--cpu)
GENERATE_ARGS+=("${EXTRA_ARGS[@]}")

# fairseq-generate, with the classes fairseq checkpoints pickle allowlisted for
# torch's weights_only loading (torch >= 2.6); the loader itself stays safe. The
# plugin allowlists its own classes on import; this also covers plain fairseq models.
LAUNCHER='
import argparse, sys
try:
    import torch
    from fairseq_cli import generate
except ImportError as exc:
    sys.exit(f"generate.sh: error: fairseq is not importable by {sys.executable} ({exc}); activate its environment")
torch.serialization.add_safe_globals([argparse.Namespace])
fairseq_main = generate.main
def main(args):
    try:  # importable once fairseq has loaded --user-dir
        from rfa_fairseq.checkpoints import allowlist_checkpoint_classes
    except ImportError:
        pass
    else:
        allowlist_checkpoint_classes()
    return fairseq_main(args)
generate.main = main
sys.argv[0] = "fairseq-generate"
generate.cli_main()
'

mkdir -p "$(dirname "$OUTPUT")"
LOG=$OUTPUT.generate.log
echo "generate.sh: fairseq-generate ${GENERATE_ARGS[*]}" >&2
"$PYTHON" -c "$LAUNCHER" "${GENERATE_ARGS[@]}" >"$LOG.tmp" 2>&1 || {
    tail -n 30 "$LOG.tmp" >&2
    die "fairseq-generate failed (full log: $LOG.tmp)"
}
mv -f "$LOG.tmp" "$LOG"

# Every source sentence (S- line) must have a hypothesis, or scoring would misalign.
N_SOURCES=$(grep -c '^S-' "$LOG" || true)
# Run as a file, not -m: importing the rfa_fairseq package would import fairseq (seconds).
SPM_ARGS=()
[[ $POST_PROCESS == sentencepiece && -n $SPM_MODEL ]] && SPM_ARGS=(--spm-model "$SPM_MODEL")
"$PYTHON" "$REPO/rfa_fairseq/cli/scoring.py" \
    --generate-output "$LOG" "${SPM_ARGS[@]}" --save-hyp "$OUTPUT.tmp" --extract-only ||
    die "could not extract hypotheses from $LOG"
N_HYPS=$(wc -l <"$OUTPUT.tmp")
if [[ $N_HYPS != "$N_SOURCES" ]]; then
    rm -f "$OUTPUT.tmp"
    die "$LOG has $N_SOURCES source sentences but $N_HYPS hypotheses"
fi
mv -f "$OUTPUT.tmp" "$OUTPUT"
echo "generate.sh: wrote $N_HYPS hypotheses to $OUTPUT (beam $BEAM, lenpen $LENPEN, --post-process $POST_PROCESS, checkpoint $CHECKPOINT)" >&2
