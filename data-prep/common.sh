# Shared helpers for data-prep/prepare-*.sh. Sourced, not executed.
#
# A recipe sets RECIPE_NAME, DEFAULT_VOCAB_SIZE and the usage text, sources this
# file, calls parse_common_args "$@", then runs its own download and text steps
# with run_step and ends with subword_and_binarize (SentencePiece, fairseq-preprocess,
# summary), which every recipe shares.
#
# Layout of the output directory <out>:
#   download/   archives (or symlinks into --mirror), verified
#   orig/       members extracted from the archives
#   work/       intermediate text (normalised, cleaned, split)
#   .done/      one <step>.done marker per finished step
#   spm.model spm.vocab  {train,valid,test}.spm.<lang>  test.raw.<lang>
#   fairseq.dict.txt  data-bin/  summary.txt
#
# Every step writes under temporary names and renames on success, then writes
# its marker; re-running skips steps with a marker. Once a step runs, all later
# steps run again too, so their outputs never mix old and new inputs.

DATA_PREP_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
TEXTPREP="$DATA_PREP_DIR/textprep.py"

log() { printf '[%s] %s\n' "$(date '+%H:%M:%S')" "$*" >&2; }
err() { printf 'ERROR: %s\n' "$*" >&2; }
die() { err "$*"; exit 1; }

# ------------------------------------------------------------------ options

OUT=""
MIRROR="${RFA_DATA_MIRROR:-}"   # directory holding copies of the downloads, by URL basename
WORKERS=1
VOCAB_SIZE=""
SPM_MODEL_TYPE=unigram
VERIFY_PUBLISHED=1             # published checksums / line counts (off for synthetic mirrors)
PYTHON="${PYTHON:-python3}"

common_usage() {
    cat <<EOF
Common options:
  --mirror DIR        offline: take every download from DIR (files named like the
                      URLs' basenames) instead of the network [env RFA_DATA_MIRROR]
  --vocab-size N      joint SentencePiece vocabulary size (default ${DEFAULT_VOCAB_SIZE})
  --spm-model-type T  unigram (default) or bpe
  --workers N         processes for text processing and fairseq-preprocess (default 1)
  --no-checksum       skip published checksums / line counts (for re-packed or
                      synthetic mirrors; archive integrity is still checked)
  -h, --help          this help
Environment: PYTHON (interpreter with sentencepiece + sacremoses; default python3).
EOF
}

# parse_common_args "$@": a recipe may define recipe_option NAME VALUE, which
# returns 0 and sets RECIPE_SHIFT (1 or 2) when it consumes the option.
parse_common_args() {
    while (($#)); do
        case $1 in
            -h | --help) usage; exit 0 ;;
            --mirror) [[ $# -ge 2 ]] || die "--mirror needs a directory"; MIRROR=$2; shift 2 ;;
            --vocab-size) [[ ${2-} =~ ^[0-9]+$ ]] || die "--vocab-size needs a positive integer"; VOCAB_SIZE=$2; shift 2 ;;
            --spm-model-type) [[ ${2-} == unigram || ${2-} == bpe ]] || die "--spm-model-type must be unigram or bpe"; SPM_MODEL_TYPE=$2; shift 2 ;;
            --workers) [[ ${2-} =~ ^[1-9][0-9]*$ ]] || die "--workers needs a positive integer"; WORKERS=$2; shift 2 ;;
            --no-checksum) VERIFY_PUBLISHED=0; shift ;;
            -*)
                if declare -F recipe_option >/dev/null && recipe_option "$1" "${2-}"; then
                    shift "$RECIPE_SHIFT"
                else
                    die "unknown option '$1' (see --help)"
                fi
                ;;
            *) [[ -z $OUT ]] || die "more than one output directory given ('$OUT', '$1')"; OUT=$1; shift ;;
        esac
    done
    [[ -n $OUT ]] || { usage >&2; die "no output directory given"; }
    VOCAB_SIZE=${VOCAB_SIZE:-$DEFAULT_VOCAB_SIZE}
    if [[ -n $MIRROR ]]; then
        [[ -d $MIRROR ]] || die "mirror directory not found: $MIRROR"
        MIRROR=$(cd "$MIRROR" && pwd)
    fi
    mkdir -p "$OUT" || die "cannot create output directory $OUT"
    OUT=$(cd "$OUT" && pwd)
    DL_DIR=$OUT/download
    ORIG_DIR=$OUT/orig
    WORK_DIR=$OUT/work
    STATE_DIR=$OUT/.done
    mkdir -p "$DL_DIR" "$ORIG_DIR" "$WORK_DIR" "$STATE_DIR"
}

# ------------------------------------------------------------------ tools

# check_tools: fail before any work if a required tool or module is absent.
check_tools() {
    command -v "$PYTHON" >/dev/null 2>&1 || die "Python interpreter '$PYTHON' not found (set PYTHON=...)"
    local module
    for module in sentencepiece sacremoses regex; do
        "$PYTHON" -c "import $module" 2>/dev/null ||
            die "Python module '$module' not importable by $PYTHON (pip install $module)"
    done
    command -v fairseq-preprocess >/dev/null 2>&1 ||
        die "fairseq-preprocess not found on PATH (install fairseq, or put its bin/ directory first on PATH)"
    local tool
    for tool in tar gzip md5sum; do
        command -v "$tool" >/dev/null 2>&1 || die "required tool '$tool' not found on PATH"
    done
}

py() { "$PYTHON" "$TEXTPREP" "$@"; }

# ------------------------------------------------------------------ steps

CURRENT_STEP=""
RERUN_REST=0

on_exit() {
    local rc=$?
    if ((rc != 0)) && [[ -n $CURRENT_STEP ]]; then
        err "step '$CURRENT_STEP' failed (exit $rc); fix the cause and re-run: finished steps are skipped"
    fi
}
trap on_exit EXIT

mark_done() {
    : >"$STATE_DIR/$1.done.tmp"
    mv -f "$STATE_DIR/$1.done.tmp" "$STATE_DIR/$1.done"
}

# run_step NAME COMMAND...: run COMMAND unless NAME finished earlier.
run_step() {
    local name=$1
    shift
    if ((RERUN_REST == 0)) && [[ -f $STATE_DIR/$name.done ]]; then
        log "skip $name (done)"
        return 0
    fi
    RERUN_REST=1
    rm -f "$STATE_DIR/$name.done"
    log "step $name"
    CURRENT_STEP=$name
    "$@"
    mark_done "$name"
    CURRENT_STEP=""
}

# ------------------------------------------------------------------ downloads

# verify_file PATH NAME [MD5]: non-empty, archive integrity, published checksum.
verify_file() {
    local path=$1 name=$2 md5=${3-}
    if [[ ! -s $path ]]; then
        err "$name is missing or empty ($path)"
        return 1
    fi
    case $name in
        *.tgz | *.tar.gz)
            if ! tar -tzf "$path" >/dev/null 2>&1; then
                err "$name is corrupt or truncated: 'tar -tzf $path' failed"
                return 1
            fi
            ;;
        *.tar)
            if ! tar -tf "$path" >/dev/null 2>&1; then
                err "$name is corrupt or truncated: 'tar -tf $path' failed"
                return 1
            fi
            ;;
        *.gz)
            if ! gzip -t "$path" 2>/dev/null; then
                err "$name is corrupt or truncated: 'gzip -t $path' failed"
                return 1
            fi
            ;;
    esac
    if [[ -n $md5 ]] && ((VERIFY_PUBLISHED)); then
        local actual
        actual=$(md5sum <"$path" | cut -d' ' -f1)
        if [[ $actual != "$md5" ]]; then
            err "$name checksum mismatch: md5 $actual, published $md5 ($path); use --no-checksum only for deliberately re-packed copies"
            return 1
        fi
    fi
}

download() {
    local url=$1 dest=$2
    if command -v curl >/dev/null 2>&1; then
        # --fail: HTTP errors are errors; curl also fails on a short transfer. A stalled transfer
        # (under 1 KB/s for 2 minutes) fails too instead of waiting forever; the archives take as
        # long as they need otherwise.
        curl --fail --location --retry 3 --connect-timeout 30 --speed-limit 1024 --speed-time 120 \
            --silent --show-error -o "$dest" "$url"
    elif command -v wget >/dev/null 2>&1; then
        # --timeout: also the read timeout, so a stalled transfer fails (and is retried) after 30 s
        wget --quiet --tries=3 --timeout=30 -O "$dest" "$url"
    else
        err "neither curl nor wget is installed: cannot download $url (or use --mirror DIR)"
        return 1
    fi
}

# fetch_one URL [MD5]: $DL_DIR/<basename>, from the mirror or the network, verified.
fetch_one() {
    local url=$1 md5=${2-} name
    name=$(basename "$url")
    local dest=$DL_DIR/$name
    if [[ -n $MIRROR ]]; then
        local source=$MIRROR/$name
        [[ -e $source ]] || { err "$name not found in mirror $MIRROR (a copy of $url)"; return 1; }
        verify_file "$source" "$name" "$md5" || return 1
        ln -sfn "$source" "$dest.tmp"
        mv -Tf "$dest.tmp" "$dest"
    else
        log "downloading $url"
        rm -f "$dest.part"
        if ! download "$url" "$dest.part"; then
            rm -f "$dest.part"
            err "download failed: $url (offline? put $name into a directory and pass --mirror DIR)"
            return 1
        fi
        if ! verify_file "$dest.part" "$name" "$md5"; then
            rm -f "$dest.part"
            return 1
        fi
        mv -f "$dest.part" "$dest"
    fi
}

# fetch URL [MD5]: one step per download.
fetch() {
    run_step "fetch-$(basename "$1")" fetch_one "$@"
}

# extract ARCHIVE_NAME MEMBER...: members of $DL_DIR/ARCHIVE_NAME into $ORIG_DIR.
extract() {
    local name=$1
    shift
    run_step "extract-$name" py extract "$DL_DIR/$name" "$ORIG_DIR" "$@"
}

# ------------------------------------------------------------------ SentencePiece + fairseq

# claim_output_dir SRC TGT: an output directory holds one recipe and language pair;
# re-using it for another would mix their files under the same step markers.
claim_output_dir() {
    local claim="$RECIPE_NAME $1-$2"
    if [[ -f $STATE_DIR/recipe ]]; then
        local existing
        existing=$(<"$STATE_DIR/recipe")
        [[ $existing == "$claim" ]] ||
            die "$OUT was prepared for '$existing', not '$claim': use another output directory"
    else
        echo "$claim" >"$STATE_DIR/recipe.tmp"
        mv -f "$STATE_DIR/recipe.tmp" "$STATE_DIR/recipe"
    fi
}

# spm_train FILE...: joint model on the training text of both languages. The step
# name carries the settings, so a different --vocab-size retrains (and redoes
# every later step) instead of silently keeping the old model.
spm_train() {
    run_step "spm-train-$SPM_MODEL_TYPE-$VOCAB_SIZE" py spm-train --model-prefix "$OUT/spm" --vocab-size "$VOCAB_SIZE" \
        --model-type "$SPM_MODEL_TYPE" --character-coverage "${SPM_CHARACTER_COVERAGE:-1.0}" \
        --input-sentence-size "${SPM_INPUT_SENTENCE_SIZE:-0}" --workers "$WORKERS" "$@"
}

# binarize SRC TGT: fairseq-preprocess of $OUT/{train,valid,test}.spm.{SRC,TGT}
# with one dictionary shared by both sides (the models share embeddings).
binarize_step() {
    local src=$1 tgt=$2 split
    for split in train valid test; do
        py check-lines --no-cr "$OUT/$split.spm.$src" "$OUT/$split.spm.$tgt"
    done
    py spm-dict --vocab "$OUT/spm.vocab" --out "$OUT/fairseq.dict.txt"
    rm -rf "$OUT/data-bin.tmp"
    fairseq-preprocess --source-lang "$src" --target-lang "$tgt" \
        --trainpref "$OUT/train.spm" --validpref "$OUT/valid.spm" --testpref "$OUT/test.spm" \
        --destdir "$OUT/data-bin.tmp" --joined-dictionary --srcdict "$OUT/fairseq.dict.txt" \
        --workers "$WORKERS" >"$OUT/preprocess.log.tmp" 2>&1 ||
        { cat "$OUT/preprocess.log.tmp" >&2; err "fairseq-preprocess failed (log above)"; return 1; }
    mv -f "$OUT/preprocess.log.tmp" "$OUT/preprocess.log"
    rm -rf "$OUT/data-bin"
    mv -f "$OUT/data-bin.tmp" "$OUT/data-bin"
}

binarize() {
    run_step binarize binarize_step "$@"
}

# write_summary SRC TGT: line counts of the final splits -> stdout and summary.txt.
write_summary() {
    local src=$1 tgt=$2 split
    {
        echo "recipe: $RECIPE_NAME  pair: $src-$tgt  vocab: $VOCAB_SIZE ($SPM_MODEL_TYPE, joint)"
        for split in train valid test; do
            printf '%-5s %8d pairs  %s.spm.{%s,%s}\n' "$split" \
                "$(wc -l <"$OUT/$split.spm.$src")" "$split" "$src" "$tgt"
        done
        echo "dictionary: $(wc -l <"$OUT/data-bin/dict.$src.txt") entries + 4 special symbols"
        echo "binarized: $OUT/data-bin   references: $OUT/test.raw.$tgt"
    } >"$OUT/summary.txt.tmp"
    mv -f "$OUT/summary.txt.tmp" "$OUT/summary.txt"
    cat "$OUT/summary.txt"
}

# ------------------------------------------------------------------ pipeline tail

# subword_and_binarize TEST_PREFIX [CLEAN_OPTION...]: the steps every recipe ends with, once its text
# is in $WORK_DIR/{train,valid}.{$SRC,$TGT} and TEST_PREFIX.{$SRC,$TGT}: a joint SentencePiece model
# trained on train, every split encoded into $OUT/{train,valid,test}.spm.*, fairseq-preprocess into
# $OUT/data-bin, and summary.txt. With CLEAN_OPTIONs (textprep.py clean options, e.g. --ratio 1.5
# --min-len 1 --max-len 250), the encoded training pairs are first filtered by their piece counts
# (clean-corpus-n on subwords, as fairseq's recipes do after BPE); valid and test never are.
subword_and_binarize() {
    local test_prefix=$1
    shift
    local W=$WORK_DIR train_pieces=$OUT/train.spm
    if (($#)); then
        train_pieces=$W/train.spm  # cleaned from work/ into $OUT/train.spm.* below
    fi
    spm_train "$W/train.$SRC" "$W/train.$TGT"
    run_step spm-encode py spm-encode --model "$OUT/spm.model" --workers "$WORKERS" \
        "$W/train.$SRC" "$train_pieces.$SRC" "$W/train.$TGT" "$train_pieces.$TGT" \
        "$W/valid.$SRC" "$OUT/valid.spm.$SRC" "$W/valid.$TGT" "$OUT/valid.spm.$TGT" \
        "$test_prefix.$SRC" "$OUT/test.spm.$SRC" "$test_prefix.$TGT" "$OUT/test.spm.$TGT"
    if (($#)); then
        run_step train-clean py clean --count whitespace "$@" \
            --in-src "$W/train.spm.$SRC" --in-tgt "$W/train.spm.$TGT" \
            --out-src "$OUT/train.spm.$SRC" --out-tgt "$OUT/train.spm.$TGT"
    fi
    binarize "$SRC" "$TGT"
    write_summary "$SRC" "$TGT"
}

# ------------------------------------------------------------------ WMT14 pipeline

# wmt14_pipeline: shared by prepare-wmt14en2de.sh and prepare-wmt14en2fr.sh, as in
# fairseq's recipes: Moses punctuation normalisation + non-printing-character
# removal, SentencePiece trained on (uncleaned) train, then clean-corpus-n on the
# subword pieces (ratio 1.5, 1..250), the order of fairseq's "perl $CLEAN -ratio
# 1.5 $tmp/bpe.train ... 1 250". Valid (newstest2013) and test (newstest2014 full)
# are never filtered. test.raw.* is the <seg> text exactly as sacrebleu's
# wmt14/full extracts it (no normalisation): the reference for scoring.
# Inputs (set by the recipe): SRC TGT, TRAIN_SOURCES (entries "URL|MD5|PREFIX|SUFFIX",
# the corpus files being PREFIX.<lang>SUFFIX inside the archive), VALID_SOURCE and
# TEST_SOURCE ("URL|MD5|SRC_MEMBER|TGT_MEMBER").
wmt14_pipeline() {
    claim_output_dir "$SRC" "$TGT"
    local entry url md5 prefix suffix src_member tgt_member
    local -A archive_members=()
    local train_inputs=()
    for entry in "${TRAIN_SOURCES[@]}"; do
        IFS='|' read -r url md5 prefix suffix <<<"$entry"
        fetch "$url" "$md5"
        archive_members[$(basename "$url")]+=" $prefix.$SRC$suffix $prefix.$TGT$suffix"
        train_inputs+=("$ORIG_DIR/$prefix.$SRC$suffix" "$ORIG_DIR/$prefix.$TGT$suffix")
    done
    local valid_inputs=() test_inputs=() name
    for entry in "$VALID_SOURCE" "$TEST_SOURCE"; do
        IFS='|' read -r url md5 src_member tgt_member <<<"$entry"
        fetch "$url" "$md5"
        archive_members[$(basename "$url")]+=" $src_member $tgt_member"
    done
    IFS='|' read -r _ _ src_member tgt_member <<<"$VALID_SOURCE"
    valid_inputs=("$ORIG_DIR/$src_member" "$ORIG_DIR/$tgt_member")
    IFS='|' read -r _ _ src_member tgt_member <<<"$TEST_SOURCE"
    test_inputs=("$ORIG_DIR/$src_member" "$ORIG_DIR/$tgt_member")

    # Extract only after every download verified, so a bad archive stops the run early.
    for name in $(printf '%s\n' "${!archive_members[@]}" | sort); do
        # shellcheck disable=SC2086  # member lists are space-separated paths without spaces
        extract "$name" ${archive_members[$name]}
    done

    local W=$WORK_DIR
    local norm=(--punct-norm --remove-nonprint --src-lang "$SRC" --tgt-lang "$TGT" --workers "$WORKERS")
    run_step train-text py build-parallel "${norm[@]}" \
        --out-src "$W/train.$SRC" --out-tgt "$W/train.$TGT" "${train_inputs[@]}"
    run_step valid-text py build-parallel --segs "${norm[@]}" \
        --out-src "$W/valid.$SRC" --out-tgt "$W/valid.$TGT" "${valid_inputs[@]}"
    run_step test-text py build-parallel --segs "${norm[@]}" \
        --out-src "$W/test.$SRC" --out-tgt "$W/test.$TGT" "${test_inputs[@]}"
    run_step test-raw py build-parallel --segs --src-lang "$SRC" --tgt-lang "$TGT" \
        --out-src "$OUT/test.raw.$SRC" --out-tgt "$OUT/test.raw.$TGT" "${test_inputs[@]}"

    subword_and_binarize "$W/test" --ratio 1.5 --min-len 1 --max-len 250 --workers "$WORKERS"
}
