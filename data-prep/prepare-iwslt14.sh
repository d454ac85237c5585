#!/usr/bin/env bash
# IWSLT14 German-English (TED), the split of fairseq's
# examples/translation/prepare-iwslt14.sh, with SentencePiece instead of Moses+BPE.
#
#   source   de-en.tgz (IWSLT 2014 release, fairseq's mirror; no checksum published)
#   train    train.tags.de-en.{de,en}: metadata lines dropped (<url>, <talkid>,
#            <keywords>, <speaker>, ...), <title>/<description> tags stripped with
#            their text kept (as fairseq); cleaned like clean-corpus-n.perl on Moses
#            tokens (ratio 1.5, 1..175 tokens); then lowercased
#   valid    every 23rd pair of the cleaned train data (held out of train)
#   test     IWSLT14.TED.dev2010 + IWSLT14.TEDX.dev2012 + IWSLT14.TED.tst2010..tst2012
#            <seg> lines (fairseq's standard 6750-sentence test set), lowercased
#   vocab    10,000 joint SentencePiece pieces: the size of fairseq's joint BPE
#            (BPE_TOKENS=10000) for this recipe
#
# Expected sizes with the real data (fairseq): ~160k train, 7283 valid, 6750 test.
# The text is lowercased, so test.raw.en is the lowercased reference (the recipe's
# evaluation setting); SentencePiece decodes hypotheses back to untokenized text.
#
# Usage: prepare-iwslt14.sh [options] OUT_DIR
# Then:  fairseq-train OUT_DIR/data-bin -s de -t en ...
set -euo pipefail

RECIPE_NAME=iwslt14-de-en
DEFAULT_VOCAB_SIZE=10000
SRC=de
TGT=en
URL=https://dl.fbaipublicfiles.com/fairseq/data/iwslt14/de-en.tgz
TEST_SETS=(IWSLT14.TED.dev2010 IWSLT14.TEDX.dev2012 IWSLT14.TED.tst2010 IWSLT14.TED.tst2011 IWSLT14.TED.tst2012)
CLEAN_RATIO=1.5
CLEAN_MAX_TOKENS=175
VALID_EVERY=23

source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/common.sh"

usage() {
    echo "Usage: $(basename "$0") [options] OUT_DIR"
    echo "Prepare IWSLT14 de-en ($URL) as binarized fairseq data in OUT_DIR/data-bin."
    common_usage
}

parse_common_args "$@"
check_tools
claim_output_dir "$SRC" "$TGT"

MEMBERS=("de-en/train.tags.de-en.$SRC" "de-en/train.tags.de-en.$TGT")
for set_name in "${TEST_SETS[@]}"; do
    MEMBERS+=("de-en/$set_name.de-en.$SRC.xml" "de-en/$set_name.de-en.$TGT.xml")
done

fetch "$URL"
extract de-en.tgz "${MEMBERS[@]}"

W=$WORK_DIR
run_step train-tags py build-parallel --src-lang $SRC --tgt-lang $TGT --iwslt-tags --remove-nonprint \
    --workers "$WORKERS" --out-src "$W/train.tags.$SRC" --out-tgt "$W/train.tags.$TGT" \
    "$ORIG_DIR/de-en/train.tags.de-en.$SRC" "$ORIG_DIR/de-en/train.tags.de-en.$TGT"

run_step train-clean py clean --count moses --src-lang $SRC --tgt-lang $TGT \
    --ratio $CLEAN_RATIO --min-len 1 --max-len $CLEAN_MAX_TOKENS --lowercase-output --workers "$WORKERS" \
    --in-src "$W/train.tags.$SRC" --in-tgt "$W/train.tags.$TGT" \
    --out-src "$W/train.clean.$SRC" --out-tgt "$W/train.clean.$TGT"

run_step split-valid py split-every --every $VALID_EVERY \
    --in-src "$W/train.clean.$SRC" --in-tgt "$W/train.clean.$TGT" \
    --rest-src "$W/train.$SRC" --rest-tgt "$W/train.$TGT" \
    --held-src "$W/valid.$SRC" --held-tgt "$W/valid.$TGT"

TEST_INPUTS=()
for set_name in "${TEST_SETS[@]}"; do
    TEST_INPUTS+=("$ORIG_DIR/de-en/$set_name.de-en.$SRC.xml" "$ORIG_DIR/de-en/$set_name.de-en.$TGT.xml")
done
# The model input and the reference are the same text here: the recipe's own
# lowercased test set.
run_step test-text py build-parallel --src-lang $SRC --tgt-lang $TGT --segs --xml-unescape \
    --remove-nonprint --fix-apostrophe --lowercase \
    --out-src "$OUT/test.raw.$SRC" --out-tgt "$OUT/test.raw.$TGT" "${TEST_INPUTS[@]}"

# no cleaning of the pieces: train was cleaned on Moses tokens above, as fairseq does
subword_and_binarize "$OUT/test.raw"
