"""rfa_fairseq: Random Feature Attention (Peng et al., ICLR 2021) as a fairseq plugin.

Load with `--user-dir path/to/rfa_fairseq` or, when pip-installed, `--user-dir
$(python -c 'import rfa_fairseq, os; print(os.path.dirname(rfa_fairseq.__file__))')`.
Importing registers the `rfa_transformer` model and its architectures and allowlists
the classes fairseq checkpoints need for torch's weights_only loading, and stops fairseq's
background data thread before the interpreter exits (`fairseq_compat`; without it a run that stops
mid-epoch, e.g. at --max-update, can abort at exit with SIGABRT).
"""
from .checkpoint_safety import allowlist_fairseq_checkpoint_classes
from .fairseq_compat import stop_data_threads_at_exit

allowlist_fairseq_checkpoint_classes()
stop_data_threads_at_exit()

from . import models  # noqa: E402,F401  (registration happens on import)

__version__ = "0.1.0"
