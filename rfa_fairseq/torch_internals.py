"""The private torch APIs the plugin uses, in one place (tests/test_torch_internals.py calls each on the installed
torch, so an upgrade that removes or changes one fails there first).

- torch.ops.mkldnn._reorder_linear_weight, _linear_pointwise (and .binary): oneDNN linear layers on weights packed
  once, the CPU decoding step's GEMMs (ops/decode_step.OneDNNLinear); without them torch's addmm serves.
- torch._C._storage_Use_Count: whether a workspace buffer handed out is still viewed (modules/decoding.Workspace);
  without it every handed-out buffer counts as viewed (more buffers, same results).
- Tensor._version: an in-place update of a parameter repacks its packed weight (Workspace.packed_linear).
"""
from typing import Optional

import torch
from torch import Tensor


def onednn_linear_available() -> bool:
    mkldnn = torch.ops.mkldnn
    return hasattr(mkldnn, "_reorder_linear_weight") and hasattr(mkldnn, "_linear_pointwise")


def onednn_pack_linear_weight(weight: Tensor, rows_hint: int) -> Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight, rows_hint)


def onednn_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor], activation: Optional[str]) -> Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, activation or "none", [], "")


def onednn_linear_add(x: Tensor, residual: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    return torch.ops.mkldnn._linear_pointwise.binary(x, residual, weight, bias, "add")


def storage_use_count(tensor: Tensor) -> Optional[int]:
    """References to the tensor's storage (None where torch has no such count)."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    return None if use_count is None else use_count(tensor.untyped_storage()._cdata)


def tensor_version(tensor: Tensor) -> int:
    """The tensor's in-place update counter."""
    return tensor._version
