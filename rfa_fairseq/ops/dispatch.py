"""Which implementation of causal RFA runs: fla on CUDA when it is installed, torch/C++ otherwise.

    causal_rfa(...)              whole sequences: causal_rfa_fla | causal_rfa_chunked
    causal_rfa_decode_step(...)  one decoding step with a pending beam order:
                                 causal_rfa_step_fla | causal_rfa_step_fused (C++ on CPU, torch elsewhere)

Both have the signatures of the functions they choose between. The torch path stays the
reference: the fla path is tested against it on CUDA (tests/test_cuda.py).
"""
from .fla_backend import causal_rfa_fla, causal_rfa_step_fla, fla_available
from .fused_step import causal_rfa_step_fused
from .rfa import DENOMINATOR_EPS, causal_rfa_chunked


def causal_rfa(phi_q, phi_k, v, log_gate=None, state=None, chunk_size: int = 64, eps: float = DENOMINATOR_EPS):
    """(B, H, T, F), (B, H, T, F), (B, H, T, d), (B, H, T) -> out (B, H, T, d), state (B, H, F, d + 1)."""
    if fla_available(phi_q):
        return causal_rfa_fla(phi_q, phi_k, v, log_gate, state, chunk_size=chunk_size, eps=eps)
    return causal_rfa_chunked(phi_q, phi_k, v, log_gate, state, chunk_size=chunk_size, eps=eps)


def causal_rfa_decode_step(phi_q, phi_k, v, log_gate=None, state=None, order=None, out_state=None,
                           eps: float = DENOMINATOR_EPS):
    """(B, H, 1, F), (B, H, 1, F), (B, H, 1, d), (B, H, 1); state[order] enters the step
    -> out (B, H, 1, d), new state (B, H, F, d + 1)."""
    if fla_available(phi_q):
        return causal_rfa_step_fla(phi_q, phi_k, v, log_gate, state, order, out_state, eps=eps)
    return causal_rfa_step_fused(phi_q, phi_k, v, log_gate, state, order, out_state, eps=eps)
