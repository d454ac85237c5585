#!/usr/bin/env bash
# WMT14 English-French, the corpora of fairseq's
# examples/translation/prepare-wmt14en2fr.sh, with SentencePiece.
#
#   train    Europarl v7 + Common Crawl + UN (undoc.2000) + News Commentary v9 +
#            10^9 French-English (giga-fren): ~40M pairs, ~36M after cleaning;
#            Moses punctuation normalisation, non-printing characters removed;
#            clean-corpus-n on SentencePiece pieces: ratio 1.5, 1..250 (as fairseq)
#   valid    newstest2013 (3000 sentences), from WMT13 test.tgz (fairseq holds out
#            1/1333 of train instead; newstest2013 is Vaswani et al.'s dev set)
#   test     newstest2014 "full" (3003), test-full.tgz = sacrebleu's wmt14/full
#   vocab    40,000 joint SentencePiece pieces: fairseq's BPE_TOKENS=40000, the
#            40K joint vocabulary of Ott et al. (2018) for this pair.
# Needs ~60 GB of disk and hours of CPU time (use --workers); giga-fren and UN
# dominate. Checksums: md5 of test.tgz / test-full.tgz as published by sacrebleu.
#
# Usage: prepare-wmt14en2fr.sh [options] OUT_DIR
# Then:  fairseq-train OUT_DIR/data-bin -s en -t fr ...
set -euo pipefail

RECIPE_NAME=wmt14-en-fr
DEFAULT_VOCAB_SIZE=40000
SRC=en
TGT=fr
# "URL|MD5|PREFIX|SUFFIX": the corpus is PREFIX.<lang>SUFFIX inside the archive.
TRAIN_SOURCES=(
    "https://statmt.org/wmt13/training-parallel-europarl-v7.tgz||training/europarl-v7.fr-en|"
    "https://statmt.org/wmt13/training-parallel-commoncrawl.tgz||commoncrawl.fr-en|"
    "https://statmt.org/wmt13/training-parallel-un.tgz||un/undoc.2000.fr-en|"
    "https://statmt.org/wmt14/training-parallel-nc-v9.tgz||training/news-commentary-v9.fr-en|"
    "https://statmt.org/wmt10/training-giga-fren.tar||giga-fren.release2.fixed|.gz"
)
# "URL|MD5|SRC_MEMBER|TGT_MEMBER"
VALID_SOURCE="https://statmt.org/wmt13/test.tgz|48eca5d02f637af44e85186847141f67|test/newstest2013-src.en.sgm|test/newstest2013-src.fr.sgm"
TEST_SOURCE="https://statmt.org/wmt14/test-full.tgz|a8cd784e006feb32ac6f3d9ec7eb389a|test-full/newstest2014-fren-src.en.sgm|test-full/newstest2014-fren-ref.fr.sgm"
SPM_CHARACTER_COVERAGE=0.9999
# Sentences sampled for SentencePiece training (of ~80M en+fr lines): plenty for
# 40K pieces, and keeps the trainer's memory and time moderate.
SPM_INPUT_SENTENCE_SIZE=${SPM_INPUT_SENTENCE_SIZE:-2000000}

source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/common.sh"

usage() {
    echo "Usage: $(basename "$0") [options] OUT_DIR"
    echo "Prepare WMT14 en-fr (Europarl v7, Common Crawl, UN, News Commentary v9, giga-fren;"
    echo "newstest2013 valid; newstest2014 test) as binarized fairseq data in OUT_DIR/data-bin."
    common_usage
}

parse_common_args "$@"
check_tools
wmt14_pipeline
