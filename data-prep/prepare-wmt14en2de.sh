#!/usr/bin/env bash
# WMT14 English-German, the Vaswani et al. (2017) setup as in fairseq's
# examples/translation/prepare-wmt14en2de.sh --icml17, with SentencePiece.
#
#   train    Europarl v7 + Common Crawl + News Commentary v9 (~4.5M pairs);
#            Moses punctuation normalisation, non-printing characters removed;
#            clean-corpus-n on SentencePiece pieces: ratio 1.5, 1..250 (as fairseq)
#   valid    newstest2013 (3000 sentences), from WMT13 test.tgz, as Vaswani et al.
#   test     newstest2014 "full" (3003), test-full.tgz = sacrebleu's wmt14/full
#   vocab    32,000 joint SentencePiece pieces: the 32K joint vocabulary of Ott et
#            al. (2018, "Scaling NMT"), the fairseq setup the RFA paper builds on
#            (Vaswani et al. used ~37K shared BPE; fairseq's script uses 40K).
#   scoring  sacreBLEU against test.raw.de, plus `rfa-score --compound-split` for
#            the tokenized, compound-split BLEU that the papers report.
# Checksums: md5 of test.tgz and test-full.tgz as published in sacrebleu's dataset
# registry; none is published for the training archives (integrity is checked).
#
# Usage: prepare-wmt14en2de.sh [options] OUT_DIR
# Then:  fairseq-train OUT_DIR/data-bin -s en -t de ...
set -euo pipefail

RECIPE_NAME=wmt14-en-de
DEFAULT_VOCAB_SIZE=32000
SRC=en
TGT=de
# "URL|MD5|PREFIX|SUFFIX": the corpus is PREFIX.<lang>SUFFIX inside the archive.
TRAIN_SOURCES=(
    "https://statmt.org/wmt13/training-parallel-europarl-v7.tgz||training/europarl-v7.de-en|"
    "https://statmt.org/wmt13/training-parallel-commoncrawl.tgz||commoncrawl.de-en|"
    "https://statmt.org/wmt14/training-parallel-nc-v9.tgz||training/news-commentary-v9.de-en|"
)
# "URL|MD5|SRC_MEMBER|TGT_MEMBER"
VALID_SOURCE="https://statmt.org/wmt13/test.tgz|48eca5d02f637af44e85186847141f67|test/newstest2013-src.en.sgm|test/newstest2013-src.de.sgm"
TEST_SOURCE="https://statmt.org/wmt14/test-full.tgz|a8cd784e006feb32ac6f3d9ec7eb389a|test-full/newstest2014-deen-src.en.sgm|test-full/newstest2014-deen-ref.de.sgm"
# Common Crawl holds stray noise characters: cover 99.99% of characters, not all.
SPM_CHARACTER_COVERAGE=0.9999
# Sentences sampled for SentencePiece training (of ~9M en+de lines): plenty for
# 32K pieces, and keeps the trainer's memory and time moderate.
SPM_INPUT_SENTENCE_SIZE=${SPM_INPUT_SENTENCE_SIZE:-2000000}

source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/common.sh"

usage() {
    echo "Usage: $(basename "$0") [options] OUT_DIR"
    echo "Prepare WMT14 en-de (Europarl v7, Common Crawl, News Commentary v9; newstest2013"
    echo "valid; newstest2014 test) as binarized fairseq data in OUT_DIR/data-bin."
    common_usage
}

parse_common_args "$@"
check_tools
wmt14_pipeline
