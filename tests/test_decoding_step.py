"""The decoding step (RFATransformerDecoder -> layers -> attentions -> kernel_choice.step_kernels) against the full
forward pass, its C++ kernels against the torch kernels and the plain references, on CPU in fp32 and bf16,
and fairseq-generate with both kernel sets."""
import pytest
import torch
import torch.nn.functional as F
from cli_support import run, synthetic_data, train_generate_model
from conftest import PLUGIN_DIR
from fairseq.sequence_generator import SequenceGenerator
from helpers import (FP32_STATE, CppKernels, build_model, cpp_extension, cpu_level_params, decode_incrementally,
                     random_batch)
from test_model import _state_tensors, assert_beam_reorder_equals_decoding_the_reordered_batch
from tiny_models import tiny_model_flags

from rfa_fairseq.modules.decoding import BatchRows, DecodingState
from rfa_fairseq.kernel_choice import step_kernels
from rfa_fairseq.ops import (AFFINE_FEATURE_MAPS, FEATURE_MAPS, RANDOM_FEATURE_MAPS, activate_learned,
                             causal_rfa_recurrent, draw_random_matrix, feature_map, gate_keys, learned_feature_map,
                             scale_inputs)

TORCH_KERNELS = ["--rfa-decode-kernel", "torch"]
TORCH = step_kernels("torch", torch.device("cpu"), torch.float32)


@pytest.fixture(params=[*cpu_level_params("cpp-"), "torch"])
def kernels(request):
    """The torch kernels, or the C++ module's (which the native step runs) on each instruction-set level of the
    machine's architecture, behind the same interface."""
    if request.param == "torch":
        return step_kernels("torch", torch.device("cpu"), torch.float32)
    return CppKernels(cpp_extension(), request.param.removeprefix("cpp-"))


# ---------------------------------------------------------------- kernels


@pytest.mark.parametrize("case", ["first_step", "identity", "reorder_and_shrink", "padded_key"])
@pytest.mark.parametrize("gated", [False, True], ids=["ungated", "gated"])
@pytest.mark.parametrize("activation", [None, "hedgehog", "relu"], ids=["features", "hedgehog", "relu"])
@torch.no_grad()
def test_causal_layer_step_equals_the_recurrence(kernels, case, gated, activation):
    """feature map + gate + reorder + update + read-out in one step == activate_learned, gate_keys and the
    literal recurrence on state[order]."""
    g = torch.Generator().manual_seed(1)
    R0, H, F_, d = 6, 3, 8, 5
    R = 4 if case == "reorder_and_shrink" else R0
    if activation is None:
        phi_q, phi_k = torch.rand(R, H, F_, generator=g) + 0.1, torch.rand(R, H, F_, generator=g)
        given_q, given_k = phi_q, phi_k
    else:  # pre-activations, spread so that the softmaxes and the relu see both signs and large values
        D = F_ // 2 if activation == "hedgehog" else F_
        given_q, given_k = 4 * torch.randn(R, H, D, generator=g), 4 * torch.randn(R, H, D, generator=g)
        phi_q, phi_k = activate_learned(given_q, activation), activate_learned(given_k, activation)
        assert phi_q.shape == (R, H, F_)
    v = torch.randn(R, H * d + 3, generator=g)[:, 3:]  # a strided view, as the fused projection gives it
    gate = torch.randn(R, H, generator=g) if gated else None
    state = None if case == "first_step" else torch.randn(R0, H, F_, d + 1, generator=g).abs()
    order = torch.tensor([5, 0, 0, 3]) if case == "reorder_and_shrink" else None
    pad = torch.tensor([False, True, False, False, True, False]) if case == "padded_key" else None

    state_out = torch.full((R0 + 2, H, F_, d + 1), float("nan"))  # more rows than needed: rows only shrink
    out = kernels.causal_layer_step(given_q.reshape(R, -1), given_k.reshape(R, -1), v, gate, pad, state, order,
                                    state_out, 1e-6, activation)

    k, log_gate = gate_keys(phi_k.unsqueeze(2), gate.unsqueeze(-1) if gated else None,
                            pad.unsqueeze(-1) if pad is not None else None)
    start = None if state is None else (state[order] if order is not None else state)
    want, want_state = causal_rfa_recurrent(phi_q.unsqueeze(2), k, v.reshape(R, H, 1, d), log_gate, start, eps=1e-6)
    torch.testing.assert_close(out, want.reshape(R, H * d), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(state_out[:R], want_state, rtol=1e-5, atol=1e-6)
    assert torch.isnan(state_out[R:]).all(), "rows past the batch must not be written"


@pytest.mark.parametrize("level", cpu_level_params())
@pytest.mark.parametrize("shape", [(4, 64, 64), (3, 8, 21), (2, 6, 5)], ids=["recipe", "ragged", "narrow"])
@pytest.mark.parametrize("case", ["first_step", "reorder_and_shrink"])
@torch.no_grad()
def test_an_fp16_state_is_the_fp32_steps_state_rounded(level, shape, case):
    """int8 decoding keeps the causal state in fp16 (NativeKernels.state_dtype): a step reads it widened to fp32 and
    stores its fp32 result rounded to fp16, reading out the unrounded result. Against the fp32 step on the widened
    state: the same output and its state rounded, to an fp32 ulp (the compiler fuses the last column's multiply-adds
    per state type) and so at most an fp16 ulp (the recipe's heads x features x head_dim, and widths that leave
    vector remainders). On every instruction-set level: its conversions (F16C, NEON's, or integer arithmetic) round to
    nearest even as torch's .half()."""
    ext = cpp_extension()
    H, F_, d = shape
    g = torch.Generator().manual_seed(2)
    R0, R = 6, (4 if case == "reorder_and_shrink" else 6)
    q, k = 4 * torch.randn(R, H * F_ // 2, generator=g), 4 * torch.randn(R, H * F_ // 2, generator=g)  # hedgehog
    v, gate = torch.randn(R, H * d, generator=g), torch.randn(R, H, generator=g)
    state = None if case == "first_step" else torch.randn(R0, H, F_, d + 1, generator=g).abs().half()
    order = torch.tensor([5, 0, 0, 3]) if case == "reorder_and_shrink" else None
    cpp = CppKernels(ext, level)
    state_out = torch.full((R0 + 2, H, F_, d + 1), float("nan"), dtype=torch.float16)
    out = cpp.causal_layer_step(q, k, v, gate, None, state, order, state_out, 1e-6, "hedgehog")
    want_state = torch.empty(R0 + 2, H, F_, d + 1)
    want = cpp.causal_layer_step(q, k, v, gate, None, None if state is None else state.float(), order, want_state,
                                 1e-6, "hedgehog")
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(state_out[:R].float(), want_state[:R].half().float(), rtol=2 ** -10, atol=1e-7)
    assert (state_out[:R] == want_state[:R].half()).float().mean() > 0.99  # rounded as the fp32 state rounds
    assert torch.isnan(state_out[R:]).all(), "rows past the batch must not be written"
    if state is not None:
        with pytest.raises(RuntimeError, match="differ in layout or dtype"):
            cpp.causal_layer_step(q, k, v, gate, None, state.float(), order, state_out, 1e-6, "hedgehog")


def test_the_cpp_activation_table_names_every_feature_map():
    """The C++ module's feature-map names (its one table) cover every map (the native step computes each) and
    precomputed features, once each; the learned affine maps are among them."""
    ext = cpp_extension()
    assert set(ext.activations) == {"features", *FEATURE_MAPS} and set(AFFINE_FEATURE_MAPS) <= set(ext.activations)
    assert len(set(ext.activations)) == len(ext.activations)


@pytest.mark.parametrize("level", cpu_level_params())
@pytest.mark.parametrize("kind", RANDOM_FEATURE_MAPS + ("elu",))
@torch.no_grad()
def test_causal_layer_step_computes_the_random_and_elu_maps_as_the_modules(level, kind):
    """The C++ kernel's own features of raw per-head inputs (sigma-scaled, l2-normalized random projections; elu)
    equal the feature-map modules' (ops/feature_maps.py), through the whole causal step."""
    ext = cpp_extension()
    g = torch.Generator().manual_seed(4)
    R, H, d, D = 5, 2, 4, 6
    matrix = draw_random_matrix(H, D, d, "orthogonal", seed=3)
    sigma = 0.5 + torch.rand(H, d, generator=g)
    q, k, v = (torch.randn(R, H * d, generator=g) for _ in range(3))
    heads = lambda x: x.view(R, H, 1, d)  # noqa: E731
    if kind == "elu":
        phi_q, phi_k = (learned_feature_map(heads(x), None, None, "elu").view(R, H, -1) for x in (q, k))
    else:
        phi_q = feature_map(scale_inputs(heads(q), sigma), matrix, kind, is_query=True).view(R, H, -1)
        phi_k = feature_map(scale_inputs(heads(k), sigma), matrix, kind, is_query=False).view(R, H, -1)
    F_ = phi_q.size(-1)
    state = torch.rand(R, H, F_, d + 1, generator=g)
    want = TORCH.causal_layer_step(phi_q.reshape(R, -1), phi_k.reshape(R, -1), v, None, None, state, None,
                                   torch.empty(R, H, F_, d + 1), 1e-3)
    got = CppKernels(ext, level).causal_layer_step(q, k, v, None, None, state, None, torch.empty(R, H, F_, d + 1), 1e-3,
                                            kind, sigma if kind != "elu" else None, matrix if kind != "elu" else None)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@torch.no_grad()
def test_causal_layer_step_refuses_an_order_out_of_range():
    ext = cpp_extension()
    state = torch.zeros(2, 1, 2, 3)
    with pytest.raises(RuntimeError, match="order\\[1\\] = 7 is out of range for 2 rows"):
        CppKernels(ext).causal_layer_step(
            torch.ones(2, 2), torch.ones(2, 2), torch.ones(2, 2), None, None, state, torch.tensor([0, 7]),
            torch.empty(2, 1, 2, 3), 1e-3)


@pytest.mark.parametrize("beam", [1, 3])
@pytest.mark.parametrize("with_weights", [False, True])
@torch.no_grad()
def test_softmax_cross_step_equals_softmax_attention(kernels, beam, with_weights):
    g = torch.Generator().manual_seed(2)
    N, H, S, d = 3, 2, 7, 4
    R = N * beam - (beam - 1)  # the last sentence keeps one beam: rows need not fill every group
    q = torch.randn(R, H * d + 2, generator=g)[:, :H * d]
    key, value = torch.randn(N, H, S, d, generator=g), torch.randn(N, H, S, d, generator=g)
    pad = torch.zeros(N, S, dtype=torch.bool)
    pad[1, :3] = True  # left padding of sentence 1
    bias = torch.zeros(N, S).masked_fill(pad, float("-inf"))
    out, weights = kernels.softmax_cross_step(q, key, value, bias, beam, d ** -0.5, with_weights)
    for r in range(R):
        n = r // beam
        scores = torch.einsum("hd,hsd->hs", q[r].view(H, d) * d ** -0.5, key[n]).masked_fill(pad[n], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        torch.testing.assert_close(out[r], torch.einsum("hs,hsd->hd", probs, value[n]).reshape(-1), rtol=1e-5, atol=1e-6)
        if with_weights:
            torch.testing.assert_close(weights[r], probs.mean(0), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("residual, out_is", [(False, "new"), (False, "x"), (True, "new"), (True, "x"), (True, "residual")])
@torch.no_grad()
def test_add_layer_norm_equals_torch(kernels, residual, out_is):
    g = torch.Generator().manual_seed(3)
    x, res = torch.randn(5, 12, generator=g) * 3 + 1, torch.randn(5, 12, generator=g)
    weight, bias = torch.randn(12, generator=g), torch.randn(12, generator=g)
    want = F.layer_norm(x + res if residual else x, (12,), weight, bias, 1e-5)
    if kernels.name == "torch":  # a tensor of its own
        got = kernels.add_layer_norm(x, res if residual else None, weight, bias, 1e-5)
    else:  # the C++ kernel writes into out, which may be x or the residual (the native step's in-place norms)
        out = {"new": torch.empty(5, 12), "x": x, "residual": res}[out_is]
        got = kernels.add_layer_norm(x, res if residual else None, weight, bias, 1e-5, out)
        assert got is out
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- the step in a model

MODEL_VARIANTS = [
    pytest.param(fm, gate, cross, norm, id=f"{fm}-{'gated' if gate else 'ungated'}-{cross}_cross-{norm}")
    for fm, gate, cross, norm in [
        ("hedgehog", True, "softmax", "post"),  # the default
        ("hedgehog", True, "softmax", "pre"),
        ("hedgehog", False, "rfa", "post"),
        ("relu", True, "softmax", "post"),
        ("elu", False, "softmax", "pre"),
        ("sincos", False, "rfa", "post"),  # the paper's setup
        ("sincos", True, "softmax", "post"),
        ("arccos", True, "rfa", "post"),
        ("positive", False, "softmax", "post"),
    ]
]


def _flags(feature_map, gate, cross, norm, *more):
    flags = [*FP32_STATE, "--rfa-feature-map", feature_map, "--rfa-num-features", "6", "--rfa-gate" if gate else "--no-rfa-gate",
             "--rfa-softmax-cross-attn" if cross == "softmax" else "--no-rfa-softmax-cross-attn"]
    return flags + (["--decoder-normalize-before", "--encoder-normalize-before"] if norm == "pre" else []) + list(more)


def _twins(flags, seed=1):
    """The same weights decoding with the default kernels (C++ on CPU in fp32) and with the torch kernels."""
    model, d = build_model(flags, seed=seed)
    torch_kernels, _ = build_model(flags + TORCH_KERNELS, seed=seed, dictionary=d)
    torch_kernels.load_state_dict(model.state_dict())
    return model.eval(), torch_kernels.eval(), d


@pytest.mark.parametrize("feature_map,gate,cross,norm", MODEL_VARIANTS)
def test_decoding_step_equals_the_full_forward_with_either_kernels(feature_map, gate, cross, norm):
    model, torch_kernels, d = _twins(_flags(feature_map, gate, cross, norm))
    src, src_lengths, prev = random_batch(d, bsz=3, src_len=9, tgt_len=10)
    padded = prev.clone()
    padded[1, 4] = d.pad()  # a padded decoder input: a key that adds nothing and decays nothing
    with torch.no_grad():
        full, _ = model(src, src_lengths, prev)
        outs = {}
        for name, m in (("default", model), ("torch", torch_kernels)):
            encoder_out = m.encoder(src, src_lengths=src_lengths)
            for tokens in (prev, padded):
                outs[(name, tokens is padded)] = decode_incrementally(m, encoder_out, tokens, {})
    # fp32 with other summation orders (one fused input projection, the C++ kernels); the random maps'
    # small denominators amplify those roundings, hence 1e-4 rather than 1e-5
    for padded_input in (False, True):
        torch.testing.assert_close(outs[("default", padded_input)], outs[("torch", padded_input)], rtol=1e-4, atol=1e-4)
    # (a padded input shifts fairseq's positions in a full pass, not in incremental decoding: no padding here)
    torch.testing.assert_close(outs[("default", False)], full, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(outs[("torch", False)], full, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("feature_map,gate,cross,norm", MODEL_VARIANTS)
def test_bf16_decoding_step_is_as_close_to_fp32_as_the_bf16_full_forward(feature_map, gate, cross, norm):
    """bf16 weights: the same step (torch kernels, fp32 states); its log-probabilities are about as far from the
    fp32 full forward's as fairseq's bf16 full forward pass is (bf16 rounds to 8 mantissa bits, in another
    order in the step; sincos's noisy denominators amplify that in both)."""
    model, d = build_model(_flags(feature_map, gate, cross, norm))
    model.eval()
    src, src_lengths, prev = random_batch(d, bsz=3, src_len=9, tgt_len=10)
    log_probs = lambda logits: torch.log_softmax(logits.float(), dim=-1)  # noqa: E731
    with torch.no_grad():
        want = log_probs(model(src, src_lengths, prev)[0])
        model.to(torch.bfloat16)
        full = log_probs(model(src, src_lengths, prev)[0])
        state = {}
        incremental = log_probs(decode_incrementally(model, model.encoder(src, src_lengths=src_lengths), prev, state))
    assert state[DecodingState.KEY].kernels.name == "torch"
    full_error, step_error = (full - want).abs().max().item(), (incremental - want).abs().max().item()
    print(f"max |log p - fp32 full|: bf16 full forward {full_error:.3f}, bf16 decoding step {step_error:.3f}")
    assert step_error <= 4 * full_error + 0.02


@pytest.mark.parametrize("cross", ["softmax", "rfa"])
def test_step_reorders_equal_decoding_the_reordered_batch(cross):
    model, _ = build_model(_flags("hedgehog", True, cross, "post"))
    model.eval()
    d = model.decoder.dictionary
    batch = random_batch(d, bsz=4, src_len=8, tgt_len=9, seed=3)
    orders = [torch.tensor(order) for order in ([2, 0, 3, 1], [3, 3, 0, 1], [2, 0])]
    assert_beam_reorder_equals_decoding_the_reordered_batch(model, batch, orders, tolerance=1e-5)


def assert_beam_grouped_state_follows_reorders_and_shrinks(model, src, src_lengths, prev, tolerance):
    """Three sentences in fairseq's beam layout (beam 3, rows sentence-major): the decoding state holds the
    cross-attention once per sentence; a within-beam reorder moves nothing, then sentence 1 leaves; every
    step equals decoding the surviving rows from scratch. src, src_lengths, prev: 3 sentences, on the
    model's device."""
    beam, k, device = 3, 3, src.device
    expand = torch.arange(3, device=device).repeat_interleave(beam)  # how SequenceGenerator lays out beams
    prev = prev[torch.arange(9, device=device) % 3]  # different prefixes per beam
    orders = [torch.tensor([1, 1, 0, 5, 3, 4, 8, 6, 6]), torch.tensor([0, 2, 1, 7, 6, 8])]  # then sentence 1 leaves
    with torch.no_grad():
        model.decoder.set_beam_size(beam)
        # the expansion to beams as SequenceGenerator makes it: a reorder of the encoder output, which records
        # which rows read which sentence
        encoder_out = model.encoder.reorder_encoder_out(model.encoder(src, src_lengths=src_lengths), expand)
        src, src_lengths = src[expand], src_lengths[expand]
        state, rows = {}, torch.arange(9, device=device)
        decode_incrementally(model, encoder_out, prev[:, :k], state)
        decoding = state[DecodingState.KEY]
        assert (decoding.beam, decoding.sentences) == (beam, 3)
        for step, order in enumerate(orders):
            order = order.to(device)
            model.decoder.reorder_incremental_state_scripting(state, order)
            encoder_out = model.encoder.reorder_encoder_out(encoder_out, order)
            rows = rows[order]
            continued = decode_incrementally(model, encoder_out, prev[rows, : k + step + 1], state, start=k + step)
            model.decoder.set_beam_size(1)
            fresh = model.encoder(src[rows], src_lengths=src_lengths[rows])
            scratch = decode_incrementally(model, fresh, prev[rows, : k + step + 1], {})[:, -1:]
            model.decoder.set_beam_size(beam)
            torch.testing.assert_close(continued, scratch, rtol=tolerance, atol=tolerance)
        assert (decoding.beam, decoding.sentences) == (beam, 2)  # compacted, still once per sentence


@pytest.mark.parametrize("cross", ["softmax", "rfa"])
def test_state_keeps_cross_attention_once_per_sentence_and_compacts_finished_ones(cross):
    model, d = build_model(_flags("hedgehog", True, cross, "post"))
    model.eval()
    src, src_lengths, prev = random_batch(d, bsz=3, src_len=8, tgt_len=8, seed=5)
    assert_beam_grouped_state_follows_reorders_and_shrinks(model, src, src_lengths, prev, tolerance=1e-5)


@pytest.mark.parametrize("beam,options", [
    (1, {}), (4, {}), (5, {}),
    (4, {"max_len_b": 3}),  # every hypothesis stopped by the length limit
    (4, {"min_len": 6}),
    (4, {"prefix": 2}),  # --prefix-size 2
])
@pytest.mark.parametrize("feature_map,cross", [("hedgehog", "softmax"), ("sincos", "rfa")])
def test_beam_search_scores_equal_the_full_forward_with_either_kernels(beam, options, feature_map, cross):
    """fairseq's beam search (sentences finishing at different steps, so the batch shrinks): every hypothesis'
    per-token scores and softmax cross-attention weights (the alignment) equal a teacher-forced full forward
    pass, and the C++ and torch kernels find the same hypotheses."""
    model, torch_kernels, d = _twins(_flags(feature_map, True, cross, "post"), seed=4)
    eos_row = torch.randn(model.decoder.output_projection.weight.size(1), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # an end-of-sentence logit that varies with the state: hypotheses of many lengths
        for m in (model, torch_kernels):
            m.decoder.output_projection.weight[d.eos()] = eos_row
    src, src_lengths, prev = random_batch(d, bsz=6, src_len=7, tgt_len=4, seed=9)
    sample = {"net_input": {"src_tokens": src, "src_lengths": src_lengths}}
    options = dict(options)
    prefix = options.pop("prefix", None)
    length_limited = "max_len_b" in options
    kwargs = dict(beam_size=beam, max_len_b=options.pop("max_len_b", 12), normalize_scores=False, **options)
    results = {}
    for name, m in (("default", model), ("torch", torch_kernels)):
        gen = SequenceGenerator([m], d, **kwargs)
        with torch.no_grad():
            results[name] = gen.generate([m], sample, prefix_tokens=prev[:, 1:1 + prefix] if prefix else None)
    lengths = set()
    model.decoder.set_beam_size(1)  # the rescoring batch is one sentence
    for i, (sent, sent_torch) in enumerate(zip(results["default"], results["torch"])):
        assert [h["tokens"].tolist() for h in sent] == [h["tokens"].tolist() for h in sent_torch]
        for hyp in sent:
            tokens = hyp["tokens"]
            lengths.add(len(tokens))
            prev_tokens = torch.cat([tokens.new_tensor([d.eos()]), tokens[:-1]]).unsqueeze(0)
            with torch.no_grad():
                logits, extra = model(src[i: i + 1], src_lengths[i: i + 1], prev_tokens)
            lprobs = torch.log_softmax(logits.float(), dim=-1)[0].gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
            torch.testing.assert_close(hyp["positional_scores"], lprobs, rtol=1e-4, atol=1e-4)
            if cross == "softmax":  # (S, T): the last layer's head-averaged weights
                want = extra["attn"][0][0].transpose(0, 1)
                torch.testing.assert_close(hyp["attention"], want, rtol=1e-4, atol=1e-5)
            else:
                assert hyp["attention"].numel() == 0  # RFA cross-attention has no weights
    assert len(lengths) > 1 or length_limited, "the test needs sentences finishing at different steps"


def test_decoder_start_keeps_kv_per_sentence_only_where_the_rows_are_beam_copies():
    """The decoder reads the beam layout off the encoder output's values (no row bookkeeping in encoder_out): fairseq's
    expansion to beams gives K/V once per sentence, rows that are not copies of one sentence per beam group K/V once
    per row; the logits equal those of the per-row layout either way."""
    model, d = build_model(["--rfa-softmax-cross-attn"])
    model.eval()
    src, src_lengths, _ = random_batch(d, bsz=3, src_len=6, seed=2)
    beam = 2
    with torch.no_grad():
        encoder_out = model.encoder(src, src_lengths=src_lengths)
    model.set_beam_size(beam)
    logits = {}
    for name, order in (("beams", torch.arange(3).repeat_interleave(beam)), ("rows", torch.tensor([0, 1, 1, 2, 2, 0]))):
        reordered = model.encoder.reorder_encoder_out(encoder_out, order)
        incremental_state = {}
        tokens = torch.full((order.numel(), 1), d.eos())
        with torch.no_grad():
            logits[name] = model.decoder(tokens, encoder_out=reordered, incremental_state=incremental_state)[0]
        state = incremental_state[DecodingState.KEY]
        assert (state.beam, state.sentences) == ((beam, 3) if name == "beams" else (1, 6))
        assert state.layers[0].cross.key.size(0) == state.sentences
    torch.testing.assert_close(logits["beams"], logits["rows"][torch.tensor([0, 5, 1, 2, 3, 4])], rtol=0, atol=0)


def test_step_reuses_its_buffers_and_never_overwrites_what_the_caller_keeps():
    model, _, d = _twins(_flags("hedgehog", True, "softmax", "post"))
    src, src_lengths, prev = random_batch(d, bsz=3, src_len=6, tgt_len=6)
    with torch.no_grad():
        encoder_out = model.encoder(src, src_lengths=src_lengths)
        pointers = []
        for _ in range(2):  # two batches: the second one reuses the first one's buffers
            state, kept = {}, []
            for t in range(prev.size(1)):
                logits, _ = model.decoder(prev[:, : t + 1], encoder_out=encoder_out, incremental_state=state)
                if t < 2:
                    kept.append((logits, logits.clone()))  # the caller keeps these: never overwritten
            pointers.append([t.data_ptr() for t in state[DecodingState.KEY].attention_tensors()])
            for held, copy in kept:
                assert torch.equal(held, copy)
            del state
    assert pointers[0] == pointers[1] and len(pointers[0]) > 5


def test_fp32_and_bf16_decode_through_the_same_state_and_what_the_step_cannot_serve_is_named():
    model, d = build_model(_flags("hedgehog", True, "softmax", "post"))
    src, src_lengths, prev = random_batch(d, bsz=2, tgt_len=3)
    encoder_out = model.encoder(src, src_lengths=src_lengths)
    with pytest.raises(RuntimeError, match="without autograd and in eval mode"):
        model.decoder(prev[:, :1], encoder_out=encoder_out, incremental_state={})
    kinds = {}
    for dtype in (torch.float32, torch.bfloat16):
        model.eval().to(dtype)
        state = {}
        with torch.no_grad():
            model.decoder(prev[:, :1], encoder_out=model.encoder(src, src_lengths=src_lengths), incremental_state=state)
        kinds[dtype] = {key: type(entry).__name__ for key, entry in state.items()}  # one reference, nothing else
    assert kinds[torch.float32] == kinds[torch.bfloat16] == {DecodingState.KEY: "DecodingState"}
    model.float()
    with torch.no_grad(), pytest.raises(ValueError, match="does not support alignment_layer other than the last"):
        model.decoder(prev[:, :1], encoder_out=encoder_out, incremental_state={}, alignment_layer=0)
    adaptive, _ = build_model(_flags("hedgehog", True, "softmax", "post", "--adaptive-softmax-cutoff", "20"))
    adaptive.eval()
    with torch.no_grad(), pytest.raises(ValueError, match="RFA incremental decoding does not support adaptive softmax"):
        adaptive.decoder(prev[:, :1], encoder_out=adaptive.encoder(src, src_lengths=src_lengths), incremental_state={})


def test_state_size_is_fixed_by_the_first_step():
    model, _, d = _twins(_flags("hedgehog", True, "softmax", "post"))
    src, src_lengths, _ = random_batch(d, bsz=2, src_len=6)
    tokens = torch.randint(d.nspecial, len(d), (2, 60))
    state, sizes = {}, {}
    with torch.no_grad():
        encoder_out = model.encoder(src, src_lengths=src_lengths)
        for t in range(60):
            model.decoder(tokens[:, : t + 1], encoder_out=encoder_out, incremental_state=state)
            if t + 1 in (2, 60):
                sizes[t + 1] = sum(x.numel() for x in _state_tensors(state))
    assert sizes[2] == sizes[60] > 0


def test_checkpoints_written_before_the_feature_maps_were_modules_load():
    """feature_weight / feature_bias / sigma / log_sigma on the attention module -> phi.*"""
    for flags, renames in ((["--rfa-feature-map", "hedgehog"], {"phi.weight": "feature_weight", "phi.bias": "feature_bias"}),
                           (["--rfa-feature-map", "sincos"], {"phi.sigma": "sigma"}),
                           (["--rfa-feature-map", "positive", "--rfa-sigma", "log"], {"phi.log_sigma": "log_sigma"})):
        model, d = build_model(flags, seed=3)
        old = {}
        for key, value in model.state_dict().items():
            for new, legacy in renames.items():
                if key.endswith("." + new):
                    key = key[: -len(new)] + legacy
            old[key] = value.clone()
        assert any(key.endswith(tuple(renames.values())) for key in old)
        fresh, _ = build_model(flags, seed=9, dictionary=d)
        fresh.load_state_dict(old)
        for (key, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
            assert torch.equal(a, b), key


# ---------------------------------------------------------------- fairseq-generate

@pytest.mark.slow
def test_fairseq_generate_gives_the_same_output_with_the_cpp_and_the_torch_kernels(tmp_path_factory):
    """fairseq-generate with the native step and with the torch step: the static beam search (the native search step
    against the torch one), and fairseq's generator (--print-alignment: the decoder's step through its DecodingState,
    the alignments from the cross-attention weights); then int8 linear layers in both generators."""
    data = synthetic_data(tmp_path_factory)
    checkpoint = train_generate_model(data, tmp_path_factory.mktemp("decode_kernels_generate"), max_update=15)

    def generate(beam, *extra):
        proc = run("fairseq-generate", data / "bin", "--user-dir", PLUGIN_DIR, "--path", checkpoint,
                   "--gen-subset", "test", "--beam", beam, "--batch-size", "16", "--max-len-b", "25",
                   "--required-batch-size-multiple", "1", "--prefix-size", "1", "--cpu", *extra)
        lines = [line for line in proc.stdout.splitlines() if line[:2] in ("H-", "P-", "A-")]
        assert sum(line.startswith("H-") for line in lines) == 40
        return proc.stdout + proc.stderr, lines

    outputs = {}
    for name, kernel in (("cpp", "cpp"), ("torch", "torch")):
        overrides = ["--model-overrides", f"{{'rfa_decode_kernel': '{kernel}'}}"]
        for beam, generator, extra in (("1", "static", []), ("5", "static", []), ("5", "fairseq", ["--print-alignment"])):
            log, outputs[(name, beam, generator)] = generate(beam, *overrides, *extra)
            assert f"decoding step: {'native' if name == 'cpp' else 'torch'} ({name})" in log
            assert ("static beam search generator" in log) == (generator == "static"), (name, beam, generator)
    for beam, generator in (("1", "static"), ("5", "static"), ("5", "fairseq")):
        cpp, torch_kernels = outputs[("cpp", beam, generator)], outputs[("torch", beam, generator)]
        assert len(cpp) == len(torch_kernels)
        for a, b in zip(cpp, torch_kernels):
            fields_a, fields_b = a.split("\t"), b.split("\t")
            if a.startswith("H-"):  # id, score, hypothesis: the same text, the score up to fp32 rounding
                assert (fields_a[0], fields_a[2]) == (fields_b[0], fields_b[2])
                assert abs(float(fields_a[1]) - float(fields_b[1])) <= 1e-4, (a, b)
            elif a.startswith("A-"):  # hard alignments from the cross-attention weights
                assert a == b
            else:  # positional scores, printed with 4 decimals
                diffs = [abs(float(x) - float(y)) for x, y in zip(fields_a[1].split(), fields_b[1].split())]
                assert fields_a[0] == fields_b[0] and max(diffs) <= 2e-4, (a, b)
    # --rfa-decode-precision int8 reaches fairseq-generate's model through --model-overrides: the static search's
    # native int8 step and fairseq's generator on the same int8 kernels give the same lines
    int8 = {}
    for generator, static in (("static", True), ("fairseq", False)):
        log, int8[generator] = generate("5", "--model-overrides",
                                        f"{{'rfa_decode_precision': 'int8', 'rfa_static_beam_search': {static}}}")
        assert "linear layers: int8 on the" in log and ("static beam search generator" in log) == static
    hyps = {g: [line.split("\t")[2] for line in lines if line.startswith("H-")] for g, lines in int8.items()}
    assert hyps["static"] == hyps["fairseq"]


@pytest.mark.parametrize("cross", ["softmax", "rfa"])
def test_reorders_that_read_nothing_back_still_move_kv_kept_per_row(cross, monkeypatch):
    """On CUDA a reorder reads no rows back (DecodingState.NO_HOST_READS_ON; here the CPU stands in): K/V kept
    once per row (beam 1) must follow orders that move rows between sentences, K/V kept once per sentence
    stay through within-beam reorders and compact when a sentence leaves."""
    monkeypatch.setattr(DecodingState, "NO_HOST_READS_ON", ("cpu",))
    model, d = build_model(_flags("hedgehog", True, cross, "post"))
    model.eval()
    batch = random_batch(d, bsz=4, src_len=8, tgt_len=9, seed=3)
    orders = [torch.tensor(order) for order in ([2, 0, 3, 1], [3, 3, 0, 1], [2, 0])]
    assert_beam_reorder_equals_decoding_the_reordered_batch(model, batch, orders, tolerance=1e-5)
    src, src_lengths, prev = random_batch(d, bsz=3, src_len=8, tgt_len=8, seed=5)
    assert_beam_grouped_state_follows_reorders_and_shrinks(model, src, src_lengths, prev, tolerance=1e-5)


def test_the_rows_account_changes_only_through_its_methods():
    """BatchRows: its fields are read-only; fairseq's reorders compose the order and say which sentences the caches
    keep (None: every row reads the sentence it read), on the CPU from the values, on CUDA from its layout; the static
    search's steps turn its parity, its halving keeps the places' orders in the new buffer."""
    rows = BatchRows(3, 2)
    for field, value in (("parity", 1), ("first", False), ("sentences", 2), ("beam", 1), ("order", None)):
        with pytest.raises(AttributeError):
            setattr(rows, field, value)
    assert rows.sentence_of_rows("cpu").tolist() == [0, 0, 1, 1, 2, 2]
    assert rows.reorder(torch.tensor([1, 0, 2, 2, 5, 4]), read_back=True) is None  # within each sentence's beams
    assert rows.order.tolist() == [1, 0, 2, 2, 5, 4]
    kept = rows.reorder(torch.tensor([4, 5, 0, 1]), read_back=True)  # sentence 1 left, the others swapped
    assert kept.tolist() == [2, 0] and (rows.sentences, rows.beam) == (2, 2)
    assert rows.order.tolist() == [5, 4, 1, 0]  # composed: row i continues row order[i] of the state read next
    kept = rows.reorder(torch.tensor([0, 2, 1, 3]), read_back=True)  # a sentence's beams parted: K/V once per row
    assert kept.tolist() == [0, 1, 0, 1] and (rows.sentences, rows.beam) == (4, 1)
    on_device = BatchRows(3, 2)  # CUDA: no look at the values, the layout read for the rows kept
    assert on_device.reorder(torch.tensor([1, 0, 3, 2, 5, 4]), read_back=False) is None
    assert on_device.reorder(torch.tensor([5, 4, 0, 1]), read_back=False).tolist() == [2, 0]

    search_rows = BatchRows(3, 2)
    buffer = torch.zeros(6, dtype=torch.long)
    search_rows.use_order_buffer(buffer)
    search_rows.continue_rows(torch.tensor([[1, 0, 1], [3, 2, 2], [4, 5, 5]]), torch.tensor([[0, 2], [1, 0], [1, 1]]))
    assert buffer.tolist() == [1, 1, 2, 3, 5, 5] and search_rows.order is buffer
    search_rows.steps_ran(3)
    assert (search_rows.parity, search_rows.first) == (1, False)
    smaller = torch.zeros(4, dtype=torch.long)
    search_rows.keep_places(torch.tensor([2, 0]), smaller)
    assert smaller.tolist() == [5, 5, 1, 1] and search_rows.order is smaller and search_rows.sentences == 2


def test_a_reorder_that_keeps_the_rows_moves_kv_in_place():
    """The step's CUDA graphs read K/V at the addresses they captured: a reorder that keeps the number of rows
    moves K/V kept once per row where they are."""
    model, d = build_model(_flags("hedgehog", True, "softmax", "post"))
    model.eval()
    src, src_lengths, prev = random_batch(d, bsz=4, src_len=8, tgt_len=5, seed=3)
    with torch.no_grad():
        state = {}
        decode_incrementally(model, model.encoder(src, src_lengths=src_lengths), prev[:, :2], state)
        decoding = state[DecodingState.KEY]
        cross = [t for layer in decoding.layers for t in layer.cross.tensors()]
        before = [(t.data_ptr(), t.clone()) for t in cross]
        order = torch.tensor([2, 0, 3, 1])
        model.decoder.reorder_incremental_state_scripting(state, order)
    assert cross and decoding.beam == 1
    for t, (address, old) in zip(cross, before):
        assert t.data_ptr() == address
        torch.testing.assert_close(t, old[order], rtol=0, atol=0)


# ---------------------------------------------------------------- int8 linear layers (--rfa-decode-precision int8)


def _int8_kernels():
    cpp_extension()
    return step_kernels("auto", torch.device("cpu"), torch.float32, "int8")


@pytest.mark.parametrize("level", cpu_level_params())
@torch.no_grad()
def test_quantize_rows_equals_the_reference(level):
    """The C++ activation quantizer: the reference's per-row scales, codes off by at most one (it multiplies by
    1/scale where the reference divides) and in 1 .. 127, reconstructing each row to half a step."""
    from rfa_fairseq.ops import quantize_rows_reference

    ext = _int8_kernels().ext
    g = torch.Generator().manual_seed(0)
    for x in (torch.randn(37, 70, generator=g) * 3 + 1, torch.rand(5, 16, generator=g), -torch.rand(4, 9, generator=g),
              torch.zeros(3, 8)):
        codes, scales = torch.empty(x.shape, dtype=torch.uint8), torch.empty(x.size(0))
        ext.quantize_rows(x, codes, scales, level)
        want, want_scales = quantize_rows_reference(x, ext.int8_row_zero_point)
        torch.testing.assert_close(scales, want_scales, rtol=1e-6, atol=0)
        assert 1 <= int(codes.min()) and int(codes.max()) <= 127
        assert (codes.int() - want.int()).abs().max() <= 1 and (codes != want).float().mean() < 0.01
        assert ((codes.float() - 64) * scales[:, None] - x).abs().max() <= 0.5 * scales.max() * 1.0001


@torch.no_grad()
def test_int8_linear_layers_are_fp32_s_within_their_quantization_error():
    """The int8 product with bias, relu and residual: fp32's linear within 2 % of the output's range
    (per-row 7-bit activations, per-channel int8 weights)."""
    kernels = _int8_kernels()
    g = torch.Generator().manual_seed(1)
    x, weight, bias = torch.randn(24, 96, generator=g), torch.randn(200, 96, generator=g) / 10, torch.randn(200, generator=g)
    residual = torch.randn(24, 200, generator=g)
    packed = kernels.pack_linear(weight, bias)
    want = F.linear(x, weight, bias)
    for got, ref in ((kernels.linear(x, packed), want), (kernels.linear(x, packed, "relu"), want.relu()),
                     (kernels.linear(x, packed, residual=residual), want + residual)):
        error = ((got - ref).abs().max() / want.abs().max()).item()
        print(f"max |int8 - fp32| / max |fp32|: {error:.4f}")
        assert error < 0.02


@torch.no_grad()
def test_int8_decoding_step_logits_stay_within_a_tolerance_of_fp32():
    """The default model decoding with --rfa-decode-precision int8 (every linear layer of the step and of the
    encoder's inference in int8): its log-probabilities within 0.1 of fp32's (max over 3 sentences x 6 steps of
    a tiny model, where they span ~8), and the same best token at most positions."""
    _int8_kernels()
    model, d = build_model(_flags("hedgehog", True, "softmax", "post"))
    model.eval()
    src, src_lengths, prev = random_batch(d, bsz=3, src_len=9, tgt_len=6, seed=2)
    outputs = {}
    for precision in ("fp32", "int8"):
        model.decoder.rfa.rfa_decode_precision = precision  # one RFAConfig: the encoder reads it too
        encoder_out = model.encoder(src, src_lengths=src_lengths)
        state = {}
        logits = decode_incrementally(model, encoder_out, prev, state)
        assert state[DecodingState.KEY].kernels.gemm.startswith("int8") == (precision == "int8")
        assert model.encoder.encoding_runtime().kernels.gemm == state[DecodingState.KEY].kernels.gemm
        outputs[precision] = torch.log_softmax(logits, dim=-1)
    error = (outputs["int8"] - outputs["fp32"]).abs().max().item()
    agree = (outputs["int8"].argmax(-1) == outputs["fp32"].argmax(-1)).float().mean().item()
    print(f"max |log p int8 - fp32| {error:.4f}, same argmax {agree:.2%}")
    assert error < 0.1 and agree >= 0.8


def test_int8_where_it_cannot_run_is_an_error_naming_why():
    with pytest.raises(ValueError, match="runs on the CPU in fp32 weights, not on cpu in torch.bfloat16"):
        step_kernels("auto", torch.device("cpu"), torch.bfloat16, "int8")
    with pytest.raises(ValueError, match="needs the C\\+\\+ kernels"):
        step_kernels("torch", torch.device("cpu"), torch.float32, "int8")


# ---------------------------------------------------------------- the users' sizes: transformer base and big widths

# one encoder and one decoder layer at each size's width, heads and FFN (the default model: hedgehog, D = 32, gated,
# softmax cross-attention): every product, head and state shape of a base or big step, at a test's cost
USER_SIZE_LAYERS = {
    "base": tiny_model_flags(embed_dim=512, ffn_dim=2048, heads=8, encoder_layers=1, decoder_layers=1),
    "big": tiny_model_flags(embed_dim=1024, ffn_dim=4096, heads=16, encoder_layers=1, decoder_layers=1),
}


@pytest.mark.parametrize("size", sorted(USER_SIZE_LAYERS))
@torch.no_grad()
def test_the_native_step_at_base_and_big_widths_equals_the_torch_step_and_int8_stays_close(size):
    """d = 512 / 1,024, FFN 2,048 / 4,096, 8 / 16 heads of 64: the native fp32 step (the fused projection of 2 x H x 32
    + C + H columns, the few-rows and many-rows products, the 16-head causal states, the cross-attention) equals the
    torch step and the full forward; int8 stays within its quantization error of fp32."""
    cpp_extension()
    flags = [*FP32_STATE, *USER_SIZE_LAYERS[size]]
    model, torch_kernels, d = _twins(flags)
    src, src_lengths, prev = random_batch(d, bsz=3, src_len=9, tgt_len=6)
    full, _ = model(src, src_lengths, prev)
    outs = {}
    for name, m in (("native", model), ("torch", torch_kernels)):
        outs[name] = decode_incrementally(m, m.encoder(src, src_lengths=src_lengths), prev, {})
    state = {}
    decoded = decode_incrementally(model, model.encoder(src, src_lengths=src_lengths), prev, state)
    assert state[DecodingState.KEY].kernels.name == "cpp"
    torch.testing.assert_close(outs["native"], outs["torch"], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(outs["native"], full, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(decoded, outs["native"], rtol=0, atol=0)
    model.decoder.rfa.rfa_decode_precision = "int8"  # one RFAConfig: the encoder reads it too
    int8 = torch.log_softmax(decode_incrementally(model, model.encoder(src, src_lengths=src_lengths), prev, {}), -1)
    fp32 = torch.log_softmax(outs["native"], -1)
    # per-row 7-bit activations and per-channel int8 weights through a layer of each kind: within 2 % of the
    # log-probabilities' span, the same best token at most positions
    error = ((int8 - fp32).abs().max() / (fp32.max() - fp32.min())).item()
    agree = (int8.argmax(-1) == fp32.argmax(-1)).float().mean().item()
    print(f"{size}: max |int8 - fp32| log-probability {error:.2%} of their span, same argmax {agree:.0%}")
    assert error < 0.02 and agree >= 0.8
