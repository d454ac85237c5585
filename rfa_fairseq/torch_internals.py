"""The one place of the package that names torch's private APIs; tests/test_torch_internals.py calls each.

A torch upgrade may remove or change any of them without notice, so each is named here once, behind a
small function that says what happens without it:

- `Tensor._version`: `tensor_version`, `tensor_states`. The version counter that in-place updates bump; the decoding runtime
  is built again (and the encoder's linear layers packed again) when a parameter's version changes. Without it: an AttributeError
  naming it (no fallback: a stale packed weight would give wrong outputs).
- `torch.ops.mkldnn._reorder_linear_weight`: `onednn_pack_linear_weight`, and `torch.ops.mkldnn._linear_pointwise`
  with its `.binary` overload, by their dispatcher names in `onednn_operators()`: oneDNN's linear on weights packed
  once into its blocked layout, with relu / a residual add fused (the CPU decoding step's linear layers, called by
  the C++ LinearLibrary, cpu/csrc/decode_program.cpp; 2.05-2.29x torch's MKL addmm on the step's shapes,
  docs/design.md). Without them `onednn_linear_available()` is False and the step uses torch's addmm (same results,
  slower); calling one anyway is a RuntimeError naming the missing op.
- `torch.ops.onednn.qlinear_prepack`: `onednn_int8_pack_linear_weight`, and `qlinear_pointwise` in
  `onednn_operators()`: oneDNN's int8 linear of torch's x86 int8 inference (not the deprecated quantized-tensor
  API): the CPU decoding step's linear layers at --rfa-decode-precision int8. Without them
  `onednn_int8_linear_available()` is False and int8 is an error naming why.
- `torch.utils.cpp_extension.FileBaton` (a name that module imports): `torch_build_lock_is_a_baton`. Up to torch
  2.13 the JIT build's `lock` file is a baton whose mere existence blocks (a killed builder leaves it and every
  later load waits forever); from 2.14 it is a kernel-released file lock (filelock), left in place and harmless.
  Without the name: False (the newer lock).
- `torch.utils.cpp_extension._get_build_directory`: `cpp_extension_build_directory`. The directory
  torch's JIT build of the C++ kernels uses (TORCH_EXTENSIONS_DIR or its default), where cpu/extension.py
  takes its build lock first. Without it: a RuntimeError naming it, which extension.py reports as a failed
  just-in-time build (decoding uses the torch path, or --rfa-decode-kernel cpp is an error).
"""
import functools
from typing import Optional

import torch
from torch import Tensor


class MissingTorchInternal(RuntimeError):
    """A private torch API the plugin relies on is missing from the installed torch."""


def _missing(what: str, consequence: str) -> MissingTorchInternal:
    return MissingTorchInternal(f"torch {torch.__version__} has no {what} (a private torch API rfa_fairseq uses: "
                                f"{consequence}); see rfa_fairseq/torch_internals.py")


def tensor_version(tensor: Tensor) -> int:
    """`tensor._version`: the counter that every in-place update of the tensor (or of a view of it) bumps."""
    try:
        return tensor._version
    except AttributeError:
        raise _missing("Tensor._version", "packed weights could not see in-place parameter updates") from None


def tensor_states(tensors) -> tuple:
    """(identity, storage address, version) of each tensor, in one pass: what a runtime built from them depends on
    (checked at every batch: one comprehension, not a call per tensor)."""
    try:
        return tuple([(id(t), t.data_ptr(), t._version) for t in tensors])
    except AttributeError:
        raise _missing("Tensor._version", "packed weights could not see in-place parameter updates") from None


@functools.lru_cache(maxsize=None)
def onednn_linear_available() -> bool:
    """Whether torch has oneDNN's linear ops on packed weights (torch's x86 CPU builds do)."""
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


@functools.lru_cache(maxsize=None)
def _mkldnn_op(name: str, overload: Optional[str] = None):
    try:
        op = getattr(torch.ops.mkldnn, name)
        return op if overload is None else getattr(op, overload)
    except (AttributeError, RuntimeError):
        full = f"torch.ops.mkldnn.{name}" + ("" if overload is None else f".{overload}")
        raise _missing(full, "the CPU decoding step's oneDNN linear layers; check onednn_linear_available() "
                             "first, the step then uses torch's addmm") from None


def onednn_pack_linear_weight(weight: Tensor, rows_hint: int) -> Tensor:
    """`weight` (out_features, in_features) packed into oneDNN's blocked layout, for the onednn_linear*
    functions; `rows_hint` (a typical number of input rows) only shapes the layout: any number of rows runs."""
    return _mkldnn_op("_reorder_linear_weight")(weight.detach(), rows_hint)


@functools.lru_cache(maxsize=None)
def onednn_int8_linear_available() -> bool:
    """Whether torch has oneDNN's int8 linear ops (torch.ops.onednn.qlinear_*, those of its x86 int8
    inference: uint8 activations, int8 per-channel weights, fp32 output)."""
    onednn = getattr(torch.ops, "onednn", None)
    return (torch.backends.mkldnn.is_available() and onednn is not None and hasattr(onednn, "qlinear_prepack")
            and hasattr(onednn, "qlinear_pointwise"))


def onednn_int8_pack_linear_weight(qweight: Tensor, rows_hint: int) -> Tensor:
    """int8 codes `qweight` (out_features, in_features) packed for onednn_int8_linear*."""
    return torch.ops.onednn.qlinear_prepack(qweight, [rows_hint, qweight.size(1)])


def onednn_operators():
    """The oneDNN operators the C++ LinearLibrary calls, by role: (name, overload) as torch's dispatcher knows them:
    the fp32 linear on a packed weight (post-op relu or none), its residual-add form, and the int8 linear (uint8
    activations, int8 per-channel weights, fp32 output)."""
    return {"linear": ("mkldnn::_linear_pointwise", ""), "linear_add": ("mkldnn::_linear_pointwise", "binary"),
            "qlinear": ("onednn::qlinear_pointwise", "")}


def torch_build_lock_is_a_baton() -> bool:
    """Whether torch's JIT build takes its `lock` file as a FileBaton (torch <= 2.13: a left file blocks every later
    load) rather than as a kernel-released file lock (torch >= 2.14: a left file is harmless)."""
    from torch.utils import cpp_extension

    return hasattr(cpp_extension, "FileBaton")


def cpp_extension_build_directory(name: str, verbose: bool = False) -> str:
    """The directory where torch.utils.cpp_extension.load builds the extension `name` (created if missing)."""
    from torch.utils import cpp_extension

    get = getattr(cpp_extension, "_get_build_directory", None)
    if get is None:
        raise _missing("torch.utils.cpp_extension._get_build_directory",
                       "the directory of the just-in-time build of the fused C++ kernels")
    return get(name, verbose=verbose)
