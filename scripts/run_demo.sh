#!/usr/bin/env bash
# The main job, end to end on the embedded synthetic corpus:
#   set up .venv -> write corpus -> fairseq-preprocess -> score an untrained
#   rfa_transformer -> fairseq-train a tiny rfa_transformer -> fairseq-generate --beam 4
#   -> sacrebleu, printing both BLEU figures and where the outputs are.
#
#   bash scripts/run_demo.sh                 # outputs in outputs/demo (RFA_DEMO_DIR overrides)
#
# Idempotent: finished steps are skipped on a re-run (each leaves a .done marker only
# after its outputs are complete); an interrupted step is redone from scratch.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WORK="${RFA_DEMO_DIR:-$REPO/outputs/demo}"
MAX_UPDATE="${RFA_DEMO_UPDATES:-300}"
BEAM=4
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"

die() { echo "run_demo.sh: error: $*" >&2; exit 1; }
step_done() { [[ -f "$WORK/.$1.done" ]]; }
mark_done() { touch "$WORK/.$1.done"; }
START=$SECONDS

bash "$REPO/scripts/setup_env.sh" || die "environment set-up failed"
# shellcheck disable=SC1091
source "${RFA_VENV:-$REPO/.venv}/bin/activate"
mkdir -p "$WORK"
PLUGIN="$REPO/rfa_fairseq"

MODEL_ARGS=(
    --arch rfa_transformer --share-all-embeddings
    --encoder-layers 2 --decoder-layers 2 --encoder-embed-dim 128 --decoder-embed-dim 128
    --encoder-ffn-embed-dim 256 --decoder-ffn-embed-dim 256
    --encoder-attention-heads 4 --decoder-attention-heads 4
)
TRAIN_ARGS=(
    --optimizer adam --adam-betas "(0.9,0.98)" --lr 2e-3 --lr-scheduler inverse_sqrt --warmup-updates 150
    --criterion label_smoothed_cross_entropy --label-smoothing 0.1 --dropout 0.1
    --max-tokens 4096 --num-workers 0 --seed 1 --log-format simple --log-interval 50
    --no-epoch-checkpoints
)

# 1. corpus
if ! step_done corpus; then
    rm -rf "$WORK/raw"
    python "$REPO/data-prep/make_synthetic_corpus.py" "$WORK/raw" || die "corpus generation failed"
    mark_done corpus
fi

# 2. binarize
if ! step_done preprocess; then
    rm -rf "$WORK/data-bin"
    fairseq-preprocess --source-lang src --target-lang tgt \
        --trainpref "$WORK/raw/train" --validpref "$WORK/raw/valid" --testpref "$WORK/raw/test" \
        --destdir "$WORK/data-bin" --joined-dictionary --workers 2 >"$WORK/preprocess.log" 2>&1 ||
        die "fairseq-preprocess failed, see $WORK/preprocess.log"
    mark_done preprocess
fi

# generate NAME CHECKPOINT: beam search on the test set, hypotheses in id order, BLEU
generate_and_score() {
    local name="$1" checkpoint="$2"
    fairseq-generate "$WORK/data-bin" --user-dir "$PLUGIN" --path "$checkpoint" --gen-subset test \
        --beam "$BEAM" --batch-size 128 --max-len-b 40 --required-batch-size-multiple 1 >"$WORK/$name.generate.log" 2>&1 ||
        die "fairseq-generate failed, see $WORK/$name.generate.log"
    grep '^H-' "$WORK/$name.generate.log" | sed 's/^H-//' | sort -n -k1,1 | cut -f3 >"$WORK/$name.hyp.tmp"
    local n_hyp n_ref
    n_hyp=$(wc -l <"$WORK/$name.hyp.tmp")
    n_ref=$(wc -l <"$WORK/raw/test.tgt")
    [[ "$n_hyp" == "$n_ref" ]] || die "$name: $n_hyp hypotheses for $n_ref references ($WORK/$name.generate.log)"
    mv "$WORK/$name.hyp.tmp" "$WORK/$name.hyp"
    sacrebleu "$WORK/raw/test.tgt" -i "$WORK/$name.hyp" -m bleu -b -w 2 >"$WORK/$name.bleu" ||
        die "sacrebleu failed on $WORK/$name.hyp"
}

# 3. untrained model: the same architecture after zero learning (lr 0 for one step)
if ! step_done untrained; then
    rm -rf "$WORK/untrained"
    fairseq-train "$WORK/data-bin" --user-dir "$PLUGIN" "${MODEL_ARGS[@]}" "${TRAIN_ARGS[@]}" \
        --lr-scheduler fixed --lr 0 --max-update 1 --save-dir "$WORK/untrained" \
        >"$WORK/untrained.train.log" 2>&1 || die "fairseq-train (untrained) failed, see $WORK/untrained.train.log"
    generate_and_score untrained "$WORK/untrained/checkpoint_last.pt"
    mark_done untrained
fi

# 4. train
if ! step_done train; then
    rm -rf "$WORK/checkpoints"
    echo "run_demo.sh: training rfa_transformer for $MAX_UPDATE updates (log: $WORK/train.log)"
    fairseq-train "$WORK/data-bin" --user-dir "$PLUGIN" "${MODEL_ARGS[@]}" "${TRAIN_ARGS[@]}" \
        --max-update "$MAX_UPDATE" --save-dir "$WORK/checkpoints" >"$WORK/train.log" 2>&1 ||
        die "fairseq-train failed, see $WORK/train.log"
    mark_done train
fi

# 5. decode and score
if ! step_done trained; then
    generate_and_score trained "$WORK/checkpoints/checkpoint_last.pt"
    mark_done trained
fi

UNTRAINED=$(cat "$WORK/untrained.bleu")
TRAINED=$(cat "$WORK/trained.bleu")
cat <<EOF

=== rfa_transformer demo (synthetic EN->XX, test set, beam $BEAM, sacreBLEU) ===
BLEU untrained: $UNTRAINED
BLEU trained:   $TRAINED   ($MAX_UPDATE updates)
hypotheses:     $WORK/trained.hyp   (references: $WORK/raw/test.tgt)
generate log:   $WORK/trained.generate.log
checkpoint:     $WORK/checkpoints/checkpoint_last.pt
wall time:      $((SECONDS - START)) s
EOF
python - "$UNTRAINED" "$TRAINED" <<'EOF' || die "the trained model does not clearly beat the untrained one"
import sys
untrained, trained = map(float, sys.argv[1:])
sys.exit(0 if trained >= untrained + 20 else 1)
EOF
