"""fairseq-train that logs every random-matrix draw and a parameter checksum per update (test helper).

    python tests/fairseq_train_debug_log.py [--unrounded] FAIRSEQ_TRAIN_ARGS...   (RFA_DEBUG_LOG=FILE)

Each process appends one line per event to FILE, tagged with its rank:
    rank=R draw update=U module=M sum=S     a training random matrix drawn (RFAAttention.random_matrix)
    rank=R params update=U sum=S            the parameter checksum when the model is told update U
The multi-process tests use them to show that ranks and resumed runs agree without communicating
(cli_support.debug_log parses them). The hooks wrap the plugin's methods in this process only;
the package itself logs nothing. --unrounded also applies fairseq_train_unrounded.py's full-precision
logging. Then fairseq's own training entry point runs with the remaining arguments.
"""
import os
import sys

import torch
from fairseq_cli.train import cli_main

from rfa_fairseq.models.rfa_transformer import RFATransformerModel
from rfa_fairseq.modules import RFAAttention


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_available() and torch.distributed.is_initialized() else 0


def install_debug_log(path: str) -> None:
    def log(message: str) -> None:
        with open(path, "a") as handle:
            handle.write(f"rank={_rank()} {message}\n")

    random_matrix = RFAAttention.random_matrix

    def logged_random_matrix(self):
        before = self._train_matrix_update
        matrix = random_matrix(self)
        if self._train_matrix_update != before:  # a new training draw, not the cached one or the eval matrix
            log(f"draw update={self.num_updates} module={self.module_index} sum={matrix.double().sum().item():.12e}")
        return matrix

    set_num_updates = RFATransformerModel.set_num_updates

    def logged_set_num_updates(self, num_updates):
        set_num_updates(self, num_updates)
        checksum = sum(p.detach().double().sum().item() for p in self.parameters())
        log(f"params update={num_updates} sum={checksum:.12e}")

    RFAAttention.random_matrix = logged_random_matrix
    RFATransformerModel.set_num_updates = logged_set_num_updates


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--unrounded":
        del sys.argv[1]
        from fairseq_train_unrounded import remove_rounding

        remove_rounding()
    install_debug_log(os.environ["RFA_DEBUG_LOG"])
    sys.argv[0] = "fairseq-train"
    sys.exit(cli_main())
