"""One decoding step of a causal RFA layer in one Triton launch: the CUDA kernel set's causal_layer_step.

TorchKernels.causal_layer_step (ops/step.py, the reference) spends 16 kernels on a step of one layer:
the feature map's activation, the gate, the new term, the carried state through the beam order, the read-out and the
normalization. On a GPU each is a launch, or a node of the step's CUDA graph, costing more than its arithmetic at
decoding's row counts. Here one program per (row, head) does all of it:

    phi(q), phi(k) from the map's pre-activations (hedgehog: [softmax(p), softmax(-p)]; relu: relu(p) / sqrt(D)) or
    the features themselves; g = sigmoid(gate logit), phi(k) scaled by 1 - g (g = 1 and phi(k) = 0 at a padded key);
    S' = g * state_in[order[r]] + phi(k) (x) [v, 1] into state_out[r];  out = (phi(q) S')[:d] / max((phi(q) S')[d], eps)

with the interface of ops/step.py's docstring (`launch_causal_layer_step`; `causal_layer_step`, which
TritonKernels calls, runs it where triton_self_check trusts it). A hedgehog map's state rows are its two halves
(features of softmax(p), then of softmax(-p)), each a (D, d + 1) block. Arithmetic in fp32; the output in v's dtype.
"""
from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import triton_self_check
from .triton_support import next_power_of_2

ACTIVATIONS = {None: 0, "hedgehog": 1, "relu": 2}  # what turns phi_q / phi_k's columns into features


@triton.jit
def _features(P, base, cols, mask, relu_scale, ACTIVATION: tl.constexpr):
    """One head's features (the first half of a hedgehog map's) and, for hedgehog, the second half."""
    p = tl.load(P + base + cols, mask=mask, other=0.0).to(tl.float32)
    if ACTIVATION == 1:  # hedgehog: softmax(p), softmax(-p) over the head's W pre-activations
        up = tl.exp(tl.where(mask, p - tl.max(tl.where(mask, p, float("-inf")), 0), float("-inf")))
        down = tl.exp(tl.where(mask, -p - tl.max(tl.where(mask, -p, float("-inf")), 0), float("-inf")))
        return up / tl.sum(up, 0), down / tl.sum(down, 0)
    elif ACTIVATION == 2:  # relu(p) / sqrt(W)
        return tl.maximum(p, 0.0) * relu_scale, p
    else:  # the features themselves
        return p, p


@triton.jit
def _half(S_IN, S_OUT, read, write, rows_f, cols_d, mask_f, mask_d, q, k, v, decay,
          D1: tl.constexpr, D: tl.constexpr, HAS_STATE: tl.constexpr):
    """One block of feature rows of the state: S' = decay * S_in + k (x) [v, 1] written out -> (q S')[:D], (q S')[D]."""
    block = rows_f[:, None] * D1 + cols_d[None, :]
    mask = mask_f[:, None] & mask_d[None, :]
    new = k[:, None] * v[None, :]  # (BF, BD)
    new_z = k  # (BF,)
    if HAS_STATE:
        new += decay * tl.load(S_IN + read + block, mask=mask, other=0.0)
        new_z += decay * tl.load(S_IN + read + rows_f * D1 + D, mask=mask_f, other=0.0)
    tl.store(S_OUT + write + block, new, mask=mask)
    tl.store(S_OUT + write + rows_f * D1 + D, new_z, mask=mask_f)
    return tl.sum(q[:, None] * new, 0), tl.sum(q * new_z, 0)


@triton.jit
def causal_step_kernel(PQ, PK, V, GATE, PAD, S_IN, ORDER, S_OUT, OUT, H, stride_p, stride_v, stride_g, eps, relu_scale,
                       W: tl.constexpr, F: tl.constexpr, D: tl.constexpr, BW: tl.constexpr, BD: tl.constexpr,
                       ACTIVATION: tl.constexpr, GATED: tl.constexpr, HAS_PAD: tl.constexpr, HAS_STATE: tl.constexpr,
                       HAS_ORDER: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    r, h = pid // H, pid % H
    cols_w, cols_d = tl.arange(0, BW), tl.arange(0, BD)
    mask_w, mask_d = cols_w < W, cols_d < D
    q1, q2 = _features(PQ, r * stride_p + h * W, cols_w, mask_w, relu_scale, ACTIVATION)
    k1, k2 = _features(PK, r * stride_p + h * W, cols_w, mask_w, relu_scale, ACTIVATION)
    v = tl.load(V + r * stride_v + h * D + cols_d, mask=mask_d, other=0.0).to(tl.float32)
    decay = 1.0
    if GATED:
        logit = tl.load(GATE + r * stride_g + h).to(tl.float32)
        decay = tl.sigmoid(logit)
        keep = tl.sigmoid(-logit)  # the new term's weight 1 - g
        k1 = k1 * keep
        k2 = k2 * keep
    if HAS_PAD:
        padded = tl.load(PAD + r) != 0
        k1 = tl.where(padded, 0.0, k1)
        k2 = tl.where(padded, 0.0, k2)
        decay = tl.where(padded, 1.0, decay)
    source = r
    if HAS_ORDER:
        source = tl.load(ORDER + r)
    D1: tl.constexpr = D + 1
    read = (source * H + h) * F * D1
    write = (r * H + h) * F * D1
    num, den = _half(S_IN, S_OUT, read, write, cols_w, cols_d, mask_w, mask_d, q1, k1, v, decay, D1, D, HAS_STATE)
    if ACTIVATION == 1:  # the second half's rows, W .. 2W - 1
        num2, den2 = _half(S_IN, S_OUT, read + W * D1, write + W * D1, cols_w, cols_d, mask_w, mask_d, q2, k2, v, decay,
                           D1, D, HAS_STATE)
        num += num2
        den += den2
    out = num / tl.maximum(den, eps)
    tl.store(OUT + r * H * D + h * D + cols_d, out, mask=mask_d)


def causal_layer_step(phi_q: Tensor, phi_k: Tensor, v: Tensor, gate_logits: Optional[Tensor], key_pad: Optional[Tensor],
                      state_in: Optional[Tensor], order: Optional[Tensor], state_out: Tensor, eps: float,
                      activation: Optional[str] = None) -> Tensor:
    """The CUDA kernel set's step (TritonKernels): `launch_causal_layer_step` where the self-check trusts it for
    this call's variant on its device, else TorchKernels' (triton_self_check.causal_layer_step)."""
    return triton_self_check.causal_layer_step(phi_q, phi_k, v, gate_logits, key_pad, state_in, order, state_out, eps,
                                               activation)


def launch_causal_layer_step(phi_q: Tensor, phi_k: Tensor, v: Tensor, gate_logits: Optional[Tensor],
                             key_pad: Optional[Tensor], state_in: Optional[Tensor], order: Optional[Tensor],
                             state_out: Tensor, eps: float, activation: Optional[str] = None) -> Tensor:
    """TorchKernels.causal_layer_step's contract (ops/step.py) in one launch, unchecked."""
    _, H, F_, D1 = state_out.shape
    R, D = v.size(0), D1 - 1
    W = phi_q.size(1) // H
    for name, x in (("phi_q", phi_q), ("phi_k", phi_k), ("v", v), ("gate_logits", gate_logits)):
        if x is not None and x.stride(-1) != 1:
            raise ValueError(f"causal_layer_step: {name} needs unit column stride, got strides {tuple(x.stride())}")
    if phi_k.stride(0) != phi_q.stride(0):
        raise ValueError("causal_layer_step: phi_q and phi_k need the same row stride (views of one projection)")
    if not state_out.is_contiguous() or (state_in is not None and not state_in.is_contiguous()):
        raise ValueError("causal_layer_step: the state buffers must be contiguous")
    out = torch.empty(R, H * D, dtype=v.dtype, device=v.device)
    if R == 0:
        return out
    causal_step_kernel[(R * H,)](
        phi_q, phi_k, v, gate_logits, key_pad, state_in, order, state_out, out, H, phi_q.stride(0), v.stride(0),
        gate_logits.stride(0) if gate_logits is not None else 0, float(eps), W ** -0.5,
        W=W, F=F_, D=D, BW=max(16, next_power_of_2(W)), BD=max(16, next_power_of_2(D)), ACTIVATION=ACTIVATIONS[activation],
        GATED=gate_logits is not None, HAS_PAD=key_pad is not None, HAS_STATE=state_in is not None,
        HAS_ORDER=order is not None and state_in is not None, num_warps=2)
    return out
