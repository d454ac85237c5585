"""Plain reference implementations: the formulas as written, slow and simple; the fast ops
(rfa.py, step.py, gpu/triton_chunk.py, gpu/triton_step.py) and feature maps (feature_maps.py) are tested against them.
Only torch is imported here: a reference shares no code with what it checks.

As in flash-linear-attention (ops/*/naive.py beside the chunked and fused kernels), the
attention references share the fast ops' signature

    f(phi_q, phi_k, v, log_gate=None, state=None, eps=...) -> (out, state)

with the shapes and the state layout of rfa.py's docstring.
"""
import math
from typing import Optional

import torch
from torch import Tensor

DENOMINATOR_EPS = 1e-3  # rfa.py's default guard


def _fp32(x: Tensor) -> Tensor:
    """fp64 stays fp64 (tight tests); anything else is accumulated in fp32."""
    return x.double() if x.dtype == torch.float64 else x.float()


def _with_ones(v: Tensor) -> Tensor:
    """[v, 1]: (..., d) -> (..., d + 1), the ones column accumulating the denominator."""
    v = _fp32(v)
    return torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)


def _ratio(out_aug: Tensor, eps: float) -> Tensor:
    """(..., d + 1) numerators and denominator -> (..., d) guarded ratio."""
    return out_aug[..., :-1] / torch.clamp(out_aug[..., -1:], min=eps)

# ---------------------------------------------------------------- feature maps


def feature_map_reference(x_scaled: Tensor, w: Tensor, kind: str) -> Tensor:
    """One random vector at a time, straight from the formulas in the module docstring."""
    num_features = w.size(1)
    feats = []
    for i in range(num_features):
        wx = (x_scaled * w[:, i].to(x_scaled.dtype).unsqueeze(1)).sum(-1)  # (B, H, T)
        if kind == "sincos":
            feats.append((torch.sin(wx), torch.cos(wx)))
        elif kind == "arccos":
            feats.append((torch.clamp(wx, min=0),))
        elif kind == "positive":
            feats.append((torch.exp(wx - 0.5 * (x_scaled**2).sum(-1)),))
        else:
            raise ValueError(kind)
    # sincos layout is [sin_1..sin_D, cos_1..cos_D]
    columns = [f[j] for j in range(len(feats[0])) for f in feats]
    return torch.stack(columns, dim=-1) / math.sqrt(num_features)


def learned_feature_map_reference(x: Tensor, w: Optional[Tensor], b: Optional[Tensor], kind: str) -> Tensor:
    """One position and head at a time, straight from the formulas in the module docstring."""
    x = x.double()
    B, H, T, d = x.shape
    out = []
    for bi in range(B):
        for h in range(H):
            for t in range(T):
                xi = x[bi, h, t]
                if kind == "elu":
                    out.append(torch.where(xi > 0, xi + 1, torch.exp(xi)))
                    continue
                z = w[h].double() @ xi + b[h].double()
                if kind == "hedgehog":
                    out.append(torch.cat([torch.exp(z) / torch.exp(z).sum(), torch.exp(-z) / torch.exp(-z).sum()]))
                elif kind == "relu":
                    out.append(torch.clamp(z, min=0) / math.sqrt(z.numel()))
                else:
                    raise ValueError(kind)
    return torch.stack(out).view(B, H, T, -1)


def exact_kernel(x_scaled: Tensor, y_scaled: Tensor, kind: str) -> Optional[Tensor]:
    """The kernel each feature map estimates, for tests. (B, H, Tq, d), (B, H, Tk, d) -> (B, H, Tq, Tk)."""
    if kind == "sincos":
        return torch.exp(-0.5 * torch.cdist(x_scaled, y_scaled).pow(2))
    if kind == "positive":
        return torch.exp(x_scaled @ y_scaled.transpose(-1, -2))
    if kind == "arccos":
        # degree-1 arc-cosine kernel with the E[relu(w.x) relu(w.y)] normalization
        nx, ny = x_scaled.norm(dim=-1), y_scaled.norm(dim=-1)
        cos = (x_scaled @ y_scaled.transpose(-1, -2)) / (nx.unsqueeze(-1) * ny.unsqueeze(-2))
        theta = torch.acos(cos.clamp(-1, 1))
        j1 = torch.sin(theta) + (math.pi - theta) * torch.cos(theta)
        return nx.unsqueeze(-1) * ny.unsqueeze(-2) * j1 / (2 * math.pi)
    return None


# ---------------------------------------------------------------- causal


def _causal_decay(q: Tensor, log_gate: Optional[Tensor]) -> Tensor:
    """decay[t, i] = prod_{i<j<=t} g_j for i <= t, else 0: (T, T) ungated, (B, H, T, T) gated."""
    T = q.size(-2)
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    if log_gate is None:
        return causal.to(q.dtype)
    cum = log_gate.to(q.dtype).cumsum(-1)  # (B, H, T)
    return torch.exp((cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(~causal, -math.inf))


def causal_rfa_reference(phi_q, phi_k, v, log_gate=None, state=None, eps: float = DENOMINATOR_EPS):
    """O(T^2) masked form: out_t = sum_{i<=t} (prod_{i<j<=t} g_j) phi(q_t).phi(k_i) [v_i, 1]."""
    q, k, va = _fp32(phi_q), _fp32(phi_k), _with_ones(v)
    decay = _causal_decay(q, log_gate)  # (T, T) or (B, H, T, T)
    if log_gate is None:
        decay_from_start = q.new_ones(q.shape[:-1])  # (B, H, T)
        decay_to_end = q.new_ones(q.shape[:-1])
        total = q.new_zeros(q.shape[:-2])
    else:
        cum = log_gate.to(q.dtype).cumsum(-1)  # (B, H, T)
        decay_from_start = torch.exp(cum)
        decay_to_end = torch.exp(cum[..., -1:] - cum)
        total = cum[..., -1]
    out = ((q @ k.transpose(-1, -2)) * decay) @ va  # (B, H, T, d + 1)
    new_state = (k * decay_to_end.unsqueeze(-1)).transpose(-1, -2) @ va  # (B, H, F, d + 1)
    if state is not None:
        out = out + (q * decay_from_start.unsqueeze(-1)) @ state
        new_state = new_state + torch.exp(total)[..., None, None] * state
    return _ratio(out, eps), new_state


def causal_rfa_recurrent(phi_q, phi_k, v, log_gate=None, state=None, eps: float = DENOMINATOR_EPS):
    """The literal recurrence, one step at a time (the decoding step's reference)."""
    q, k, va = _fp32(phi_q), _fp32(phi_k), _with_ones(v)
    B, H, T, F_ = q.shape
    if state is None:
        state = q.new_zeros(B, H, F_, va.size(-1))
    outs = []
    for t in range(T):
        update = k[:, :, t].unsqueeze(-1) * va[:, :, t].unsqueeze(-2)  # (B, H, F, d + 1)
        if log_gate is not None:
            state = torch.exp(log_gate[:, :, t].to(q.dtype))[..., None, None] * state
        state = state + update
        outs.append((q[:, :, t].unsqueeze(-2) @ state).squeeze(-2))
    return _ratio(torch.stack(outs, dim=2), eps), state


# ---------------------------------------------------------------- non-causal


def noncausal_rfa_reference(phi_q, phi_k, v, log_gate=None, state=None, eps: float = DENOMINATOR_EPS):
    """Explicit (Tq x Tk) kernel matrix; state is ignored (it is derived from phi_k, v)."""
    va = _with_ones(v)
    q, k = _fp32(phi_q), _fp32(phi_k)
    out = (q @ k.transpose(-1, -2)) @ va
    return _ratio(out, eps), k.transpose(-1, -2) @ va


# ---------------------------------------------------------------- attention weights


def rfa_attention_weights(phi_q, phi_k, log_gate=None, causal: bool = True, eps: float = DENOMINATOR_EPS) -> Tensor:
    """The attention matrix RFA applies without forming it: out = weights @ v in the references above.

    weights[t, i] = decay[t, i] phi(q_t).phi(k_i) / max(sum_i decay[t, i] phi(q_t).phi(k_i), eps), (B, H, Tq, Tk);
    decay as in causal_rfa_reference when causal, 1 otherwise. For comparing RFA with softmax attention
    (distillation, fidelity reports), never for decoding.
    """
    if log_gate is not None and not causal:
        raise ValueError("the gate exists only in causal RFA")
    q, k = _fp32(phi_q), _fp32(phi_k)
    scores = q @ k.transpose(-1, -2)  # (B, H, Tq, Tk)
    if causal:
        scores = scores * _causal_decay(q, log_gate)
    return scores / scores.sum(-1, keepdim=True).clamp_min(eps)


def quantize_rows_reference(x: Tensor, zero_point: int = 64):
    """Symmetric per-row quantization of x (R, C) to codes zero_point +- (zero_point - 1):
    -> (codes uint8, scales (R,)) with x ~ (codes - zero_point) * scale of the row."""
    scales = x.abs().amax(dim=1) / (zero_point - 1)
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = torch.clamp(torch.round(x / scales[:, None]) + zero_point, 0, 2 * zero_point - 1).to(torch.uint8)
    return codes, scales
