"""Let torch's weights_only loader read fairseq checkpoints, without turning it off.

torch >= 2.6 loads with weights_only=True, which refuses any pickled class that is
not allowlisted. A fairseq checkpoint holds, besides tensors and plain containers,
its training configuration: an argparse.Namespace (legacy models) inside the cfg
dict. We allowlist exactly the classes such checkpoints contain; anything else
(arbitrary pickled objects) is still refused by torch.
"""
import argparse

import torch

FAIRSEQ_CHECKPOINT_CLASSES = [argparse.Namespace]


def allowlist_fairseq_checkpoint_classes() -> None:
    torch.serialization.add_safe_globals(FAIRSEQ_CHECKPOINT_CLASSES)
