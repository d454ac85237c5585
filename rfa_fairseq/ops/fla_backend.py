"""Causal RFA on CUDA through flash-linear-attention (`fla`, optional: pip install .[cuda]).

RFA is fla's scalar-gated linear attention ("simple GLA"),

    S_t = exp(g_t) S_{t-1} + k_t (x) v_t,    o_t = scale * q_t S_t,

with q = phi(q), k = phi(k) (the (1 - g_t) factor already folded in by `gate_keys`),
v = [v, 1] (the ones column accumulates z, so o_t holds numerator and denominator),
g = log_gate (None when ungated: nothing decays) and scale = 1. fla's S is our state:
(B, H, F, d + 1), S in the first d columns and z in the last.

    causal_rfa_fla       whole sequences (training, scoring): chunk_simple_gla, fla's own
                         backward; same contract as causal_rfa_chunked

Dtypes: everything goes to fla in fp32. fla keeps the per-chunk states of its forward in
the input dtype and returns o (numerator and denominator here) in the input dtype, so
fp16/bf16 inputs would round states and sums (and fp16 sums over long inputs overflow).
With fp32 inputs its matmuls run on TF32 tensor cores (Triton's default for fp32 dots,
about 1e-3 relative error per product) and accumulate in fp32; final states are fp32.

Layout: fla takes (B, T, H, K), ours is (B, H, T, F). Whole sequences go to fla as one
packed sequence of B segments of T positions (B = 1 and cu_seqlens, fla's variable-length
form): some of fla's kernels take the batch size as a compile-time constant (its chunk
cumsum and dq/dk kernels), so every new batch size would compile and autotune them again,
and fairseq's token-based batches come in many sizes. Packed, one compiled set serves all
(fla then reads its chunk count back to the host once per forward and backward: a
synchronisation of training passes, not of decoding steps).

fla is imported on the first CUDA call (importing it needs triton and a GPU driver).
`sequence_kernel="torch"` (--rfa-sequence-kernel torch) keeps whole-sequence passes on the torch path
(comparisons, debugging). Incremental decoding runs the decoding step's torch kernels on CUDA
(decode_step.py), not fla.
"""
import functools
import importlib.util
import warnings
from typing import Optional

import torch
from torch import Tensor

from .rfa import DENOMINATOR_EPS, normalize, with_ones

FLA_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # fp64 stays on the torch path


@functools.lru_cache(maxsize=None)
def _fla_ops():
    """fla's chunk_simple_gla, or the import error as a string."""
    try:
        from fla.ops.simple_gla import chunk_simple_gla
    except Exception as error:  # not installed, no triton, no driver, ...
        return f"{type(error).__name__}: {error}"
    return chunk_simple_gla


def fla_import_error() -> Optional[str]:
    """Why fla cannot be used here (None when it imports)."""
    ops = _fla_ops()
    return ops if isinstance(ops, str) else None


def fla_available(tensor: Tensor) -> bool:
    """True for CUDA tensors of an fla dtype when fla imports."""
    if not tensor.is_cuda or tensor.dtype not in FLA_DTYPES:
        return False
    error = fla_import_error()
    if error is not None:
        _warn_once(f"flash-linear-attention is not usable ({error}); causal RFA on CUDA runs the torch path (same "
                   f"results, slower). Install it with `pip install rfa-fairseq[cuda]`, or pass --rfa-sequence-kernel "
                   f"torch to silence this.")
    return error is None


@functools.lru_cache(maxsize=None)
def fla_gated_backward_error() -> Optional[str]:
    """Why fla cannot differentiate gated inputs here (None when it can): fla refuses its gated dq/dk/dg
    kernel on Hopper GPUs (H100, H200) under Triton >= 3.4.0 and < 3.7.1, which computes it wrongly
    (fla issue #640), unless tilelang is installed to run it instead."""
    try:
        import triton
        from fla.utils import env, hardware
    except Exception:  # no fla (fla_available says so) or an fla without these flags (and without the guard)
        return None
    refused = hardware.IS_NVIDIA_HOPPER and env.TRITON_ABOVE_3_4_0 and not getattr(env, "TRITON_ABOVE_3_7_1", False)
    if not refused or importlib.util.find_spec("tilelang") is not None:
        return None
    return (f"fla's gated backward is wrong under Triton {triton.__version__} on Hopper GPUs (fla issue #640; "
            f"Triton >= 3.7.1 or `pip install tilelang` lifts this)")


def fla_differentiates_gated() -> bool:
    """False (with one warning) where fla_gated_backward_error() names a reason."""
    error = fla_gated_backward_error()
    if error is not None:
        _warn_once(f"{error}; gated causal RFA that needs gradients runs the chunked torch path (same results, "
                   f"slower); passes without gradients (validation, scoring) still use fla.")
    return error is None


@functools.lru_cache(maxsize=None)
def _warn_once(message: str) -> None:
    warnings.warn(f"rfa_fairseq: {message}")


def _fla_inputs(phi_q: Tensor, phi_k: Tensor, v: Tensor, log_gate: Optional[Tensor]):
    """(B, H, T, .) -> fla's (B, T, H, .) in fp32; v gets its ones column, log_gate -> (B, T, H)."""
    q = phi_q.float().transpose(1, 2)  # (B, T, H, F)
    k = phi_k.float().transpose(1, 2)  # (B, T, H, F)
    va = with_ones(v.float()).transpose(1, 2)  # (B, T, H, d + 1)
    g = log_gate.float().transpose(1, 2) if log_gate is not None else None  # (B, T, H)
    return q, k, va, g


@functools.lru_cache(maxsize=64)
def _segment_bounds(num_segments: int, length: int, device: torch.device):
    """fla's cu_seqlens for `num_segments` segments of `length` positions, on the device and on the CPU."""
    bounds = torch.arange(0, (num_segments + 1) * length, length, dtype=torch.long)  # (B + 1,)
    return bounds.to(device), bounds


def causal_rfa_fla(phi_q, phi_k, v, log_gate=None, state=None, chunk_size: int = 64, eps: float = DENOMINATOR_EPS):
    """Causal RFA of whole sequences with fla's chunk_simple_gla; gradients flow to every input.

    phi_q, phi_k: (B, H, T, F)   v: (B, H, T, d)   log_gate: (B, H, T) or None
    state: (B, H, F, d + 1) entering the sequence, or None
    -> out (B, H, T, d) fp32, final state (B, H, F, d + 1) fp32

    chunk_size belongs to the torch path (causal_rfa_chunked); fla uses its own chunks of 64.
    Any T works: fla masks the last, partial chunk. eps: the denominator guard (rfa.py).
    """
    chunk_simple_gla = _require_fla()
    B, H, T, _ = phi_q.shape
    packed = [x.reshape((1, B * T) + x.shape[2:]) if x is not None else None for x in _fla_inputs(phi_q, phi_k, v, log_gate)]
    q, k, va, g = packed  # (1, B * T, H, F) twice, (1, B * T, H, d + 1), (1, B * T, H)
    cu_seqlens, cu_seqlens_cpu = _segment_bounds(B, T, phi_q.device)
    initial = state.float() if state is not None else None
    out, final_state = chunk_simple_gla(
        q, k, va, g=g, scale=1.0, initial_state=initial, output_final_state=True,
        cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
    )
    out = out.view(B, T, H, -1).transpose(1, 2)  # (B, H, T, d + 1)
    return normalize(out, eps), final_state  # (B, H, T, d), (B, H, F, d + 1)


def _require_fla():
    ops = _fla_ops()
    if isinstance(ops, str):
        raise RuntimeError(f"flash-linear-attention is not usable: {ops} (pip install rfa-fairseq[cuda])")
    return ops
