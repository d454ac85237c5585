"""Causal RFA decoding step with a pending beam reorder, fused in C++ on CPU.

    causal_rfa_step_fused(phi_q, phi_k, v, log_gate=None, state=None, order=None, out_state=None)
        -> (out, new_state)

The same step as `causal_rfa_step_` (rfa.py), except that the state entering it is
state[order]: beam search's reorder is not applied when fairseq asks for it but folded
into the next step, so the state is read once and written once per step (reorder,
gated decay, update and read-out in one pass; csrc/rfa_decode_step.cpp) instead of
four or five times. new_state is `out_state` (a spare buffer of the right shape, reused
between steps: double buffering) or a new tensor, never `state` itself.

The C++ step is built once with torch.utils.cpp_extension (a C++ compiler and ninja are
needed; the build is cached under TORCH_EXTENSIONS_DIR, by default
~/.cache/torch_extensions). Without them, on other devices, with autograd, or with
RFA_FUSED_DECODE=0, the torch path runs instead: index_select into out_state, then
`causal_rfa_step_`. Both are tested against `causal_rfa_recurrent` on state[order].
"""
import contextlib
import functools
import logging
import os
import warnings
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor

from .rfa import DENOMINATOR_EPS, causal_rfa_step_

FUSED_DECODE_ENV = "RFA_FUSED_DECODE"  # "0": never build or use the C++ step
EXTENSION_NAME = "rfa_fairseq_decode_step_v2"  # bump when the C++ source changes incompatibly
SOURCE = Path(__file__).with_name("csrc") / "rfa_decode_step.cpp"

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=None)
def load_fused_extension():
    """The compiled C++ module, or None (disabled, or it cannot be built: warned once)."""
    if os.environ.get(FUSED_DECODE_ENV, "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import load

        logger.info("building/loading the fused C++ RFA decoding step (%s; built once, then cached)", SOURCE.name)
        with _pinned_ninja_first_on_path():
            return load(name=EXTENSION_NAME, sources=[str(SOURCE)], extra_cflags=["-O3", "-fopenmp"],
                        extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as error:  # no compiler, no ninja, read-only cache, ...
        first_line = (str(error).strip().splitlines() or [""])[0]
        warnings.warn(
            f"rfa_fairseq: the fused C++ decoding step could not be built ({type(error).__name__}: {first_line}); "
            f"decoding uses the torch path instead (same results, slower). Set {FUSED_DECODE_ENV}=0 to skip the build."
        )
        return None


@contextlib.contextmanager
def _pinned_ninja_first_on_path():
    """Build with the same ninja in every process: the pinned `ninja` package when installed.
    Ninja versions keep incompatible build logs (1.11 and 1.13 hash commands differently), so
    a process finding the system ninja and the next one the package's would each rebuild."""
    try:
        import ninja

        bin_dir = ninja.BIN_DIR
    except (ImportError, AttributeError):
        yield
        return
    old_path = os.environ.get("PATH", "")
    os.environ["PATH"] = bin_dir + os.pathsep + old_path
    try:
        yield
    finally:
        os.environ["PATH"] = old_path


def _fused_applies(phi_q: Tensor, state: Optional[Tensor]) -> bool:
    return (
        phi_q.device.type == "cpu"
        and phi_q.dtype == torch.float32
        and not torch.is_grad_enabled()
        and (state is None or (state.dtype == torch.float32 and state.is_contiguous() and not state.requires_grad))
    )


def causal_rfa_step_fused(phi_q, phi_k, v, log_gate=None, state=None, order=None, out_state=None,
                          eps: float = DENOMINATOR_EPS):
    """phi_q, phi_k: (B, H, 1, F)   v: (B, H, 1, d)   log_gate: (B, H, 1)
    state: (B0, H, F, d + 1) or None   order: (B,) int64 rows of state, or None (identity)
    -> out (B, H, 1, d) fp32, new_state (B, H, F, d + 1) fp32
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

    ext = load_fused_extension() if _fused_applies(phi_q, state) else None
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
