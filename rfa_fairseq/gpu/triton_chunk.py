"""Causal RFA over whole sequences in Triton, with its backward: the CUDA path of training and scoring.

    causal_rfa_triton(phi_q, phi_k, v, log_gate=None, state=None, eps=...) -> (out, final_state)

the contract of rfa.causal_rfa_chunked (shapes and state layout in rfa.py's docstring). One program per
(sentence, head) walks the sequence in chunks of BT positions, keeping S = sum phi(k) (x) v and z = sum phi(k)
(the state) in registers: inside a chunk, masked BT x BT products with the gate's decay; across chunks, the
carried state. The normalization out = num / max(den, eps) is fused, so the forward is one launch, and the
backward two: a forward sweep for dq (it needs the state entering each chunk), then a reverse sweep for dk, dv
(they need the gradient of the state leaving each chunk) and the log-gates. Translation's sequences are short
(tens of tokens) and its batches many: parallel over sentences and heads, sequential inside a sentence, and no
host synchronisation (the launches are the whole cost at these sizes).

The gate's gradient: with A_t the cumulative log-gate, out_t depends on A_t through exp(A_t - A_i) and
exp(A_t) S_0, so dL/dA_t = q_t.dq_t - k_t.dk_t, and the log-gate's gradient is its reverse cumulative sum.

Arithmetic in fp32 whatever the inputs' dtype (fp16/bf16 inputs are read and converted); the products run on the
tensor cores in TF32 (Triton's default for fp32 dots, ~1e-3 relative error per product, as fla's kernels). The
final state is returned without gradient (training never uses it; decoding carries states without autograd).
"""
from typing import Optional, Tuple

import torch
from torch import Tensor

from ..ops.rfa import DENOMINATOR_EPS
import triton
import triton.language as tl

from .triton_support import next_power_of_2

MAX_CHUNK = 32  # positions per chunk: at 8 warps the 32 x 64 tiles fit sm_90's 255 registers (the reverse sweep spills <= 192 bytes)


@triton.jit
def _load_rows(ptr, base, t, stride_t, cols, mask_t, mask_c):
    """(BT, BC) rows t (masked) of a (.., T, C) tensor with unit column stride, as fp32."""
    return tl.load(ptr + base + t[:, None] * stride_t + cols[None, :], mask=mask_t[:, None] & mask_c[None, :],
                   other=0.0).to(tl.float32)


@triton.jit
def _decays(G, g_base, t, stride_g, mask_t, causal, GATED: tl.constexpr):
    """The chunk's cumulative log-gates A (BT,), its total, and the causal decay exp(A_t - A_i) (BT, BT)."""
    if GATED:
        a = tl.load(G + g_base + t * stride_g, mask=mask_t, other=0.0).to(tl.float32)
        A = tl.cumsum(a, 0)
        total = tl.sum(a, 0)
        decay = tl.exp(tl.where(causal, A[:, None] - A[None, :], float("-inf")))
    else:
        A = tl.zeros_like(t).to(tl.float32)
        total = tl.sum(A, 0)
        decay = tl.where(causal, 1.0, 0.0)
    return A, total, decay


@triton.jit
def _program(H, F: tl.constexpr, D: tl.constexpr, BT: tl.constexpr, BF: tl.constexpr, BD: tl.constexpr):
    """This program's (sentence, head), its offset in the states, and the chunk's row and column ranges and masks."""
    pid = tl.program_id(0).to(tl.int64)
    rows, cols_f, cols_d = tl.arange(0, BT), tl.arange(0, BF), tl.arange(0, BD)
    causal = rows[:, None] >= rows[None, :]
    return pid, pid // H, pid % H, pid * F * (D + 1), rows, cols_f, cols_d, cols_f < F, cols_d < D, causal


@triton.jit
def _initial_state(S0, state, cols_f, cols_d, mask_f, mask_d, D: tl.constexpr, BF: tl.constexpr, BD: tl.constexpr,
                   HAS_S0: tl.constexpr):
    """S (BF, BD) and z (BF,) entering the sequence: S0's ((B, H, F, D + 1) contiguous), or zeros."""
    S = tl.zeros([BF, BD], dtype=tl.float32)
    z = tl.zeros([BF], dtype=tl.float32)
    if HAS_S0:
        S = tl.load(S0 + state + cols_f[:, None] * (D + 1) + cols_d[None, :], mask=mask_f[:, None] & mask_d[None, :],
                    other=0.0)
        z = tl.load(S0 + state + cols_f * (D + 1) + D, mask=mask_f, other=0.0)
    return S, z


@triton.jit
def _carry(S, z, k, v, A, total):
    """The state leaving a chunk: the one entering it decayed over the chunk, plus its keys decayed to its end."""
    k_decayed = k * tl.exp(total - A)[:, None]
    return S * tl.exp(total) + tl.dot(tl.trans(k_decayed), v), z * tl.exp(total) + tl.sum(k_decayed, 0)


@triton.jit
def _chunk(Q, K, V, G, b, h, start, rows, T, sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, sg_b, sg_h, sg_t,
           cols_f, cols_d, mask_f, mask_d, causal, GATED: tl.constexpr):
    """The chunk at `start`: its positions t and their mask, q, k (BT, BF), v (BT, BD) in fp32, and its decays."""
    t = start + rows
    mask_t = t < T
    q = _load_rows(Q, b * sq_b + h * sq_h, t, sq_t, cols_f, mask_t, mask_f)
    k = _load_rows(K, b * sk_b + h * sk_h, t, sk_t, cols_f, mask_t, mask_f)
    v = _load_rows(V, b * sv_b + h * sv_h, t, sv_t, cols_d, mask_t, mask_d)
    A, total, decay = _decays(G, b * sg_b + h * sg_h, t, sg_t, mask_t, causal, GATED)
    return t, mask_t, q, k, v, A, total, decay


@triton.jit
def _output_grads(DO, O, DEN, do_base, o_base, den_base, t, stride_do, stride_o, cols_d, mask_t, mask_d, eps):
    """dnum (BT, BD) and dden (BT,): the gradient reaching numerator and denominator through num / max(den, eps)."""
    do = _load_rows(DO, do_base, t, stride_do, cols_d, mask_t, mask_d)
    o = _load_rows(O, o_base, t, stride_o, cols_d, mask_t, mask_d)
    den = tl.load(DEN + den_base + t, mask=mask_t, other=0.0)
    guarded = tl.maximum(den, eps)
    dnum = do / guarded[:, None]
    dden = tl.where(den >= eps, -tl.sum(do * o, 1) / guarded, 0.0)
    return dnum, dden


@triton.jit
def chunk_forward(Q, K, V, G, S0, O, DEN, SF, DO, DQ, DAQ, T, H,
                  sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, sg_b, sg_h, sg_t, so_b, so_h, so_t,
                  sdo_b, sdo_h, sdo_t, eps,
                  F: tl.constexpr, D: tl.constexpr, BT: tl.constexpr, BF: tl.constexpr, BD: tl.constexpr,
                  GATED: tl.constexpr, HAS_S0: tl.constexpr, GRAD: tl.constexpr):
    """The forward sweep over the chunks with the state carried. GRAD off: the outputs (O, their denominators DEN (B,
    H, T)) and the final state (SF). GRAD on, with the outputs' gradient DO: dq (DQ, (B, H, T, F) contiguous) and
    q.dq (DAQ (B, H, T), gated only), since dq needs the state entering each chunk."""
    pid, b, h, state, rows, cols_f, cols_d, mask_f, mask_d, causal = _program(H, F, D, BT, BF, BD)
    S, z = _initial_state(S0, state, cols_f, cols_d, mask_f, mask_d, D, BF, BD, HAS_S0)
    for start in range(0, T, BT):
        t, mask_t, q, k, v, A, total, decay = _chunk(Q, K, V, G, b, h, start, rows, T, sq_b, sq_h, sq_t, sk_b, sk_h, sk_t,
                                                    sv_b, sv_h, sv_t, sg_b, sg_h, sg_t, cols_f, cols_d, mask_f, mask_d,
                                                    causal, GATED)
        q_decayed = q * tl.exp(A)[:, None]  # the state entering the chunk decays to each position
        if GRAD:
            dnum, dden = _output_grads(DO, O, DEN, b * sdo_b + h * sdo_h, b * so_b + h * so_h, pid * T, t, sdo_t, so_t,
                                       cols_d, mask_t, mask_d, eps)
            # d out_t / d (q_t . k_i) = exp(A_t - A_i) (dnum_t . v_i + dden_t)
            dscores = (tl.dot(dnum, tl.trans(v)) + dden[:, None]) * decay  # (BT, BT)
            dq = tl.dot(dscores, k) + tl.exp(A)[:, None] * (tl.dot(dnum, tl.trans(S)) + dden[:, None] * z[None, :])
            tl.store(DQ + pid * T * F + t[:, None] * F + cols_f[None, :], dq, mask=mask_t[:, None] & mask_f[None, :])
            if GATED:
                tl.store(DAQ + pid * T + t, tl.sum(q * dq, 1), mask=mask_t)
        else:
            scores = tl.dot(q, tl.trans(k)) * decay  # (BT, BT)
            num = tl.dot(scores, v) + tl.dot(q_decayed, S)
            den = tl.sum(scores, 1) + tl.sum(q_decayed * z[None, :], 1)
            out = num / tl.maximum(den, eps)[:, None]
            tl.store(O + b * so_b + h * so_h + t[:, None] * so_t + cols_d[None, :], out,
                     mask=mask_t[:, None] & mask_d[None, :])
            tl.store(DEN + pid * T + t, den, mask=mask_t)
        S, z = _carry(S, z, k, v, A, total)
    if not GRAD:
        tl.store(SF + state + cols_f[:, None] * (D + 1) + cols_d[None, :], S, mask=mask_f[:, None] & mask_d[None, :])
        tl.store(SF + state + cols_f * (D + 1) + D, z, mask=mask_f)


@triton.jit
def chunk_bwd_dkv(Q, K, V, G, O, DEN, DO, DK, DV, DAQ, DG, DS0, T, H,
                  sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, sg_b, sg_h, sg_t, so_b, so_h, so_t,
                  sdo_b, sdo_h, sdo_t, eps,
                  F: tl.constexpr, D: tl.constexpr, BT: tl.constexpr, BF: tl.constexpr, BD: tl.constexpr,
                  GATED: tl.constexpr, S0_GRAD: tl.constexpr):
    """Reverse sweep: dk, dv (DK (B, H, T, F), DV (B, H, T, D) contiguous), the log-gates' gradient (DG (B, H, T),
    from DAQ's q.dq) and the initial state's (DS0)."""
    pid, b, h, state, rows, cols_f, cols_d, mask_f, mask_d, causal = _program(H, F, D, BT, BF, BD)
    dS = tl.zeros([BF, BD], dtype=tl.float32)  # the gradient of the state leaving the chunk
    dz = tl.zeros([BF], dtype=tl.float32)
    later = tl.sum(tl.zeros([BT], dtype=tl.float32), 0)  # sum of dL/dA over the positions after the chunk
    chunks = tl.cdiv(T, BT)
    for c in range(0, chunks):
        t, mask_t, q, k, v, A, total, decay = _chunk(Q, K, V, G, b, h, (chunks - 1 - c) * BT, rows, T, sq_b, sq_h, sq_t, sk_b, sk_h, sk_t,
                                                    sv_b, sv_h, sv_t, sg_b, sg_h, sg_t, cols_f, cols_d, mask_f, mask_d,
                                                    causal, GATED)
        dnum, dden = _output_grads(DO, O, DEN, b * sdo_b + h * sdo_h, b * so_b + h * so_h, pid * T, t, sdo_t, so_t,
                                   cols_d, mask_t, mask_d, eps)
        scores = tl.dot(q, tl.trans(k)) * decay  # (BT t, BT i)
        dscores = (tl.dot(dnum, tl.trans(v)) + dden[:, None]) * decay
        to_end = tl.exp(total - A)  # (BT,) each key's decay to the chunk's end
        dk = tl.dot(tl.trans(dscores), q) + to_end[:, None] * (tl.dot(v, tl.trans(dS)) + dz[None, :])
        dv = tl.dot(tl.trans(scores), dnum) + to_end[:, None] * tl.dot(k, dS)
        tl.store(DK + pid * T * F + t[:, None] * F + cols_f[None, :], dk, mask=mask_t[:, None] & mask_f[None, :])
        tl.store(DV + pid * T * D + t[:, None] * D + cols_d[None, :], dv, mask=mask_t[:, None] & mask_d[None, :])
        if GATED:
            dA = tl.load(DAQ + pid * T + t, mask=mask_t, other=0.0) - tl.sum(k * dk, 1)
            chunk_sum = tl.sum(dA, 0)
            tl.store(DG + pid * T + t, chunk_sum - tl.cumsum(dA, 0) + dA + later, mask=mask_t)
            later += chunk_sum
        q_decayed = q * tl.exp(A)[:, None]
        dS = dS * tl.exp(total) + tl.dot(tl.trans(q_decayed), dnum)
        dz = dz * tl.exp(total) + tl.sum(q_decayed * dden[:, None], 0)
    if S0_GRAD:
        tl.store(DS0 + state + cols_f[:, None] * (D + 1) + cols_d[None, :], dS, mask=mask_f[:, None] & mask_d[None, :])
        tl.store(DS0 + state + cols_f * (D + 1) + D, dz, mask=mask_f)


def _unit_last_stride(x: Tensor) -> Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _strides(x: Optional[Tensor]) -> Tuple[int, int, int]:
    """(batch, head, position) strides of a (B, H, T, .) or (B, H, T) tensor; zeros for an absent one."""
    return (x.stride(0), x.stride(1), x.stride(2)) if x is not None else (0, 0, 0)


def chunk_positions(T: int) -> int:
    """The positions per chunk (BT) for sequences of T positions: 16 up to 16 positions, else MAX_CHUNK."""
    return min(MAX_CHUNK, max(16, next_power_of_2(T)))


def _meta(q: Tensor, v: Tensor, gated: bool, num_warps: int = 8) -> dict:
    T, F, D = q.size(2), q.size(3), v.size(3)
    return dict(F=F, D=D, BT=chunk_positions(T), BF=max(16, next_power_of_2(F)),
                BD=max(16, next_power_of_2(D)), GATED=gated, num_warps=num_warps)


class _CausalRFA(torch.autograd.Function):
    @staticmethod
    def forward(ctx, phi_q, phi_k, v, log_gate, state, eps):
        q, k, v = (_unit_last_stride(x) for x in (phi_q, phi_k, v))
        B, H, T, F_ = q.shape
        D = v.size(3)
        # out is (T, B, H, D) in memory: the attention's (T, B, C) output is then a view, not a copy
        out = torch.empty(T, B, H, D, dtype=torch.float32, device=q.device).permute(1, 2, 0, 3)
        den = torch.empty(B, H, T, dtype=torch.float32, device=q.device)
        final = torch.empty(B, H, F_, D + 1, dtype=torch.float32, device=q.device)
        s0 = state.float().contiguous() if state is not None else None
        chunk_forward[(B * H,)](q, k, v, log_gate, s0, out, den, final, None, None, None, T, H, *_strides(q), *_strides(k),
                                *_strides(v), *_strides(log_gate), *_strides(out), 0, 0, 0, float(eps),
                                HAS_S0=s0 is not None, GRAD=False, **_meta(q, v, log_gate is not None))
        ctx.save_for_backward(q, k, v, log_gate, s0, out, den)
        ctx.eps, ctx.state_dtype = eps, state.dtype if state is not None else None
        ctx.mark_non_differentiable(final)
        return out, final

    @staticmethod
    def backward(ctx, d_out, _d_final):
        q, k, v, log_gate, s0, out, den = ctx.saved_tensors
        d_out = _unit_last_stride(d_out)
        B, H, T, F_ = q.shape
        D = v.size(3)
        gated = log_gate is not None
        dq = torch.empty(B, H, T, F_, dtype=q.dtype, device=q.device)
        dk = torch.empty(B, H, T, F_, dtype=k.dtype, device=k.device)
        dv = torch.empty(B, H, T, D, dtype=v.dtype, device=v.device)
        daq = torch.empty(B, H, T, dtype=torch.float32, device=q.device) if gated else None
        dg = torch.empty(B, H, T, dtype=log_gate.dtype, device=q.device) if gated else None
        s0_grad = s0 is not None and ctx.needs_input_grad[4]
        ds0 = torch.empty_like(s0) if s0_grad else None
        common = (T, H, *_strides(q), *_strides(k), *_strides(v), *_strides(log_gate), *_strides(out), *_strides(d_out),
                  float(ctx.eps))
        meta = _meta(q, v, gated)
        chunk_forward[(B * H,)](q, k, v, log_gate, s0, out, den, None, d_out, dq, daq, *common, HAS_S0=s0 is not None,
                                GRAD=True, **meta)
        chunk_bwd_dkv[(B * H,)](q, k, v, log_gate, out, den, d_out, dk, dv, daq, dg, ds0, *common, S0_GRAD=s0_grad,
                                **meta)
        return dq, dk, dv, dg, (ds0.to(ctx.state_dtype) if s0_grad else None), None


def causal_rfa_triton(phi_q: Tensor, phi_k: Tensor, v: Tensor, log_gate: Optional[Tensor] = None,
                      state: Optional[Tensor] = None, eps: float = DENOMINATOR_EPS) -> Tuple[Tensor, Tensor]:
    """Causal RFA of whole sequences with the Triton kernels; gradients flow to every input but the final state.

    phi_q, phi_k: (B, H, T, F)   v: (B, H, T, d)   log_gate: (B, H, T) or None   state: (B, H, F, d + 1) or None
    -> out (B, H, T, d) fp32 (a view of a (T, B, H, d) tensor), final state (B, H, F, d + 1) fp32
    """
    B, H, T, F_ = phi_q.shape
    if T == 0:
        final = state.float().clone() if state is not None else phi_q.new_zeros(B, H, F_, v.size(-1) + 1, dtype=torch.float32)
        return phi_q.new_zeros(B, H, 0, v.size(-1), dtype=torch.float32), final
    if log_gate is not None and log_gate.stride(-1) == 0:
        log_gate = log_gate.contiguous()
    return _CausalRFA.apply(phi_q, phi_k, v, log_gate, state, eps)


