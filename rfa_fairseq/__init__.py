"""rfa_fairseq: Random Feature Attention (Peng et al., ICLR 2021) as a fairseq plugin.

Load with `--user-dir path/to/rfa_fairseq` or, when pip-installed, `--user-dir
$(python -c 'import rfa_fairseq, os; print(os.path.dirname(rfa_fairseq.__file__))')`.
Importing registers the `rfa_transformer` model and its architectures and allowlists
the classes fairseq checkpoints need for torch's weights_only loading.
"""
from .checkpoint_safety import allowlist_fairseq_checkpoint_classes

allowlist_fairseq_checkpoint_classes()

from . import models  # noqa: E402,F401  (registration happens on import)

__version__ = "0.1.0"
