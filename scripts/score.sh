#!/usr/bin/env bash
# Score detokenized hypotheses: sacreBLEU (with signature) and chrF, via
# rfa_fairseq.cli.scoring; all arguments are passed through (see --help).
#
#   scripts/score.sh --hyp RESULTS/test.hyp.en --ref PREP/test.raw.en --json RESULTS/scores.json
#   scripts/score.sh --hyp RESULTS/test.hyp.de --ref PREP/test.raw.de --compound-split   # WMT14 EN-DE
#   scripts/score.sh --generate-output RESULTS/test.hyp.de.generate.log --spm-model PREP/spm.model --ref PREP/test.raw.de
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON="${PYTHON:-python3}"

die() { echo "score.sh: error: $*" >&2; exit 1; }

command -v "$PYTHON" >/dev/null 2>&1 || die "Python interpreter '$PYTHON' not found (set PYTHON=...)"
"$PYTHON" -c "import sacrebleu, sacremoses" 2>/dev/null ||
    die "$PYTHON cannot import sacrebleu and sacremoses (activate the project environment)"

# run as a file, not -m: importing the rfa_fairseq package would import fairseq and torch (seconds)
exec "$PYTHON" "$REPO/rfa_fairseq/cli/scoring.py" "$@"
