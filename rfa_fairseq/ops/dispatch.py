"""Causal RFA's one entry point: it picks the implementation for the call.

    causal_rfa(phi_q, phi_k, v, log_gate=None, state=None) -> (out, state)

    state None or a tensor:   whole sequences (training, scoring): causal_rfa_fla on CUDA when
                              fla is installed, causal_rfa_chunked otherwise; the final state is a tensor
    state a CausalRFAState:   incremental decoding; the state object is updated and returned
        one position, no autograd:  the fused step with the pending beam order folded in:
                                    causal_rfa_step_fla (CUDA) | causal_rfa_step_fused (C++ on CPU, torch elsewhere)
        otherwise:                  the recurrence (naive.causal_rfa_recurrent) on state[order]

The static decoding step (modules/static_decoding.py) calls its kernels through here too:

    causal_layer_step, softmax_cross_step, add_layer_norm
        the C++ kernels (csrc/rfa_static_step.cpp) on CPU in fp32 without autograd when decode_kernel
        allows them (auto, cpp), the torch implementations of static_step.py otherwise

The torch path stays the reference: the fla path is tested against it on CUDA (tests/test_cuda.py), the
C++ kernels on CPU (tests/test_ops.py, tests/test_static_decoding.py).
"""
from typing import List, Optional

import torch
from torch import Tensor

from .fla_backend import causal_rfa_fla, causal_rfa_step_fla, fla_available
from . import fused_step
from .fused_step import DECODE_KERNELS, causal_rfa_step_fused
from .naive import causal_rfa_recurrent
from .rfa import DENOMINATOR_EPS, causal_rfa_chunked
from .static_step import add_layer_norm_torch, causal_layer_step_torch, softmax_cross_step_torch

SEQUENCE_KERNELS = ("auto", "torch")  # --rfa-sequence-kernel


class CausalRFAState:
    """Decoding state of one causal RFA layer: S and z, a pending beam order and a spare buffer.

    state: (B0, H, F, d + 1) fp32 or None before the first step
    order: (B,) int64 rows of `state` that the next step starts from, or None (identity). Beam
           search's reorder is not applied when fairseq asks for it but kept here (composed with
           any pending one) and applied by the next step while it reads the state anyway, so a
           reorder costs no pass over the state.
    spare: the previous step's state, the buffer the next step writes into (double buffering)
    """

    __slots__ = ("state", "order", "spare")

    def __init__(self, state: Optional[Tensor] = None):
        self.state = state
        self.order: Optional[Tensor] = None
        self.spare: Optional[Tensor] = None

    def reorder_(self, new_order: Tensor) -> None:
        """Beam search: row i continues from row new_order[i]; new_order may shrink the batch."""
        if self.state is None:
            return
        order = new_order if self.order is None else self.order.index_select(0, new_order)
        self.order = None if is_identity_order(order, self.state.size(0)) else order

    def tensors(self) -> List[Tensor]:
        """Every tensor it holds (state sizes, dtypes)."""
        return [t for t in (self.state, self.order, self.spare) if t is not None]

    def __repr__(self) -> str:
        shape = tuple(self.state.shape) if self.state is not None else None
        return f"CausalRFAState(state={shape}, pending_order={self.order is not None})"


def is_identity_order(order: Tensor, size: int) -> bool:
    if order.is_cuda:  # checking would wait for the GPU at every step; a kept order costs one gather
        return False
    return order.numel() == size and torch.equal(order, torch.arange(size, device=order.device))


def causal_rfa(phi_q, phi_k, v, log_gate=None, state=None, chunk_size: int = 64, eps: float = DENOMINATOR_EPS,
               decode_kernel: str = "auto", sequence_kernel: str = "auto"):
    """phi_q, phi_k: (B, H, T, F)   v: (B, H, T, d)   log_gate: (B, H, T) or None
    state: None, a (B, H, F, d + 1) tensor entering the sequence, or a CausalRFAState (decoding)
    -> out (B, H, T, d) fp32, state (a tensor, or the CausalRFAState, updated)

    chunk_size: the torch path's chunks (whole sequences). decode_kernel: the decoding step,
    "auto" (fla on CUDA, C++ on CPU when they are usable), "torch" or "cpp" (--rfa-decode-kernel).
    sequence_kernel: whole sequences, "auto" (fla on CUDA when usable) or "torch" (--rfa-sequence-kernel).
    """
    if not isinstance(state, CausalRFAState):
        if sequence_kernel not in SEQUENCE_KERNELS:
            raise ValueError(f"sequence_kernel={sequence_kernel!r} is not one of {', '.join(SEQUENCE_KERNELS)}")
        if sequence_kernel == "auto" and fla_available(phi_q):
            return causal_rfa_fla(phi_q, phi_k, v, log_gate, state, chunk_size=chunk_size, eps=eps)
        return causal_rfa_chunked(phi_q, phi_k, v, log_gate, state, chunk_size=chunk_size, eps=eps)
    if decode_kernel not in DECODE_KERNELS:
        raise ValueError(f"decode_kernel={decode_kernel!r} is not one of {', '.join(DECODE_KERNELS)}")

    decoding = state
    previous, order = decoding.state, decoding.order
    decoding.order = None
    if phi_q.size(2) == 1 and not torch.is_grad_enabled():
        # reorder + update + read-out in one pass; the old state becomes the spare buffer
        out, new_state = causal_rfa_decode_step(phi_q, phi_k, v, log_gate, previous, order, out_state=decoding.spare,
                                                eps=eps, decode_kernel=decode_kernel)
        if previous is not None and new_state is not previous:
            decoding.spare = previous
    else:
        if order is not None:
            previous = previous.index_select(0, order)
        out, new_state = causal_rfa_recurrent(phi_q, phi_k, v, log_gate, previous, eps=eps)
    decoding.state = new_state
    return out, decoding


def causal_rfa_decode_step(phi_q, phi_k, v, log_gate=None, state=None, order=None, out_state=None,
                           eps: float = DENOMINATOR_EPS, decode_kernel: str = "auto"):
    """(B, H, 1, F), (B, H, 1, F), (B, H, 1, d), (B, H, 1); state[order] enters the step
    -> out (B, H, 1, d), new state (B, H, F, d + 1)."""
    if decode_kernel == "auto" and fla_available(phi_q):
        return causal_rfa_step_fla(phi_q, phi_k, v, log_gate, state, order, out_state, eps=eps)
    return causal_rfa_step_fused(phi_q, phi_k, v, log_gate, state, order, out_state, eps=eps, kernel=decode_kernel)


# ---------------------------------------------------------------- the static decoding step's kernels

_NONE = torch.empty(0)  # the C++ kernels' "absent" argument
# feature-map activations the C++ causal_layer_step applies itself (its `activation` codes; 0: phi given)
CPP_ACTIVATIONS = {None: 0, "hedgehog": 1, "relu": 2}


def static_step_extension(decode_kernel: str, *tensors: Tensor):
    """The C++ module for the static step's kernels, or None for the torch implementations: C++ on CPU in
    fp32 without autograd, when decode_kernel is auto (and it builds) or cpp (an error when it cannot)."""
    if decode_kernel not in DECODE_KERNELS:
        raise ValueError(f"decode_kernel={decode_kernel!r} is not one of {', '.join(DECODE_KERNELS)}")
    if decode_kernel == "torch":
        return None
    applies = not torch.is_grad_enabled() and all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)
    if decode_kernel == "cpp":
        if any(t.device.type != "cpu" for t in tensors):
            raise ValueError("--rfa-decode-kernel cpp: the C++ decoding step runs on the CPU")
        return fused_step.require_fused_extension() if applies else None
    return fused_step.load_fused_extension() if applies else None


def causal_layer_step(phi_q: Tensor, phi_k: Tensor, v: Tensor, gate_logits: Optional[Tensor], key_pad: Optional[Tensor],
                      state_in: Optional[Tensor], order: Optional[Tensor], state_out: Tensor, out: Tensor,
                      eps: float = DENOMINATOR_EPS, decode_kernel: str = "auto", activation: Optional[str] = None) -> Tensor:
    """One causal RFA layer step into `out` and `state_out` (shapes: static_step.causal_layer_step_torch).
    activation: None (phi_q, phi_k are features) or an affine learned map's activation ("hedgehog", "relu")
    applied here to the pre-activations phi_q, phi_k (in the C++ kernel: per row and head, in the same pass)."""
    if activation not in CPP_ACTIVATIONS:
        raise ValueError(f"activation={activation!r} is not one of {', '.join(map(str, CPP_ACTIVATIONS))}")
    ext = static_step_extension(decode_kernel, phi_q, phi_k, v, state_out)
    if ext is None:
        return causal_layer_step_torch(phi_q, phi_k, v, gate_logits, key_pad, state_in, order, state_out, out, eps,
                                       activation)
    ext.causal_layer_step(phi_q, phi_k, v, _NONE if gate_logits is None else gate_logits,
                          _NONE if key_pad is None else key_pad, _NONE if state_in is None else state_in,
                          _NONE if order is None else order, state_out, out, eps, CPP_ACTIVATIONS[activation])
    return out


def softmax_cross_step(q: Tensor, key: Tensor, value: Tensor, key_bias: Optional[Tensor], beam: int, scaling: float,
                       out: Tensor, weights: Optional[Tensor] = None, decode_kernel: str = "auto") -> Tensor:
    """Softmax cross-attention of one step over per-sentence K, V (shapes: static_step.softmax_cross_step_torch)."""
    ext = static_step_extension(decode_kernel, q, key, value)
    if ext is None:
        return softmax_cross_step_torch(q, key, value, key_bias, beam, scaling, out, weights)
    ext.softmax_cross_step(q, key, value, _NONE if key_bias is None else key_bias, beam, scaling, out,
                           _NONE if weights is None else weights)
    return out


def add_layer_norm(x: Tensor, residual: Optional[Tensor], weight: Tensor, bias: Tensor, eps: float, out: Tensor,
                   decode_kernel: str = "auto") -> Tensor:
    """out = LayerNorm(x + residual) (no residual: LayerNorm(x)); out may be x or residual."""
    ext = static_step_extension(decode_kernel, x, weight)
    if ext is None:
        return add_layer_norm_torch(x, residual, weight, bias, eps, out)
    ext.add_layer_norm(x, _NONE if residual is None else residual, weight, bias, eps, out)
    return out
