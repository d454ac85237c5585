"""rfa_fairseq: Random Feature Attention (Peng et al., ICLR 2021) as a fairseq plugin.

Load with `--user-dir path/to/rfa_fairseq` or, when pip-installed, `--user-dir "$(rfa-user-dir)"`; from
Python, `rfa_fairseq.hub.load(checkpoint, data)` loads a model to translate with (docs/python-api.md).
Importing registers the `rfa_transformer` model and its architectures and applies the plugin's
fairseq/torch patches (`fairseq_compat`, which lists each and why): the classes fairseq checkpoints
need for torch's weights_only loading are allowlisted, fairseq's checkpoint loading names the file
and the cause when it fails, and fairseq's background data thread is stopped before the interpreter
exits (without it a run that stops mid-epoch, e.g. at --max-update, can abort at exit with SIGABRT).

Layout: `models`, `modules`, `ops` and `config` are the plugin; `checkpoints` loads and saves
checkpoints; `hub` is the Python API; `cli` holds the command-line tools (rfa-convert-transformer,
rfa-average-checkpoints, rfa-check-data, rfa-score, rfa-train), whose console scripts start in the top-level
`rfa_fairseq_cli` (it answers --help without importing this package, which imports fairseq).
"""
# the one place the version is written (setup.cfg reads it: version = attr: rfa_fairseq.__version__)
__version__ = "0.1.0"

from .fairseq_compat import apply_patches  # noqa: E402

apply_patches()

from . import models  # noqa: E402,F401  (registration happens on import)
