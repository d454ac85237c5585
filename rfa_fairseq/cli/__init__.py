"""The command-line tools (console scripts in setup.cfg), apart from the plugin itself:

  rfa-convert-transformer   convert.py            softmax transformer checkpoint -> rfa_transformer
  rfa-average-checkpoints   average_checkpoints.py  average the last N checkpoints
  rfa-check-data            check_data.py         check a parallel corpus before fairseq sees it
  rfa-build-shortlist       build_shortlist.py    a vocabulary shortlist from a data-bin's training split
  rfa-score                 scoring.py            sacreBLEU/chrF scoring, hypotheses from fairseq-generate
  rfa-train                 train.py              fairseq-train with --bf16 on GPUs/CPUs

Each also runs as `python -m rfa_fairseq.cli.<module>`. The console scripts of check_data, scoring,
average_checkpoints and build_shortlist start in the installed `rfa_fairseq_cli` (scripts/rfa_fairseq_cli), which loads the tool's file alone (without this
package, whose import registers the plugin with fairseq) to answer --help and usage errors at once; those files
therefore import their package-relative modules only `if __package__`. rfa-user-dir prints the plugin folder.
"""
import sys


def run_console_script(prog: str, parser, run, errors, argv=None) -> int:
    """A console script's main(): parse argv, run, and report `errors` (its user-facing exception types) as
    `prog: error: ...` on stderr with exit status 1."""
    args = parser.parse_args(argv)
    try:
        run(args)
    except errors as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 1
    return 0
