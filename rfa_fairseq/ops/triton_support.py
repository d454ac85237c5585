"""Whether the Triton kernels (triton_chunk.py, triton_step.py) can run, and their modules, imported on first use.

Triton ships with torch's CUDA builds; the kernel modules import it at their top, so they are imported only where a
kernel is about to run (`kernels(name)`). Under TRITON_INTERPRET=1 (set before Triton is imported) the same kernels
run in Triton's interpreter on CPU tensors, the way they are checked without a GPU (tests/test_triton_kernels.py).
"""
import functools
import importlib
import importlib.util
import os
from types import ModuleType
from typing import Optional

import torch
from torch import Tensor

TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # fp64 stays on the torch path


@functools.lru_cache(maxsize=None)
def triton_import_error() -> Optional[str]:
    """Why Triton cannot be used here (None when it imports)."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception as error:  # a broken install, no compiler backend
        return f"{type(error).__name__}: {error}"
    return None


def interpreting() -> bool:
    """TRITON_INTERPRET=1: kernels run in Triton's interpreter, on CPU tensors (tests)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_usable(*tensors: Optional[Tensor]) -> bool:
    """True when the Triton kernels can take these tensors: CUDA (or the CPU under TRITON_INTERPRET=1), a dtype
    Triton computes in, and Triton importable."""
    present = [t for t in tensors if t is not None]
    if not present or any(t.dtype not in TRITON_DTYPES and t.is_floating_point() for t in present):
        return False
    if not all(t.is_cuda for t in present) and not (interpreting() and not any(t.is_cuda for t in present)):
        return False
    return triton_import_error() is None


def kernels(name: str) -> ModuleType:
    """The kernel module rfa_fairseq.ops.<name> (triton_chunk, triton_step), imported now if it was not."""
    return importlib.import_module(f"{__package__}.{name}")


def next_power_of_2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()
