"""Entry points of the rfa-* console scripts (setup.cfg), outside the `rfa_fairseq` package.

Importing `rfa_fairseq` registers the plugin with fairseq, so it imports fairseq and torch (seconds). The
tools' own modules live in `rfa_fairseq/cli/`; for the tools whose command line is plain argparse, this module
loads that file alone (without its package) to answer --help and usage errors at once, and runs the tool
itself the same way where it needs neither fairseq nor the plugin (rfa-score, and rfa-check-data, which
imports fairseq's data readers only for binarized data). The others then import the package as usual.
`rfa-user-dir` prints the folder to pass to fairseq's --user-dir.
"""
import importlib
import importlib.util
import os
import sys

PACKAGE = "rfa_fairseq"


def user_dir() -> str:
    """The folder of the installed rfa_fairseq package (fairseq's --user-dir), found without importing it."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"rfa-fairseq: error: the {PACKAGE} package is not importable by {sys.executable}")
    return os.path.abspath(list(spec.submodule_search_locations)[0])


def _load_alone(module: str):
    """rfa_fairseq/cli/<module>.py as a module of its own: its package-relative imports are skipped
    (each of these files imports them only `if __package__`)."""
    path = os.path.join(user_dir(), "cli", f"{module}.py")
    # a top-level name: __package__ stays empty, so the file skips its package-relative imports
    spec = importlib.util.spec_from_file_location(f"_rfa_fairseq_cli_{module}", path)
    loaded = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loaded)
    return loaded


def _run(module: str, alone: bool) -> int:
    argv = sys.argv[1:]
    light = _load_alone(module)
    if alone:
        return light.main(argv)
    light.build_parser().parse_args(argv)  # --help and usage errors exit here
    return importlib.import_module(f"{PACKAGE}.cli.{module}").main(argv)


def check_data() -> int:
    return _run("check_data", alone=True)


def build_shortlist() -> int:
    return _run("build_shortlist", alone=False)


def score() -> int:
    return _run("scoring", alone=True)


def average_checkpoints() -> int:
    return _run("average_checkpoints", alone=False)


def print_user_dir() -> int:
    if len(sys.argv) > 1:
        print("usage: rfa-user-dir\n\nPrints the folder of the installed rfa_fairseq plugin, for fairseq's --user-dir:\n"
              '  fairseq-train DATA --user-dir "$(rfa-user-dir)" --arch rfa_transformer ...',
              file=sys.stdout if sys.argv[1] in ("-h", "--help") else sys.stderr)
        return 0 if sys.argv[1] in ("-h", "--help") else 2
    print(user_dir())
    return 0
