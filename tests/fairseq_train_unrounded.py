"""fairseq-train, with logged statistics at full precision (test helper).

fairseq rounds the logged loss to 3 decimals (metrics.log_scalar(..., round=3)) and prints
floats with "{:g}" (6 significant digits): too coarse to show that a resumed run reproduces an
uninterrupted one to 1e-6. This launcher removes both roundings and then runs fairseq's own
training entry point with the same command-line arguments; nothing else changes.
"""
import sys

from fairseq.logging import meters, progress_bar
from fairseq_cli.train import cli_main


def _no_round(number, ndigits):
    return number.item() if hasattr(number, "item") else number


def _format_stat(stat, _format=progress_bar.format_stat):
    return repr(stat) if isinstance(stat, float) else _format(stat)


def remove_rounding() -> None:
    meters.safe_round = _no_round
    progress_bar.format_stat = _format_stat


if __name__ == "__main__":
    remove_rounding()
    sys.argv[0] = "fairseq-train"
    sys.exit(cli_main())
