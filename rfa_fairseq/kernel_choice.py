"""The one place that picks the kernels: causal RFA over whole sequences per call (`causal_rfa`, training and
scoring), and the decoding step's kernel set per model and batch device (`step_kernels(decode_kernel, device, dtype,
precision, native_unsupported, state, cpu_isa)`; `rfa_step_kernels` reads them from a model's RFAConfig). The
encoder's inference takes the step's choice.

Whole sequences: causal_rfa_triton (gpu/triton_chunk.py: the forward one launch, the backward two) on CUDA when Triton
imports, --rfa-sequence-kernel is auto and the kernels passed their self-check for the call's variant on its device
(gpu/triton_self_check.py, once per process; --no-rfa-triton-self-check skips it); causal_rfa_chunked (ops/rfa.py,
torch operations) otherwise. The chunked torch path stays the reference the Triton kernels are tested against
(tests/test_triton_kernels.py on the CPU through Triton's interpreter, tests/test_cuda.py on a GPU) and checked against
on the user's device.

The decoding step:

- `TorchKernels` (ops/step.py): the step's operations in torch, one call each: the reference, bf16 / fp16 weights,
  --rfa-decode-kernel torch, and on CUDA without Triton.
- `TritonKernels` (gpu/step.py): on CUDA where Triton imports, the torch step with each causal update one Triton launch.
- `NativeKernels` (cpu/native.py): on the CPU in fp32 weights where the C++ module loads, the whole step one native
  call, its linear layers fp32 or int8 (--rfa-decode-precision) on the weights kept once in the kernels' blocks, on the
  CPU's instruction-set level at most --rfa-cpu-isa.

No set falls back to another inside a call: a set that cannot serve is not picked (auto), or its option is an error
naming why (cpp, int8, an fp16 state where the native step does not run).
"""
import functools
import warnings
from typing import Optional

import torch

from .cpu import levels as cpu_levels
from .cpu.extension import load_fused_extension, require_fused_extension
from .cpu.native import native_kernels
from .gpu import triton_self_check
from .gpu.step import TRITON_KERNELS
from .gpu.triton_support import triton_import_error, triton_usable
from .ops.rfa import DENOMINATOR_EPS, causal_rfa_chunked
from .ops.step import TORCH_KERNELS

SEQUENCE_KERNELS = ("auto", "torch")  # --rfa-sequence-kernel

DECODE_KERNELS = ("auto", "torch", "cpp")  # --rfa-decode-kernel
DECODE_PRECISIONS = ("fp32", "int8")  # --rfa-decode-precision
DECODE_STATES = ("auto", "fp16", "fp32")  # --rfa-decode-state: the causal layers' state between steps
# --rfa-cpu-isa: the highest instruction-set level of the CPU kernels (cpu/levels.py: the names of every
# architecture's levels; a name of another architecture's is an error where the runtime is built)
CPU_ISAS = ("auto", *cpu_levels.ALL_NAMES)


def causal_rfa(phi_q, phi_k, v, log_gate=None, state=None, *, chunk_size: int, sequence_kernel: str,
               eps: float = DENOMINATOR_EPS, self_check: bool = True):
    """phi_q, phi_k: (B, H, T, F)   v: (B, H, T, d)   log_gate: (B, H, T) or None
    state: None or a (B, H, F, d + 1) tensor entering the sequence -> out (B, H, T, d) fp32, final state

    chunk_size: the torch path's chunks (--rfa-chunk-size). sequence_kernel: "auto" (Triton on CUDA when usable and
    trusted) or "torch" (--rfa-sequence-kernel). self_check: check the Triton kernels against the torch path before
    their first use on a device (--rfa-triton-self-check). The model's options (RFAConfig) are their only defaults.
    """
    if sequence_kernel == "auto" and phi_q.is_cuda:
        if triton_usable(phi_q, phi_k, v, log_gate, state):
            return triton_self_check.causal_rfa(phi_q, phi_k, v, log_gate, state, chunk_size=chunk_size, eps=eps,
                                                self_check=self_check)
        if triton_import_error() is not None:
            _warn_once(f"Triton is not usable ({triton_import_error()}): causal RFA on CUDA runs the chunked torch "
                       f"path (same results, slower); --rfa-sequence-kernel torch silences this")
    return causal_rfa_chunked(phi_q, phi_k, v, log_gate, state, chunk_size=chunk_size, eps=eps)


@functools.lru_cache(maxsize=None)
def _warn_once(message: str) -> None:
    warnings.warn(f"rfa_fairseq: {message}")


def cpp_can_run(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the native step serves this device and dtype (the CPU in fp32), built or not."""
    return torch.device(device).type == "cpu" and dtype == torch.float32


def step_kernels(decode_kernel: str, device: torch.device, dtype: torch.dtype, precision: str = "fp32",
                 native_unsupported: Optional[str] = None, state: str = "auto", cpu_isa: str = "auto"):
    """The kernels of the decoding step and of the encoder's inference for --rfa-decode-kernel and
    --rfa-decode-precision (validated by RFAConfig) and the model's device and dtype: auto = the native step on
    the CPU in fp32 when the C++ module loads, on CUDA the torch step
    with the causal layers' step in Triton (where Triton imports), torch otherwise;
    cpp = the native step, an error where it cannot run; torch = torch. precision int8: the native step with
    int8 linear layers, an error naming why where it cannot run. native_unsupported: what of the model the
    native program cannot run (RFATransformerDecoder._native_unsupported), which makes auto take torch.
    state (--rfa-decode-state): the causal layers' state kept in fp16 (auto: where the native step runs) or fp32.
    cpu_isa (--rfa-cpu-isa): the cap on the native kernels' instruction-set level."""
    kernels = _step_kernels(decode_kernel, device, dtype, precision, native_unsupported,
                            torch.float32 if state == "fp32" else torch.float16, cpu_isa)
    if state == "fp16" and not kernels.native:
        raise ValueError(f"--rfa-decode-state fp16 keeps the state in fp16 in the native step, which does not run here "
                         f"({kernels.name} step on {torch.device(device).type} in {dtype}); use auto or fp32")
    return kernels


def rfa_step_kernels(rfa, device: torch.device, dtype: torch.dtype, native_unsupported: Optional[str] = None):
    """step_kernels for a model's RFAConfig (its decoding options, read whole)."""
    return step_kernels(rfa.rfa_decode_kernel, device, dtype, rfa.rfa_decode_precision, native_unsupported,
                        getattr(rfa, "rfa_decode_state", "auto"), getattr(rfa, "rfa_cpu_isa", "auto"))


def _step_kernels(decode_kernel, device, dtype, precision, native_unsupported, state_dtype, cpu_isa):
    if precision == "int8":
        if native_unsupported is not None:
            raise ValueError(f"--rfa-decode-precision int8 runs the native step, which does not support "
                             f"{native_unsupported}; use fp32")
        return _int8_kernels(decode_kernel, device, dtype, state_dtype, cpu_isa)
    if decode_kernel == "torch":
        return TORCH_KERNELS
    if decode_kernel == "auto" and torch.device(device).type == "cuda" and dtype != torch.float64:
        return TRITON_KERNELS if triton_import_error() is None else TORCH_KERNELS
    if native_unsupported is not None:
        if decode_kernel == "cpp":
            raise ValueError(f"--rfa-decode-kernel cpp: the native decoding step does not support {native_unsupported}; "
                             "use auto or torch")
        return TORCH_KERNELS
    native = cpp_can_run(device, dtype)
    if decode_kernel == "cpp":
        if not native:
            raise ValueError(f"--rfa-decode-kernel cpp: the C++ decoding step runs on the CPU in fp32, not on "
                             f"{torch.device(device).type} in {dtype}; use auto or torch")
        ext = require_fused_extension()
    else:
        ext = load_fused_extension() if native else None
        if ext is None:
            return TORCH_KERNELS
    return native_kernels(ext, "fp32", state_dtype, cpu_isa)


def _int8_kernels(decode_kernel: str, device: torch.device, dtype: torch.dtype, state_dtype: torch.dtype,
                  cpu_isa: str) -> "NativeKernels":
    where = f"{torch.device(device).type} in {dtype}"
    if not cpp_can_run(device, dtype):
        raise ValueError(f"--rfa-decode-precision int8: the int8 decoding step runs on the CPU in fp32 weights, not on "
                         f"{where}; use fp32 there")
    if decode_kernel == "torch":
        raise ValueError("--rfa-decode-precision int8 needs the C++ kernels (they quantize the activations): drop "
                         "--rfa-decode-kernel torch")
    ext = require_fused_extension()
    return native_kernels(ext, "int8", state_dtype, cpu_isa)


