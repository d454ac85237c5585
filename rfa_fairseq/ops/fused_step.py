"""Causal RFA decoding step with a pending beam reorder, fused in C++ on CPU.

    causal_rfa_step_fused(phi_q, phi_k, v, log_gate=None, state=None, order=None, out_state=None)
        -> (out, new_state)

The same step as `causal_rfa_step_` (rfa.py), except that the state entering it is
state[order]: beam search's reorder is not applied when fairseq asks for it but folded
into the next step, so the state is read once and written once per step (reorder,
gated decay, update and read-out in one pass; csrc/rfa_decode_step.cpp) instead of
four or five times. new_state is `out_state` (a spare buffer of the right shape, reused
between steps: double buffering) or a new tensor, never `state` itself.

The C++ step comes from rfa_fairseq/ops/extension.py: compiled at install time (setup.py), or
else built just in time with torch.utils.cpp_extension (a C++ compiler and ninja are needed; cached
under TORCH_EXTENSIONS_DIR, by default ~/.cache/torch_extensions), never waiting forever for another
process's build. Without it, on other devices, with autograd, or with kernel="torch"
(--rfa-decode-kernel torch), the torch path runs instead: index_select into out_state, then
`causal_rfa_step_`. Both are tested against `causal_rfa_recurrent` on state[order].
"""
from typing import Optional

import torch
from torch import Tensor

from .extension import load_fused_extension, require_fused_extension  # noqa: F401  (the public API)
from .rfa import DENOMINATOR_EPS, causal_rfa_step_

DECODE_KERNELS = ("auto", "torch", "cpp")  # --rfa-decode-kernel


def _fused_applies(phi_q: Tensor, state: Optional[Tensor]) -> bool:
    return (
        phi_q.device.type == "cpu"
        and phi_q.dtype == torch.float32
        and not torch.is_grad_enabled()
        and (state is None or (state.dtype == torch.float32 and state.is_contiguous() and not state.requires_grad))
    )


def _fused_extension(kernel: str, phi_q: Tensor, state: Optional[Tensor]):
    """The C++ module when `kernel` asks for it and it applies here, else None (the torch path)."""
    if kernel not in DECODE_KERNELS:
        raise ValueError(f"decode kernel {kernel!r} is not one of {', '.join(DECODE_KERNELS)}")
    if kernel == "torch":
        return None
    if kernel == "cpp":
        if phi_q.device.type != "cpu":
            raise ValueError(f"--rfa-decode-kernel cpp: the C++ decoding step runs on the CPU, not {phi_q.device.type}")
        return require_fused_extension() if _fused_applies(phi_q, state) else None
    return load_fused_extension() if _fused_applies(phi_q, state) else None


def causal_rfa_step_fused(phi_q, phi_k, v, log_gate=None, state=None, order=None, out_state=None,
                          eps: float = DENOMINATOR_EPS, kernel: str = "auto"):
    """phi_q, phi_k: (B, H, 1, F)   v: (B, H, 1, d)   log_gate: (B, H, 1)
    state: (B0, H, F, d + 1) or None   order: (B,) int64 rows of state, or None (identity)
    -> out (B, H, 1, d) fp32, new_state (B, H, F, d + 1) fp32

    kernel: "auto" (the C++ step where it applies and builds), "cpp" (the C++ step, an error
    when it cannot be built) or "torch".
    """
    B, H, T, F_ = phi_q.shape
    if T != 1:
        raise ValueError(f"causal_rfa_step_fused takes one position, got {T}")
    if state is None and order is not None:
        raise ValueError("a reorder needs a state to reorder")

    def spare(rows: int) -> Tensor:
        if out_state is not None and out_state is not state and out_state.shape == (rows,) + state.shape[1:]:
            return out_state
        return state.new_empty((rows,) + state.shape[1:])

    ext = _fused_extension(kernel, phi_q, state)
    if ext is None:
        if order is not None:
            state = torch.index_select(state, 0, order, out=spare(order.numel()))
        return causal_rfa_step_(phi_q, phi_k, v, log_gate, state, eps=eps)

    d = v.size(-1)
    if state is None:
        state = phi_q.new_zeros(B, H, F_, d + 1)
    new_state = spare(B)  # never in place: the kernel's pointers must not alias (vectorization)
    decay = torch.exp(log_gate.float()).reshape(B, H).contiguous() if log_gate is not None else phi_q.new_empty(0)
    out = ext.decode_step(
        state,
        order.contiguous() if order is not None else torch.empty(0, dtype=torch.long),
        phi_q.reshape(B, H, F_).contiguous(),
        phi_k.float().reshape(B, H, F_).contiguous(),
        v.float().reshape(B, H, d).contiguous(),
        decay,
        new_state,
        eps,
    )  # (B, H, d)
    return out.view(B, H, 1, d), new_state
