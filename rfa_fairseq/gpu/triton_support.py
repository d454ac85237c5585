"""Whether the Triton kernels (triton_chunk.py, triton_step.py) can run, and their modules, imported on first use.

Triton ships with torch's CUDA builds; the kernel modules import it at their top, so they are imported only where a
kernel is about to run (`kernels(name)`). The plugin gives them CUDA tensors only, and reads no environment variable
to choose them. Tests run the same kernels on CPU tensors in Triton's interpreter by calling the kernel modules (and
triton_self_check's entry points) directly: TRITON_INTERPRET=1, which Triton itself reads as it is imported
(tests/conftest.py sets it where there is no GPU; tests/test_triton_kernels.py, tests/test_triton_self_check.py).
"""
import functools
import importlib
import importlib.util
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


def triton_usable(*tensors: Optional[Tensor]) -> bool:
    """True when the Triton kernels can take these tensors: CUDA, a dtype Triton computes in, and Triton importable.
    (Whether a kernel is then trusted on that device is triton_self_check's decision.)"""
    present = [t for t in tensors if t is not None]
    if not present or any(t.dtype not in TRITON_DTYPES and t.is_floating_point() for t in present):
        return False
    return all(t.is_cuda for t in present) and triton_import_error() is None


def kernels(name: str) -> ModuleType:
    """The kernel module rfa_fairseq.gpu.<name> (triton_chunk, triton_step), imported now if it was not."""
    return importlib.import_module(f"{__package__}.{name}")


def next_power_of_2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()
