"""fla_backend's glue on the CPU: layout, packing into one sequence with cu_seqlens, the ones
column, states and gradients, with fla's kernels replaced by a stand-in that computes fla's
documented simple-GLA contract literally. The kernels themselves are tested on CUDA (test_cuda.py)."""
import warnings

import pytest
import torch

from rfa_fairseq.ops import causal_rfa, fla_available, fla_backend
from rfa_fairseq.ops.naive import causal_rfa_reference
from rfa_fairseq.ops.rfa import causal_rfa_chunked, gate_keys


def simple_gla(q, k, v, g=None, scale=None, initial_state=None, cu_seqlens=None):
    """S_t = exp(g_t) S_{t-1} + k_t v_t^T, o_t = scale q_t S_t, per segment of cu_seqlens.
    q, k: (B, T, H, K)   v: (B, T, H, V)   g: (B, T, H)   initial_state: (N, H, K, V)"""
    assert q.dtype == k.dtype == v.dtype == torch.float32, "fla gets fp32 inputs"
    bounds = cu_seqlens.tolist() if cu_seqlens is not None else None
    segments = list(zip(bounds[:-1], bounds[1:])) if bounds else [(0, q.size(1))] * q.size(0)
    outs, states = [], []
    for n, (start, end) in enumerate(segments):
        row = 0 if bounds else n
        S = initial_state[n] if initial_state is not None else q.new_zeros(q.size(2), k.size(-1), v.size(-1))
        for t in range(start, end):
            if g is not None:
                S = torch.exp(g[row, t])[:, None, None] * S
            S = S + k[row, t].unsqueeze(-1) * v[row, t].unsqueeze(-2)  # (H, K, V)
            outs.append(scale * (q[row, t].unsqueeze(-2) @ S).squeeze(-2))
        states.append(S)
    out = torch.stack(outs).view(q.shape[:2] + (q.size(2), v.size(-1)))
    return out, torch.stack(states)


def chunk_stand_in(q, k, v, g=None, scale=None, initial_state=None, output_final_state=False,
                   cu_seqlens=None, cu_seqlens_cpu=None):
    assert q.size(0) == 1 and torch.equal(cu_seqlens.cpu(), cu_seqlens_cpu), "packed: one sequence, B segments"
    return simple_gla(q, k, v, g, scale, initial_state, cu_seqlens_cpu)


@pytest.fixture
def stand_in(monkeypatch):
    monkeypatch.setattr(fla_backend, "_fla_ops", lambda: chunk_stand_in)


def test_cpu_tensors_take_the_torch_path():
    x = torch.rand(1, 1, 3, 4)
    assert not fla_available(x)
    out, state = causal_rfa(x, x, torch.rand(1, 1, 3, 2), chunk_size=64, sequence_kernel="auto")
    assert out.shape == (1, 1, 3, 2) and state.shape == (1, 1, 4, 3)


@pytest.mark.parametrize("with_state", [False, True], ids=["zero_state", "initial_state"])
@pytest.mark.parametrize("gated", [False, True], ids=["ungated", "gated"])
def test_packed_chunked_call_matches_reference_with_gradients(stand_in, gated, with_state):
    torch.manual_seed(0)
    B, H, T, F_, d = 3, 2, 70, 6, 4
    phi_q = (torch.rand(B, H, T, F_) / 4).requires_grad_()
    phi_k = torch.rand(B, H, T, F_).requires_grad_()
    v = torch.randn(B, H, T, d).requires_grad_()
    logits = torch.randn(B, H, T).requires_grad_() if gated else None
    state = torch.rand(B, H, F_, d + 1).requires_grad_() if with_state else None
    pad = torch.zeros(B, T, dtype=torch.bool)
    pad[1, -17:] = True
    w_out, w_state = torch.randn(B, H, T, d), torch.randn(B, H, F_, d + 1)
    leaves = [x for x in (phi_q, phi_k, v, logits, state) if x is not None]
    results = []
    for fn, cast in ((fla_backend.causal_rfa_fla, lambda x: x), (causal_rfa_reference, lambda x: x.double())):
        k, log_gate = gate_keys(cast(phi_k), cast(logits) if gated else None, pad)
        out, final = fn(cast(phi_q), k, cast(v), log_gate, cast(state) if with_state else None)
        assert final.shape == (B, H, F_, d + 1)
        grads = torch.autograd.grad((out * cast(w_out)).sum() + (final * cast(w_state)).sum(), leaves)
        results.append([out, final, *grads])
    for got, want in zip(*results):
        torch.testing.assert_close(got.double(), want.double(), rtol=1e-5, atol=1e-5)
    assert results[0][0].dtype == results[0][1].dtype == torch.float32


@pytest.mark.parametrize("refused", [False, True], ids=["fla_differentiates", "gated_backward_refused"])
def test_gated_passes_with_gradients_leave_fla_where_its_backward_is_refused(monkeypatch, refused):
    """Where fla refuses its gated backward (Hopper GPUs under Triton < 3.7.1), causal_rfa sends gated
    passes that need gradients to the chunked torch path, with one warning; ungated passes and passes
    without gradients (validation, scoring) still go to fla."""
    from rfa_fairseq.ops import dispatch

    calls = []
    monkeypatch.setattr(dispatch, "fla_available", lambda tensor: True)
    monkeypatch.setattr(dispatch, "causal_rfa_fla", lambda *args, **kwargs: calls.append("fla"))
    monkeypatch.setattr(fla_backend, "fla_gated_backward_error", lambda: "fla's gated backward is wrong (test)" if refused else None)
    fla_backend._warn_once.cache_clear()
    q, k = torch.rand(1, 2, 6, 4, requires_grad=True), torch.rand(1, 2, 6, 4)
    v, log_gate = torch.randn(1, 2, 6, 3), -torch.rand(1, 2, 6)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = causal_rfa(q, k, v, log_gate, chunk_size=64, sequence_kernel="auto")
        causal_rfa(q, k, v, log_gate, chunk_size=64, sequence_kernel="auto")
    messages = [str(w.message) for w in caught]
    if refused:
        assert calls == [] and torch.equal(out[0], causal_rfa_chunked(q, k, v, log_gate)[0])
        assert len(messages) == 1 and "wrong (test)" in messages[0] and "chunked torch path" in messages[0]
    else:
        assert calls == ["fla", "fla"] and messages == []
    calls.clear()
    causal_rfa(q, k, v, chunk_size=64, sequence_kernel="auto")  # ungated
    with torch.no_grad():
        causal_rfa(q, k, v, log_gate, chunk_size=64, sequence_kernel="auto")  # no gradients
    assert calls == ["fla", "fla"]
