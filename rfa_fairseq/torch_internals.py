"""The one place of the package that names torch's private APIs; tests/test_torch_internals.py calls each.

A torch upgrade may remove or change any of them without notice, so each is named here once, behind a
small function that says what happens without it:

- `Tensor._version`: `tensor_version`, `tensor_states`. The version counter that in-place updates bump; the decoding runtime
  is built again (and the encoder's linear layers packed again) when a parameter's version changes. Without it: an AttributeError
  naming it (no fallback: a stale packed weight would give wrong outputs).
- `torch.utils.cpp_extension.FileBaton` (a name that module imports): `torch_build_lock_is_a_baton`. Up to torch
  2.13 the JIT build's `lock` file is a baton whose mere existence blocks (a killed builder leaves it and every
  later load waits forever); from 2.14 it is a kernel-released file lock (filelock), left in place and harmless.
  Without the name: False (the newer lock).
- `torch.utils.cpp_extension._get_build_directory`: `cpp_extension_build_directory`. The directory
  torch's JIT build of the C++ kernels uses (TORCH_EXTENSIONS_DIR or its default), where cpu/extension.py
  takes its build lock first. Without it: a RuntimeError naming it, which extension.py reports as a failed
  just-in-time build (decoding uses the torch path, or --rfa-decode-kernel cpp is an error).
"""

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
