"""The pure RFA math: feature maps, random matrices, chunked causal vs the references."""
import math

import pytest
import torch
import torch.nn.functional as F
from helpers import CppKernels, cpp_extension, cpu_level_params

from rfa_fairseq.kernel_choice import step_kernels
from rfa_fairseq.ops import (
    DENOMINATOR_EPS,
    FEATURE_MAPS,
    LEARNED_FEATURE_MAPS,
    POSITIVE_EPS,
    RANDOM_FEATURE_MAPS,
    causal_rfa_chunked,
    causal_rfa_recurrent,
    causal_rfa_reference,
    draw_random_matrix,
    exact_kernel,
    feature_map,
    feature_map_reference,
    denominator_eps,
    gate_keys,
    learned_feature_map,
    learned_feature_map_reference,
    noncausal_rfa,
    noncausal_rfa_reference,
    random_matrix_seed,
    scale_inputs,
)


def _unit(x):
    return x / x.norm(dim=-1, keepdim=True)


# ---------------------------------------------------------------- feature maps and matrices


@pytest.mark.parametrize("kind", RANDOM_FEATURE_MAPS)
def test_feature_map_matches_reference(kind):
    x = scale_inputs(torch.randn(2, 3, 5, 8), torch.rand(3, 8) + 0.5)
    w = draw_random_matrix(3, 12, 8, "gaussian", seed=3)
    torch.testing.assert_close(feature_map(x, w, kind), feature_map_reference(x, w, kind), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", LEARNED_FEATURE_MAPS)
def test_learned_feature_map_matches_reference_and_is_nonnegative(kind):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 3, 5, 8, generator=g) * 2
    w, b = torch.randn(3, 12, 8, generator=g), torch.randn(3, 12, generator=g)
    phi = learned_feature_map(x, w, b, kind)
    torch.testing.assert_close(phi.double(), learned_feature_map_reference(x, w, b, kind), rtol=1e-5, atol=1e-6)
    assert (phi >= 0).all()
    # gradients reach the learned weight and bias (none exist for elu)
    if kind != "elu":
        w.requires_grad_(True), b.requires_grad_(True)
        learned_feature_map(x, w, b, kind).pow(2).sum().backward()
        assert w.grad.abs().sum() > 0 and b.grad.abs().sum() > 0


@pytest.mark.parametrize("kind", RANDOM_FEATURE_MAPS)
def test_feature_inner_products_converge_to_the_kernel(kind):
    torch.manual_seed(0)
    x = scale_inputs(torch.randn(1, 2, 6, 8), torch.full((2, 8), 0.8))
    y = scale_inputs(torch.randn(1, 2, 7, 8), torch.full((2, 8), 0.8))
    exact = exact_kernel(x, y, kind)

    def error(num_features):
        errs = []
        for seed in range(8):
            w = draw_random_matrix(2, num_features, 8, "gaussian", seed=seed)
            approx = feature_map(x, w, kind) @ feature_map(y, w, kind).transpose(-1, -2)
            errs.append((approx - exact).abs().mean())
        return torch.stack(errs).mean().item()

    small, large = error(8), error(2048)
    print(f"{kind}: mean |phi.phi - k| D=8: {small:.4f}  D=2048: {large:.4f}")
    assert large < 0.25 * small


def test_orthogonal_matrix_rows_are_orthogonal_within_blocks_and_gaussian_in_norm():
    w = draw_random_matrix(4, 24, 8, "orthogonal", seed=0)  # 3 blocks of 8
    assert w.shape == (4, 24, 8)
    block = w[:, :8]
    gram = block @ block.transpose(-1, -2)
    off_diag = gram - torch.diag_embed(torch.diagonal(gram, dim1=-2, dim2=-1))
    assert off_diag.abs().max() < 1e-4
    # chi(d) norms: E|w|^2 = d, like N(0, I) rows
    norms2 = draw_random_matrix(64, 64, 8, "orthogonal", seed=1).pow(2).sum(-1)
    assert abs(norms2.mean().item() - 8) < 0.5


def test_random_matrix_seed_separates_updates_and_modules():
    seeds = {random_matrix_seed(1, u, m) for u in range(-1, 50) for m in range(12)}
    assert len(seeds) == 51 * 12
    assert random_matrix_seed(1, 5, 2) == random_matrix_seed(1, 5, 2)
    a = draw_random_matrix(2, 4, 8, "orthogonal", random_matrix_seed(1, 5, 2))
    b = draw_random_matrix(2, 4, 8, "orthogonal", random_matrix_seed(1, 5, 2))
    c = draw_random_matrix(2, 4, 8, "orthogonal", random_matrix_seed(1, 6, 2))
    assert torch.equal(a, b) and not torch.allclose(a, c)


# ---------------------------------------------------------------- approximation of softmax


@pytest.mark.parametrize("kind", ["sincos", "positive"])
def test_rfa_approaches_softmax_attention_as_D_grows(kind):
    """With l2-normalized q, k and sigma = tau^-1/2, RFA estimates softmax(q.k / tau) attention."""
    tau = 0.5
    B, H, Tq, Tk, d = 2, 2, 5, 11, 16
    g = torch.Generator().manual_seed(0)
    q, k = _unit(torch.randn(B, H, Tq, d, generator=g)), _unit(torch.randn(B, H, Tk, d, generator=g))
    v = torch.randn(B, H, Tk, d, generator=g)
    exact = torch.softmax(q @ k.transpose(-1, -2) / tau, dim=-1) @ v
    sigma = torch.full((H, d), tau**-0.5)

    def error(num_features):
        errs = []
        for seed in range(6):
            w = draw_random_matrix(H, num_features, d, "orthogonal", seed=seed)
            phi_q = feature_map(scale_inputs(q, sigma), w, kind, is_query=True)
            phi_k = feature_map(scale_inputs(k, sigma), w, kind)
            out, _ = noncausal_rfa(phi_q, phi_k, v)
            errs.append((out - exact).abs().mean())
        return torch.stack(errs).mean().item()

    small, large = error(4), error(1024)
    print(f"{kind}: mean |RFA - softmax| D=4: {small:.4f}  D=1024: {large:.4f}")
    assert large < 0.3 * small
    assert large < 0.1


# ---------------------------------------------------------------- causal: chunked vs references


def _phi(x, sigma, w, kind, is_query=False):
    """Random maps: w is the random matrix; learned maps: w is the weight, bias fixed from w."""
    if kind in LEARNED_FEATURE_MAPS:
        bias = torch.linspace(-0.5, 0.5, w.size(1), dtype=w.dtype).expand(w.shape[:2])
        return learned_feature_map(x, w, bias, kind)
    return feature_map(scale_inputs(x, sigma), w, kind, is_query=is_query)


def _rfa_from_raw(fn, q, k, v, gate_logits, sigma, w, kind, pad_mask, **kw):
    phi_q = _phi(q, sigma, w, kind, is_query=True)
    phi_k = _phi(k, sigma, w, kind)
    phi_k, log_gate = gate_keys(phi_k, gate_logits, pad_mask)
    return fn(phi_q, phi_k, v, log_gate, eps=denominator_eps(kind), **kw)


@pytest.mark.parametrize("kind", FEATURE_MAPS)
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("length,chunk", [(37, 8), (16, 16), (5, 64), (50, 7)])
def test_chunked_causal_equals_reference_outputs_and_gradients(kind, gated, length, chunk):
    B, H, d = 3, 2, 8
    g = torch.Generator().manual_seed(length * 31 + chunk)
    f64 = dict(generator=g, dtype=torch.float64)  # exact comparison; fp32 is covered by the model tests
    leaves = {
        "q": torch.randn(B, H, length, d, **f64),
        "k": torch.randn(B, H, length, d, **f64),
        "v": torch.randn(B, H, length, d, **f64),
        "gate": torch.randn(B, H, length, **f64) if gated else None,
        "sigma": torch.rand(H, d, **f64) + 0.5,
    }
    w = draw_random_matrix(H, 6, d, "orthogonal", seed=length).double()
    pad_mask = torch.zeros(B, length, dtype=torch.bool)
    pad_mask[1, -3:] = True  # right padding
    pad_mask[2, :2] = True  # left padding

    results = {}
    for name, fn, kw in [
        ("reference", causal_rfa_reference, {}),
        ("recurrent", causal_rfa_recurrent, {}),
        ("chunked", causal_rfa_chunked, {"chunk_size": chunk}),
    ]:
        inputs = {n: (t.clone().requires_grad_(True) if t is not None else None) for n, t in leaves.items()}
        out, state = _rfa_from_raw(
            fn, inputs["q"], inputs["k"], inputs["v"], inputs["gate"], inputs["sigma"], w, kind, pad_mask, **kw
        )
        # padded query positions are never used downstream; compare only real ones
        weight = (~pad_mask).double()[:, None, :, None] * torch.linspace(-1, 1, d, dtype=torch.float64)
        (out * weight).sum().add((state**2).sum() * 1e-3).backward()
        grads = {n: t.grad for n, t in inputs.items() if t is not None}
        results[name] = (out.masked_fill(pad_mask[:, None, :, None], 0), state, grads)

    ref_out, ref_state, ref_grads = results["reference"]
    for name in ("recurrent", "chunked"):
        out, state, grads = results[name]
        torch.testing.assert_close(out, ref_out, rtol=1e-9, atol=1e-10, msg=lambda m: f"{name} output: {m}")
        torch.testing.assert_close(state, ref_state, rtol=1e-9, atol=1e-10, msg=lambda m: f"{name} state: {m}")
        for n in ref_grads:
            torch.testing.assert_close(grads[n], ref_grads[n], rtol=1e-8, atol=1e-10, msg=lambda m: f"{name} grad {n}: {m}")


@pytest.mark.parametrize("gated", [False, True])
def test_chunked_causal_continues_from_a_state(gated):
    """Splitting a sequence and carrying the state equals one pass (what decoding relies on)."""
    B, H, T, Fdim, d = 2, 3, 29, 10, 4
    g = torch.Generator().manual_seed(1)
    phi_q, phi_k = torch.rand(B, H, T, Fdim, generator=g), torch.rand(B, H, T, Fdim, generator=g)
    v = torch.randn(B, H, T, d, generator=g)
    log_gate = F.logsigmoid(torch.randn(B, H, T, generator=g)) if gated else None
    full, full_state = causal_rfa_chunked(phi_q, phi_k, v, log_gate, chunk_size=4)
    split = 13
    lg = (lambda s: log_gate[..., s]) if gated else (lambda s: None)
    first, state = causal_rfa_chunked(phi_q[:, :, :split], phi_k[:, :, :split], v[:, :, :split], lg(slice(0, split)), chunk_size=4)
    second, state = causal_rfa_chunked(
        phi_q[:, :, split:], phi_k[:, :, split:], v[:, :, split:], lg(slice(split, None)), state=state, chunk_size=5
    )
    torch.testing.assert_close(torch.cat([first, second], dim=2), full, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, full_state, rtol=1e-5, atol=1e-5)


def test_chunked_causal_memory_is_linear_not_quadratic():
    """The largest intermediate grows like T (chunk states), never like T^2 or T x F x d."""
    from torch.profiler import ProfilerActivity, profile

    def peak_alloc(T):
        phi = torch.rand(1, 1, T, 16)
        v = torch.randn(1, 1, T, 8)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            causal_rfa_chunked(phi, phi, v, torch.full((1, 1, T), -0.1), chunk_size=32)
        return max(e.cpu_memory_usage for e in prof.key_averages())

    small, large = peak_alloc(1024), peak_alloc(8192)
    print(f"largest single allocation: T=1024 {small} B, T=8192 {large} B")
    assert large < 12 * small  # 8x longer: linear would be ~8x, quadratic ~64x
    assert large < 8192 * 8192 * 4 / 8  # far below one T x T fp32 matrix


# ---------------------------------------------------------------- non-causal


@pytest.mark.parametrize("kind", FEATURE_MAPS)
def test_noncausal_excludes_padded_keys_and_matches_reference(kind):
    B, H, Tq, Tk, d = 2, 2, 4, 9, 8
    g = torch.Generator().manual_seed(2)
    q, k, v = torch.randn(B, H, Tq, d, generator=g), torch.randn(B, H, Tk, d, generator=g), torch.randn(B, H, Tk, d, generator=g)
    sigma, w = torch.ones(H, d), draw_random_matrix(H, 16, d, "orthogonal", seed=0)
    pad = torch.zeros(B, Tk, dtype=torch.bool)
    pad[0, :3] = True
    out, state = _rfa_from_raw(noncausal_rfa, q, k, v, None, sigma, w, kind, pad)
    ref, ref_state = _rfa_from_raw(noncausal_rfa_reference, q, k, v, None, sigma, w, kind, pad)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    # changing padded keys/values changes nothing
    k2, v2 = k.clone(), v.clone()
    k2[0, :, :3] += 5
    v2[0, :, :3] -= 7
    out2, _ = _rfa_from_raw(noncausal_rfa, q, k2, v2, None, sigma, w, kind, pad)
    torch.testing.assert_close(out2, out)
    # reusing the cached state gives the same outputs (cross-attention decoding)
    phi_q = _phi(q, sigma, w, kind, is_query=True)
    cached, _ = noncausal_rfa(phi_q, None, None, state=state, eps=denominator_eps(kind))
    torch.testing.assert_close(cached, out)


# ---------------------------------------------------------------- the denominator guard


@pytest.mark.parametrize("gated", [False, True])
def test_outputs_stay_finite_when_the_sincos_denominator_fails(gated):
    """Large sigma makes sin/cos estimates noisy: phi(q).z goes near zero or negative."""
    B, H, T, d = 2, 4, 300, 8
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, T, d, generator=g) for _ in range(3))
    sigma = torch.full((H, d), 6.0).requires_grad_(True)
    w = draw_random_matrix(H, 4, d, "gaussian", seed=0)
    gate = torch.randn(B, H, T, generator=g) if gated else None
    phi_q = feature_map(scale_inputs(q, sigma), w, "sincos", is_query=True)
    phi_k, log_gate = gate_keys(feature_map(scale_inputs(k, sigma), w, "sincos"), gate, None)
    if not gated:
        # the scenario is real: some causal denominators phi(q_t).z_t fall below the guard
        den = (phi_q * phi_k.cumsum(dim=2)).sum(-1)
        assert (den < DENOMINATOR_EPS).any()
    out, _ = causal_rfa_chunked(phi_q, phi_k, v, log_gate, chunk_size=32)
    cross, _ = noncausal_rfa(phi_q, phi_k, v)
    assert torch.isfinite(out).all() and torch.isfinite(cross).all()
    (out.sum() + cross.sum()).backward()
    assert torch.isfinite(sigma.grad).all()


@pytest.mark.parametrize("sigma", [1.0, 2.0, 2.5, 3.0, 4.0])
def test_guard_never_touches_a_healthy_positive_denominator(sigma):
    """FAVOR+ denominators are sums of positive terms, scaled by the per-query shift
    exp(-max_i w_i.q): at large sigma, with few keys (early causal positions), they fall
    below 1e-3 while perfectly healthy. The positive-map guard leaves them alone (out = the
    exact ratio); the absolute sincos guard would have shrunk the output (checked real)."""
    B, H, T, d, D = 1, 2, 16, 16, 256
    g = torch.Generator().manual_seed(int(sigma * 10))
    q, k, v = (torch.randn(B, H, T, d, generator=g, dtype=torch.float64) for _ in range(3))
    sig = torch.full((H, d), sigma, dtype=torch.float64)
    w = draw_random_matrix(H, D, d, "orthogonal", seed=1).double()
    phi_q = feature_map(scale_inputs(q, sig), w, "positive", is_query=True)
    phi_k = feature_map(scale_inputs(k, sig), w, "positive")
    assert denominator_eps("positive") == POSITIVE_EPS
    out, _ = causal_rfa_chunked(phi_q, phi_k, v, eps=denominator_eps("positive"), chunk_size=5)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    weights = (phi_q @ phi_k.transpose(-1, -2)).masked_fill(~causal, 0)  # (B, H, T, T), all >= 0
    exact_ratio = (weights @ v) / weights.sum(-1, keepdim=True)
    torch.testing.assert_close(out, exact_ratio, rtol=1e-10, atol=1e-12)
    cross, _ = noncausal_rfa(phi_q, phi_k, v, eps=denominator_eps("positive"))
    full = phi_q @ phi_k.transpose(-1, -2)
    torch.testing.assert_close(cross, (full @ v) / full.sum(-1, keepdim=True), rtol=1e-10, atol=1e-12)
    if sigma >= 2.5:
        assert (weights.sum(-1) < DENOMINATOR_EPS).any()  # the absolute guard would clip these
        clipped, _ = causal_rfa_chunked(phi_q, phi_k, v, eps=DENOMINATOR_EPS, chunk_size=5)
        assert not torch.allclose(clipped, exact_ratio)


@pytest.mark.parametrize("kernel", ["cpp", "torch"])
@pytest.mark.parametrize("gated", [False, True], ids=["ungated", "gated"])
def test_decoding_steps_with_pending_reorders_equal_the_recurrence_on_reordered_states(kernel, gated):
    """A chain of causal_layer_step calls on two state buffers used in turn (as a decoding state keeps them):
    beam reorders with duplicated rows and a shrinking batch, interleaved with plain steps, equal
    causal_rfa_recurrent on state[order]."""
    kernels = CppKernels(cpp_extension()) if kernel == "cpp" else step_kernels(kernel, torch.device("cpu"),
                                                                                       torch.float32)
    H, Fdim, d = 3, 10, 5
    g = torch.Generator().manual_seed(7)
    orders = [None, None, torch.tensor([1, 1, 0, 5, 3, 4]), None, torch.tensor([2, 0, 3, 3]),
              torch.tensor([3, 2, 1, 0]), torch.tensor([1, 0, 3, 3])]
    rows, ref_state = 6, None
    buffers = [torch.full((rows, H, Fdim, d + 1), float("nan")) for _ in range(2)]  # [last step's, spare]
    with torch.no_grad():
        for step, order in enumerate(orders):
            rows = rows if order is None else order.numel()
            phi_q, phi_k = torch.rand(rows, H, Fdim, generator=g), torch.rand(rows, H, Fdim, generator=g)
            v = torch.randn(rows, H * d, generator=g)
            gate = torch.randn(rows, H, generator=g) if gated else None
            k, log_gate = gate_keys(phi_k.unsqueeze(2), gate.unsqueeze(-1) if gated else None, None)
            start = ref_state if order is None or ref_state is None else ref_state[order]
            ref_out, ref_state = causal_rfa_recurrent(phi_q.unsqueeze(2), k, v.view(rows, H, 1, d), log_gate, start)
            out = kernels.causal_layer_step(phi_q.view(rows, -1), phi_k.view(rows, -1), v, gate, None,
                                            None if step == 0 else buffers[0], order, buffers[1], DENOMINATOR_EPS)
            buffers.reverse()
            torch.testing.assert_close(out, ref_out.reshape(rows, H * d), rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(buffers[0][:rows], ref_state, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("level", cpu_level_params())
@pytest.mark.parametrize("n", [7, 16, 8000, 8003])
def test_cpp_row_log_sum_exp_equals_float64_log_softmax(level, n):
    """The native search's log-softmax of a row (its vectorized exponentials, 16 or 8 lanes at a time where the CPU
    has them, and their partial sums) against float64's: the max exactly, log(sum(exp(x - max))) within a few fp32
    roundings; with -inf entries (pad, masked tokens) and widths that leave vector remainders."""
    ext = cpp_extension()
    g = torch.Generator().manual_seed(n)
    x = 6 * torch.randn(5, n, generator=g)
    x[1, ::3] = -math.inf
    x[2] = -30 + x[2] / 100  # a flat row: the sum of many like terms
    row_max, log_sum = ext.row_log_sum_exp(x.contiguous(), level)
    want = x.double()
    torch.testing.assert_close(row_max, want.max(dim=1).values.float(), rtol=0, atol=0)
    want_log_sum = torch.logsumexp(want - want.max(dim=1, keepdim=True).values, dim=1)
    torch.testing.assert_close(log_sum.double(), want_log_sum, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("level", cpu_level_params())
@pytest.mark.parametrize("first_step", [True, False], ids=["step0", "later"])
def test_cpp_beam_candidates_equal_torch_topk_of_the_sums(level, first_step):
    """The C++ candidates kernel (one pass, no (N, K * V) sums) against the torch kernel, whose reference is
    torch.topk of prev + lprobs: same scores and indices, best first, with NaN counting as -inf, rows that are
    -inf almost everywhere (fewer finite candidates than k: the -inf ones come in index order) and a score
    column read with a stride (a column of the search's buffer)."""
    cpp, ref = CppKernels(cpp_extension(), level), step_kernels("torch", torch.device("cpu"), torch.float32)
    N, K, V, k = 5, 3, 301, 6
    g = torch.Generator().manual_seed(3)
    lprobs = torch.log_softmax(torch.randn(N * K, V, generator=g) * 3, dim=-1)
    lprobs[0, 7] = float("nan")
    lprobs[1, :] = float("nan")
    lprobs[1, 4] = -0.5
    lprobs[3 * K:4 * K, :] = -math.inf  # sentence 3: only EOS is left, in its first two beams
    lprobs[3 * K, 2], lprobs[3 * K + 1, 2] = -0.1, -0.2
    lprobs[:, 1] = -math.inf  # pad
    score_buffer = torch.randn(N * K, 4, generator=g) - 5
    prev = None if first_step else score_buffer[:, 2]  # strided
    expected = torch.empty(N, k), torch.empty(N, k, dtype=torch.long)
    ref.beam_candidates(lprobs.clone(), prev, K, *expected)
    got = torch.empty(N, k), torch.empty(N, k, dtype=torch.long)
    cpp.beam_candidates(lprobs.clone(), prev, K, *got)
    totals = lprobs.nan_to_num(nan=-math.inf, neginf=-math.inf).view(N, K, V)
    totals = totals[:, 0] if first_step else (totals + prev.view(N, K, 1)).view(N, -1)
    torch.testing.assert_close(got[0], expected[0], rtol=0, atol=0)
    assert torch.equal(got[0], totals.gather(1, got[1]))  # the indices point at their scores
    finite = expected[0].isfinite()
    assert torch.equal(got[1][finite], expected[1][finite])
    assert not finite.all()  # sentence 3 (later steps) or sentence 1's NaN row (step 0) run out of finite ones
    for n in range(N):  # -inf candidates: the first ones in index order that are not among the finite
        inf = got[1][n][~finite[n]]
        assert torch.equal(inf, inf.sort().values)
