"""RFA given feature maps: causal (decoder self-attention) and non-causal (cross / encoder).

The attention functions here share the signature

    f(phi_q, phi_k, v, log_gate=None, state=None) -> (out, state)

phi_q, phi_k: (B, H, T, F)   v: (B, H, T, d)   log_gate: (B, H, T), <= 0
out: (B, H, T, d) fp32       state: (B, H, F, d + 1) fp32

The state holds S = sum phi(k) (x) v in its first d columns and z = sum phi(k) in the
last one (a ones-column appended to v), so one matmul gives numerator and
denominator. With a gate, S_t = g_t S_{t-1} + phi(k_t) (x) v_t where g_t = exp(log_gate_t);
the paper's (1 - g_t) factor on the new term is folded into phi_k by the caller
(`gate_keys`). Padded keys are handled by the caller too: phi_k = 0 and log_gate = 0
there, so they add nothing and decay nothing.

Everything is accumulated in fp32 whatever the input dtype.

Denominator guard (`eps`, a keyword of every function): with sin/cos features phi(q).z is
an unbiased but noisy estimate of a positive sum and can come out near zero or negative.
We divide by max(phi(q).z, DENOMINATOR_EPS). Features carry the sqrt(1/D) scale, so one key
contributes a kernel estimate in [-1, 1] and exp(-2 sigma^2) >= 0.135 in expectation at
sigma = 1; an eps of 1e-3 never touches a healthy denominator and bounds |out| by
1e3 * sum_i |kernel_i| |v_i| when the estimate fails.
Strictly positive features (positive, hedgehog, elu) give a denominator that is a sum of
positive terms: it cannot go negative, but its scale is arbitrary (FAVOR+'s per-query shift
multiplies it by exp(-max_i w_i.q), tiny at large sigma), so an absolute floor of 1e-3 would
clip healthy values. They use POSITIVE_EPS, which only guards an underflow to 0;
`denominator_eps(feature_map)` picks the guard.

The plain references (`*_reference`, the literal recurrence `causal_rfa_recurrent`) are in
naive.py; the fast ops here are tested against them. One decoding step is step.py's.
"""
import math
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

DENOMINATOR_EPS = 1e-3
POSITIVE_EPS = 1e-30


def denominator_eps(feature_map: str) -> float:
    """The denominator guard for a feature map (see the module docstring)."""
    from .feature_maps import POSITIVE_FEATURE_MAPS

    return POSITIVE_EPS if feature_map in POSITIVE_FEATURE_MAPS else DENOMINATOR_EPS


def accumulation_dtype(x: Tensor) -> Tensor:
    """fp32 for fp16/bf16/fp32 inputs; fp64 stays fp64 (tight tests)."""
    return x if x.dtype == torch.float64 else x.float()


def with_ones(v: Tensor) -> Tensor:
    """(B, H, T, d) -> (B, H, T, d + 1) fp32; the ones column accumulates z."""
    v = accumulation_dtype(v)
    return torch.cat([v, v.new_ones(v.shape[:-1] + (1,))], dim=-1)


def normalize(out_aug: Tensor, eps: float) -> Tensor:
    """Numerator / guarded denominator.   (..., d + 1) -> (..., d)."""
    return out_aug[..., :-1] / out_aug[..., -1:].clamp_min(eps)


def gate_keys(
    phi_k: Tensor, gate_logits: Optional[Tensor], key_padding_mask: Optional[Tensor]
) -> Tuple[Tensor, Optional[Tensor]]:
    """Fold the gate and the padding into (phi_k, log_gate).

    phi_k: (B, H, T, F)   gate_logits: (B, H, T) = w_g.x_t + b_g   key_padding_mask: (B, T), True = pad
    g = sigmoid(gate_logits); the new term is weighted by 1 - g = sigmoid(-gate_logits).
    """
    log_gate = None
    if gate_logits is not None:
        gate_logits = accumulation_dtype(gate_logits)
        log_gate = F.logsigmoid(gate_logits)
        phi_k = phi_k * torch.sigmoid(-gate_logits).unsqueeze(-1)
    if key_padding_mask is not None:
        pad = key_padding_mask.unsqueeze(1)  # (B, 1, T)
        phi_k = phi_k.masked_fill(pad.unsqueeze(-1), 0.0)
        if log_gate is not None:
            log_gate = log_gate.masked_fill(pad, 0.0)
    return phi_k, log_gate


# ---------------------------------------------------------------- causal, chunked


def causal_rfa_chunked(phi_q, phi_k, v, log_gate=None, state=None, chunk_size: int = 64, eps: float = DENOMINATOR_EPS):
    """Chunked causal RFA in O(T) memory.

    Inside a chunk of C positions: masked C x C products. Across chunks: per-chunk
    states U_n = phi(K_n)^T [V_n, 1] from one batched matmul, then the state entering
    each chunk as a (decayed) prefix sum over the T / C chunk states. Never builds a
    T x T matrix nor a T x F x d running sum (only (T / C) x F x d).
    """
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    q, k, va = accumulation_dtype(phi_q), accumulation_dtype(phi_k), with_ones(v)
    B, H, T, F_ = q.shape
    d1 = va.size(-1)
    C = min(chunk_size, T)
    N = math.ceil(T / C)
    pad = N * C - T
    if pad:
        # zero keys/values add nothing; zero log-gates decay nothing
        q, k, va = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, va))
        if log_gate is not None:
            log_gate = F.pad(log_gate, (0, pad))
    q = q.view(B, H, N, C, F_)
    k = k.view(B, H, N, C, F_)
    va = va.view(B, H, N, C, d1)
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    scores = q @ k.transpose(-1, -2)  # (B, H, N, C, C)

    # ungated RFA is gated RFA with log_gate = 0 (nothing decays): one form for both
    if log_gate is None:
        log_gate = q.new_zeros(B, H, N * C)
    cum = log_gate.to(q.dtype).view(B, H, N, C).cumsum(-1)  # log decay from chunk start, inclusive
    total = cum[..., -1]  # (B, H, N) log decay across each chunk
    decay = torch.exp((cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(~causal, -math.inf))  # (B, H, N, C, C)
    scores = scores * decay
    # each key decayed to its chunk's end: exp(total - cum) <= 1
    chunk_states = (k * torch.exp(total.unsqueeze(-1) - cum).unsqueeze(-1)).transpose(-1, -2) @ va  # (B, H, N, F, d + 1)
    # S entering chunk n = sum_{m<n} exp(G_n - G_{m+1}) U_m + exp(G_n) S_0, G = exclusive cumsum of totals
    G = total.cumsum(-1) - total  # (B, H, N)
    before = torch.ones(N, N, dtype=torch.bool, device=q.device).tril(-1)
    chunk_decay = torch.exp((G.unsqueeze(-1) - (G + total).unsqueeze(-2)).masked_fill(~before, -math.inf))  # (B, H, N, N)
    prefix = (chunk_decay @ chunk_states.flatten(-2)).view(B, H, N, F_, d1)
    if state is not None:
        prefix = prefix + torch.exp(G)[..., None, None] * state.unsqueeze(2)
    out = scores @ va + (q * torch.exp(cum).unsqueeze(-1)) @ prefix  # (B, H, N, C, d + 1)
    final_state = torch.exp(total[..., -1])[..., None, None] * prefix[:, :, -1] + chunk_states[:, :, -1]

    out = out.view(B, H, N * C, d1)[:, :, :T]
    return normalize(out, eps), final_state


# ---------------------------------------------------------------- non-causal


def noncausal_rfa_state(phi_k: Tensor, v: Tensor) -> Tensor:
    """S = phi(K)^T [V, 1].   (B, H, Tk, F), (B, H, Tk, d) -> (B, H, F, d + 1)."""
    return accumulation_dtype(phi_k).transpose(-1, -2) @ with_ones(v)


def noncausal_rfa(phi_q, phi_k, v, log_gate=None, state=None, eps: float = DENOMINATOR_EPS):
    """S = phi(K)^T [V, 1] once (or reused from `state`), then phi(q) S per query.

    Cross-attention passes the cached state at every decoding step, with phi_k and v None.
    log_gate is accepted for the shared signature; gating is only defined for causal RFA.
    """
    if log_gate is not None:
        raise ValueError("gating is only defined for causal RFA")
    if state is None:
        state = noncausal_rfa_state(phi_k, v)
    return normalize(accumulation_dtype(phi_q) @ state.to(accumulation_dtype(phi_q).dtype), eps), state
