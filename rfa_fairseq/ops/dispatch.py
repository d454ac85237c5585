"""Causal RFA over whole sequences (training, scoring), the implementation picked per call:

    causal_rfa(phi_q, phi_k, v, log_gate=None, state=None, *, chunk_size, sequence_kernel) -> (out, state)

causal_rfa_fla on CUDA when flash-linear-attention is installed and --rfa-sequence-kernel is auto,
causal_rfa_chunked otherwise, and also for gated passes that need gradients where fla computes their
backward wrongly (fla_gated_backward_error: Hopper GPUs under Triton < 3.7.1). Incremental decoding does not come here: it runs the decoding step's kernels
(decode_step.py). The chunked torch path stays the reference: the fla path is tested against it on CUDA
(tests/test_cuda.py).
"""
import torch

from .fla_backend import causal_rfa_fla, fla_available, fla_differentiates_gated
from .rfa import DENOMINATOR_EPS, causal_rfa_chunked

SEQUENCE_KERNELS = ("auto", "torch")  # --rfa-sequence-kernel


def causal_rfa(phi_q, phi_k, v, log_gate=None, state=None, *, chunk_size: int, sequence_kernel: str,
               eps: float = DENOMINATOR_EPS):
    """phi_q, phi_k: (B, H, T, F)   v: (B, H, T, d)   log_gate: (B, H, T) or None
    state: None or a (B, H, F, d + 1) tensor entering the sequence -> out (B, H, T, d) fp32, final state

    chunk_size: the torch path's chunks (--rfa-chunk-size). sequence_kernel: "auto" (fla on CUDA when usable)
    or "torch" (--rfa-sequence-kernel). The model's options (RFAConfig) are their only defaults.
    """
    if sequence_kernel == "auto" and fla_available(phi_q) and (log_gate is None or not _needs_grad(
            phi_q, phi_k, v, log_gate, state) or fla_differentiates_gated()):
        return causal_rfa_fla(phi_q, phi_k, v, log_gate, state, chunk_size=chunk_size, eps=eps)
    return causal_rfa_chunked(phi_q, phi_k, v, log_gate, state, chunk_size=chunk_size, eps=eps)


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
