"""Causal RFA over whole sequences (training, scoring), the implementation picked per call:

    causal_rfa(phi_q, phi_k, v, log_gate=None, state=None, *, chunk_size, sequence_kernel, self_check) -> (out, state)

causal_rfa_triton (triton_chunk.py: the forward one launch, the backward two) on CUDA when Triton imports,
--rfa-sequence-kernel is auto and the kernels passed their self-check for the call's variant on its device
(triton_self_check.py, once per process; --no-rfa-triton-self-check skips it); causal_rfa_chunked (rfa.py, torch
operations) otherwise. Incremental decoding does not come here: it runs the decoding step's kernels (kernel_choice.py).
The chunked torch path stays the reference the Triton kernels are tested against (tests/test_triton_kernels.py on
the CPU through Triton's interpreter, tests/test_cuda.py on a GPU) and checked against on the user's device.
"""
import functools
import warnings

from ..gpu import triton_self_check
from .rfa import DENOMINATOR_EPS, causal_rfa_chunked
from ..gpu.triton_support import triton_import_error, triton_usable

SEQUENCE_KERNELS = ("auto", "torch")  # --rfa-sequence-kernel


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
