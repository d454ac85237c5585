"""rfa_transformer in fairseq: incremental decoding, beam reorder, state size, random matrices."""
import io

import pytest
import torch
from fairseq.modules.transformer_layer import TransformerEncoderLayerBase
from helpers import (FP32_STATE, PAPER_RFA, build_model, build_model_from_args, cpp_extension, decode_incrementally,
                     parse_args, random_batch, use_decoding_step)

from rfa_fairseq.conversion import RFA_PARAMETER_SUFFIXES
from rfa_fairseq.config import RFAConfig
from rfa_fairseq.modules import RFAAttention
from rfa_fairseq.modules.decoding import DecodingState
from rfa_fairseq.modules.rfa_attention import RFACrossRecord
from rfa_fairseq.modules.softmax_cross_attention import SoftmaxCrossRecord
from rfa_fairseq.ops import num_feature_dims

VARIANTS = [
    pytest.param(fm, gate, enc, "rfa", id=f"{fm}-{'gated' if gate else 'ungated'}-{'rfa_enc' if enc else 'softmax_enc'}")
    for fm in ("sincos", "arccos", "positive", "hedgehog", "relu", "elu")
    for gate in (False, True)
    for enc in (False, True)
] + [  # the default's softmax cross-attention beside RFA decoder self-attention
    pytest.param(fm, gate, False, "softmax", id=f"{fm}-{'gated' if gate else 'ungated'}-softmax_cross")
    for fm, gate in (("hedgehog", True), ("sincos", False))
]


def _flags(feature_map, gate, rfa_encoder, cross="rfa", chunk=4):
    flags = ["--rfa-feature-map", feature_map, "--rfa-chunk-size", str(chunk), "--rfa-gate" if gate else "--no-rfa-gate"]
    flags.append("--rfa-softmax-cross-attn" if cross == "softmax" else "--no-rfa-softmax-cross-attn")
    return flags + (["--rfa-encoder-self-attn"] if rfa_encoder else [])


def assert_beam_reorder_equals_decoding_the_reordered_batch(model, batch, orders, tolerance):
    """Decode 4 steps, reorder (permute / duplicate / shrink the batch), decode on: the same logits as
    decoding the reordered batch from scratch. batch: (src, src_lengths, prev) on the model's device."""
    src, src_lengths, prev = batch
    k = 4
    for new_order in orders:
        with torch.no_grad():
            encoder_out = model.encoder(src, src_lengths=src_lengths)
            state = {}
            decode_incrementally(model, encoder_out, prev[:, :k], state)
            model.decoder.reorder_incremental_state_scripting(state, new_order)
            encoder_out = model.encoder.reorder_encoder_out(encoder_out, new_order)
            continued = decode_incrementally(model, encoder_out, prev[new_order], state, start=k)

            fresh_out = model.encoder(src[new_order], src_lengths=src_lengths[new_order])
            scratch = decode_incrementally(model, fresh_out, prev[new_order], {})[:, k:]
        assert continued.shape == scratch.shape
        torch.testing.assert_close(continued, scratch, rtol=tolerance, atol=tolerance)


def _state_tensors(incremental_state):
    """Every tensor of the incremental state: fairseq's attention buffers, or the DecodingState's attention state."""
    return [t for entry in incremental_state.values()
            for t in (entry.attention_tensors() if isinstance(entry, DecodingState)
                      else [value for value in entry.values() if value is not None])]



@pytest.mark.parametrize("cross", [[], ["--no-rfa-softmax-cross-attn"]], ids=["default", "rfa_cross"])
def test_a_decoder_without_cross_attention_decodes_incrementally_as_a_whole(cross):
    """--no-cross-attention: --rfa-softmax-cross-attn (on by default) has nothing to choose, and is no error."""
    model, d = build_model(["--no-cross-attention", *cross, *FP32_STATE])
    model.eval()
    assert all(layer.encoder_attn is None for layer in model.decoder.layers)
    src, src_lengths, prev = random_batch(d, bsz=3, src_len=9, tgt_len=11)
    with torch.no_grad():
        full, _ = model(src, src_lengths, prev)
        incremental = decode_incrementally(model, model.encoder(src, src_lengths=src_lengths), prev, {})
    torch.testing.assert_close(incremental, full, rtol=1e-5, atol=1e-5)


def test_modules_are_where_the_options_say():
    model, _ = build_model()
    enc_layer, dec_layer = model.encoder.layers[0], model.decoder.layers[0]
    assert type(enc_layer) is TransformerEncoderLayerBase  # softmax encoder by default: fairseq's own layer
    assert not isinstance(enc_layer.self_attn, RFAAttention)
    assert isinstance(dec_layer.self_attn, RFAAttention) and dec_layer.self_attn.causal
    assert dec_layer.self_attn.gated and dec_layer.self_attn.feature_map == "hedgehog"  # the default
    assert not isinstance(dec_layer.encoder_attn, RFAAttention)  # softmax cross-attention by default
    model, _ = build_model(["--rfa-encoder-self-attn", "--no-rfa-softmax-cross-attn", "--no-rfa-gate"])
    assert isinstance(model.encoder.layers[0].self_attn, RFAAttention)
    assert not model.decoder.layers[0].self_attn.gated
    cross = model.decoder.layers[0].encoder_attn
    assert isinstance(cross, RFAAttention) and cross.encoder_decoder_attention
    indices = [m.module_index for m in model.rfa_modules()]
    assert indices == list(range(len(indices)))


@pytest.mark.parametrize("feature_map,gate,rfa_encoder,cross", VARIANTS)
def test_incremental_decoding_equals_full_forward(feature_map, gate, rfa_encoder, cross):
    model, d = build_model(_flags(feature_map, gate, rfa_encoder, cross) + FP32_STATE)
    model.eval()
    src, src_lengths, prev = random_batch(d, bsz=3, src_len=9, tgt_len=11)
    with torch.no_grad():
        full, _ = model(src, src_lengths, prev)
        encoder_out = model.encoder(src, src_lengths=src_lengths)
        incremental = decode_incrementally(model, encoder_out, prev, {})
    diff = (full - incremental).abs().max().item()
    print(f"max |full - incremental| = {diff:.2e}")
    assert diff <= 1e-5


@pytest.mark.parametrize("feature_map,gate", [("hedgehog", True), ("sincos", False)])
def test_the_native_steps_fp16_state_decodes_within_fp16_rounding_of_the_full_forward(feature_map, gate):
    """--rfa-decode-state auto (the default) keeps the native step's causal state in fp16, each step's arithmetic in
    fp32: incremental decoding stays within a few fp16 roundings (2^-11 relative) of the full forward, where the fp32
    state stays within fp32's; and the rounding happens (the fp16 state is what the step reads)."""
    cpp_extension()
    errors = {}
    for state_flags in ([], FP32_STATE):
        model, d = build_model(_flags(feature_map, gate, False) + state_flags)
        model.eval()
        src, src_lengths, prev = random_batch(d, bsz=3, src_len=9, tgt_len=11)
        with torch.no_grad():
            full, _ = model(src, src_lengths, prev)
            state = {}
            incremental = decode_incrementally(model, model.encoder(src, src_lengths=src_lengths), prev, state)
        dtypes = {t.dtype for layer in state[DecodingState.KEY].layers for t in layer.self_attn.states}
        errors["fp32" if state_flags else "fp16"] = (incremental - full).abs().max().item() / full.abs().max().item()
        assert dtypes == {torch.float32 if state_flags else torch.float16}
    print(f"max |full - incremental| / max |full|: {errors}")
    assert errors["fp32"] <= 1e-6 and 1e-5 < errors["fp16"] <= 8 * 2 ** -11, errors


def test_an_fp16_state_where_the_native_step_does_not_run_is_an_error_naming_the_flag():
    model, d = build_model(["--rfa-decode-kernel", "torch"])  # auto: the torch step keeps its state in fp32
    model.eval()
    src, src_lengths, prev = random_batch(d, bsz=2, tgt_len=3)
    with torch.no_grad():
        state = {}
        decode_incrementally(model, model.encoder(src, src_lengths=src_lengths), prev, state)
    assert {t.dtype for layer in state[DecodingState.KEY].layers for t in layer.self_attn.states} == {torch.float32}
    model, d = build_model(["--rfa-decode-kernel", "torch", "--rfa-decode-state", "fp16"])
    model.eval()
    with torch.no_grad(), pytest.raises(ValueError, match="--rfa-decode-state fp16 keeps the state in fp16 in the "
                                                           "native step, which does not run here \\(torch step"):
        decode_incrementally(model, model.encoder(src, src_lengths=src_lengths), prev, {})
    with pytest.raises(SystemExit):
        parse_args(["--rfa-decode-state", "bf16"])


@pytest.mark.parametrize("step", ["fused", "torch"])
@pytest.mark.parametrize("gate", [False, True], ids=["ungated", "gated"])
def test_beam_reorder_equals_decoding_the_reordered_batch(gate, step, monkeypatch):
    use_decoding_step(step, monkeypatch)
    model, d = build_model(_flags("sincos", gate, False))
    model.eval()
    batch = random_batch(d, bsz=4, src_len=8, tgt_len=9, seed=3)
    orders = [torch.tensor(order) for order in ([2, 0, 3, 1], [3, 3, 0, 1], [2, 0])]
    assert_beam_reorder_equals_decoding_the_reordered_batch(model, batch, orders, tolerance=1e-5)


@pytest.mark.parametrize("feature_map,gate", [("sincos", False), ("positive", True), ("hedgehog", True)])
def test_incremental_state_size_does_not_grow(feature_map, gate):
    model, d = build_model(_flags(feature_map, gate, False))
    model.eval()
    src, src_lengths, _ = random_batch(d, bsz=2, src_len=6, tgt_len=1)
    prev = torch.randint(d.nspecial, len(d), (2, 501))
    state, sizes = {}, {}
    with torch.no_grad():
        encoder_out = model.encoder(src, src_lengths=src_lengths)
        for t in range(500):
            logits, _ = model.decoder(prev[:, : t + 1], encoder_out=encoder_out, incremental_state=state)
            if t + 1 in (10, 500):
                sizes[t + 1] = sum(x.numel() for x in _state_tensors(state))
    assert torch.isfinite(logits).all()
    assert sizes[10] == sizes[500] > 0
    # per RFA layer: S and z only, (bsz, heads, F, head_dim + 1)
    attn = model.decoder.layers[0].self_attn
    F_ = num_feature_dims(feature_map, attn.num_features, attn.head_dim)
    causal = state[DecodingState.KEY].layers[0].self_attn.states[0]
    assert causal.shape == (2, attn.num_heads, F_, attn.head_dim + 1)


@pytest.mark.parametrize("step", ["fused", "torch"])
@pytest.mark.parametrize("cross", ["rfa", "softmax"])
def test_cross_attention_state_is_computed_once_per_source(cross, step, monkeypatch):
    """The cross-attention's record makes its per-sentence tensors once, at the batch's start; every step reads the
    same tensors (native or torch step)."""
    use_decoding_step(step, monkeypatch)
    model, d = build_model(["--no-rfa-softmax-cross-attn" if cross == "rfa" else "--rfa-softmax-cross-attn"])
    model.eval()
    src, src_lengths, prev = random_batch(d, bsz=2, tgt_len=5)
    record_class = RFACrossRecord if cross == "rfa" else SoftmaxCrossRecord
    started, start = [], record_class.start
    monkeypatch.setattr(record_class, "start", lambda self, *a, **k: started.append(1) or start(self, *a, **k))
    read, state = [], {}
    with torch.no_grad():
        encoder_out = model.encoder(src, src_lengths=src_lengths)
        for t in range(prev.size(1)):
            model.decoder(prev[:, : t + 1], encoder_out=encoder_out, incremental_state=state)
            read.append([(x.data_ptr(), x.sum().item()) for x in state[DecodingState.KEY].layers[0].cross.tensors()])
    assert len(started) == len(model.decoder.layers) and len(read) == prev.size(1)
    assert read[0] and all(r == read[0] for r in read)


def test_random_matrices_per_update_are_shared_across_copies_and_fixed_in_eval():
    a, _ = build_model(PAPER_RFA, seed=7)
    b, _ = build_model(PAPER_RFA, seed=7)
    torch.nn.init.normal_(b.decoder.layers[0].self_attn.q_proj.weight)  # other weights don't matter
    for m in (a, b):
        m.train()
        m.set_num_updates(5)
    draws_a = [m.random_matrix().clone() for m in a.rfa_modules()]
    draws_b = [m.random_matrix().clone() for m in b.rfa_modules()]
    assert all(torch.equal(x, y) for x, y in zip(draws_a, draws_b))
    # different layers draw different matrices
    assert not torch.equal(draws_a[0], draws_a[1])
    a.set_num_updates(6)
    assert all(not torch.equal(x, m.random_matrix()) for x, m in zip(draws_a, a.rfa_modules()))
    # another seed, other draws
    c, _ = build_model(PAPER_RFA, seed=8)
    c.train()
    c.set_num_updates(5)
    assert not torch.equal(draws_a[0], c.rfa_modules()[0].random_matrix())
    # eval: the saved matrices, whatever the update
    a.eval()
    fixed = [m.random_matrix().clone() for m in a.rfa_modules()]
    a.set_num_updates(1000)
    assert all(torch.equal(x, m.random_matrix()) for x, m in zip(fixed, a.rfa_modules()))
    assert all(torch.equal(x, m.eval_random_matrix) for x, m in zip(fixed, a.rfa_modules()))


def test_hydra_model_config_draws_with_the_seed_torch_was_seeded_with():
    """fairseq-hydra-train builds the model from the config's model section, which has no seed (common.seed
    seeds torch just before): its draws follow that seed, as fairseq-train's follow --seed."""
    from omegaconf import OmegaConf

    def eval_draws(model):
        return [m.eval_random_matrix.clone() for m in model.rfa_modules()]

    cli = eval_draws(build_model(PAPER_RFA, seed=7)[0])
    for seed, same in ((7, True), (8, False)):
        args = vars(parse_args(PAPER_RFA, "rfa_transformer", seed))
        hydra_model_section = OmegaConf.create({k: v for k, v in args.items() if k != "seed"})
        model, _ = build_model_from_args(hydra_model_section, seed=seed)
        assert all(torch.equal(x, y) for x, y in zip(cli, eval_draws(model))) == same


def test_checkpointed_model_generates_identical_hypotheses():
    from fairseq.sequence_generator import SequenceGenerator

    model, d = build_model(PAPER_RFA + ["--rfa-gate"], seed=3)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict()}, buf)
    buf.seek(0)
    reloaded, _ = build_model(PAPER_RFA + ["--rfa-gate"], seed=99, dictionary=d)  # other seed: other eval matrices
    reloaded.load_state_dict(torch.load(buf)["model"])  # weights_only load
    src, src_lengths, _ = random_batch(d, bsz=3, src_len=7)
    sample = {"net_input": {"src_tokens": src, "src_lengths": src_lengths}}
    hyps = []
    for m in (model, reloaded):
        m.eval()
        gen = SequenceGenerator([m], d, beam_size=4, max_len_b=12)
        with torch.no_grad():
            hyps.append([[h["tokens"].tolist() for h in sent] for sent in gen.generate([m], sample)])
    assert hyps[0] == hyps[1]


def test_bf16_model_keeps_fp32_states_and_finite_outputs():
    model, d = build_model(["--rfa-gate", "--rfa-encoder-self-attn", "--no-rfa-softmax-cross-attn"])
    model.eval().to(torch.bfloat16)
    src, src_lengths, prev = random_batch(d, bsz=2, tgt_len=6)
    state = {}
    with torch.no_grad():
        full, _ = model(src, src_lengths, prev)
        decode_incrementally(model, model.encoder(src, src_lengths=src_lengths), prev, state)
    assert full.dtype == torch.bfloat16 and torch.isfinite(full.float()).all()
    assert all(t.dtype == torch.float32 for t in state[DecodingState.KEY].attention_tensors())


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--rfa-num-features", "0"], "argument --rfa-num-features: must be a positive integer, got 0"),
        (["--rfa-chunk-size", "-2"], "argument --rfa-chunk-size: must be a positive integer, got -2"),
        (["--rfa-temperature", "0"], "argument --rfa-temperature: must be a positive number, got 0"),
        (["--rfa-num-features", "many"], "argument --rfa-num-features: expected a positive int, got 'many'"),
        (["--rfa-feature-map", "gaussian"], "argument --rfa-feature-map: invalid choice: 'gaussian'"),
    ],
)
def test_bad_flags_are_argparse_errors_naming_the_flag(flags, message, capsys):
    with pytest.raises(SystemExit):
        parse_args(flags)
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "override,message",
    [
        ({"rfa_num_features": 0}, "--rfa-num-features must be a positive integer"),
        ({"rfa_chunk_size": 0}, "--rfa-chunk-size must be a positive integer"),
        ({"rfa_temperature": -1.0}, "--rfa-temperature must be > 0"),
        ({"rfa_feature_map": "gaussian"}, "--rfa-feature-map='gaussian' is not one of"),
        ({"cross_self_attention": True}, "--cross-self-attention contradicts RFA"),
    ],
)
def test_bad_options_from_configs_are_rejected_before_building(override, message):
    """Hydra configs and checkpoints bypass argparse: build_model validates again."""
    args = parse_args()
    for name, value in override.items():
        setattr(args, name, value)
    with pytest.raises(ValueError, match=message):
        build_model_from_args(args)


def test_plain_transformer_weights_load_into_rfa_model():
    """Projection names match fairseq's MultiheadAttention: softmax weights drop in."""
    softmax, d = build_model(arch="transformer")
    rfa, _ = build_model(dictionary=d)
    missing, unexpected = rfa.load_state_dict(softmax.state_dict(), strict=False)
    assert not unexpected
    assert missing and all(k.endswith(RFA_PARAMETER_SUFFIXES) for k in missing), missing


@pytest.mark.parametrize("step", ["fused", "torch"])
@pytest.mark.parametrize("gate", [False, True], ids=["ungated", "gated"])
def test_beam_search_scores_equal_full_forward_rescoring(gate, step, monkeypatch):
    """Real fairseq beam search (incremental states, beam reorders folded into the next
    step, finishing sentences): every hypothesis' per-token scores equal a teacher-forced
    full forward pass, with the fused C++ decoding step and with the torch fallback."""
    from fairseq.sequence_generator import SequenceGenerator

    use_decoding_step(step, monkeypatch)

    model, d = build_model(_flags("sincos", gate, False), seed=4)
    model.eval()
    src, src_lengths, _ = random_batch(d, bsz=5, src_len=7, seed=9)
    sample = {"net_input": {"src_tokens": src, "src_lengths": src_lengths}}
    gen = SequenceGenerator([model], d, beam_size=4, max_len_b=10, normalize_scores=False)
    with torch.no_grad():
        hyps = gen.generate([model], sample)
        lengths = set()
        for i, sent in enumerate(hyps):
            for hyp in sent:
                tokens = hyp["tokens"]
                lengths.add(len(tokens))
                prev = torch.cat([tokens.new_tensor([d.eos()]), tokens[:-1]]).unsqueeze(0)
                logits, _ = model(src[i : i + 1], src_lengths[i : i + 1], prev)
                lprobs = torch.log_softmax(logits.float(), dim=-1)[0].gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
                torch.testing.assert_close(hyp["positional_scores"], lprobs, rtol=1e-4, atol=1e-4)
    print(f"hypothesis lengths: {sorted(lengths)}")


def test_log_sigma_starts_at_the_temperature_and_learns_faster():
    """--rfa-sigma log: sigma = exp(m * theta) starts at tau^-1/2; one Adam-like step of size lr on
    theta moves log sigma by m * lr, m times what the same step moves a raw sigma parameter."""
    model, d = build_model(PAPER_RFA + ["--rfa-sigma", "log", "--rfa-temperature", "0.25", "--rfa-sigma-lr-multiplier", "10"])
    attn = model.decoder.layers[0].self_attn
    assert not hasattr(attn.phi, "sigma") and attn.phi.log_sigma.requires_grad
    torch.testing.assert_close(attn.current_sigma(), torch.full_like(attn.current_sigma(), 2.0))
    with torch.no_grad():
        attn.phi.log_sigma.add_(1e-3)
    torch.testing.assert_close(attn.current_sigma(), torch.full_like(attn.current_sigma(), 2.0 * float(torch.exp(torch.tensor(1e-2)))))
    # gradients reach log_sigma through the features
    model.train()
    src, src_lengths, prev = random_batch(d)
    model(src, src_lengths, prev)[0].sum().backward()
    assert attn.phi.log_sigma.grad is not None and attn.phi.log_sigma.grad.abs().sum() > 0


def test_fixed_random_matrix_trains_with_the_evaluation_matrix():
    model, _ = build_model(PAPER_RFA + ["--rfa-fixed-random-matrix"])
    attn = model.decoder.layers[0].self_attn
    model.train()
    for update in (0, 5):
        attn.set_num_updates(update)
        assert attn.random_matrix() is attn.eval_random_matrix
    redrawn, _ = build_model(PAPER_RFA)
    attn = redrawn.decoder.layers[0].self_attn
    redrawn.train()
    attn.set_num_updates(5)
    assert not torch.equal(attn.random_matrix(), attn.eval_random_matrix)


@pytest.mark.parametrize("feature_map", ["hedgehog", "relu"])
def test_learned_maps_have_trainable_weights_and_no_random_matrix(feature_map):
    model, d = build_model(["--rfa-feature-map", feature_map, "--rfa-num-features", "8"])
    attn = model.decoder.layers[0].self_attn
    assert attn.random_matrix() is None and attn.phi.weight.shape == (attn.num_heads, 8, attn.head_dim)
    assert not hasattr(attn.phi, "sigma") and not hasattr(attn.phi, "log_sigma")  # no unused parameter
    model.train()
    src, src_lengths, prev = random_batch(d)
    model(src, src_lengths, prev)[0].sum().backward()
    assert attn.phi.weight.grad.abs().sum() > 0 and attn.phi.bias.grad.abs().sum() > 0


def test_learned_map_refuses_a_temperature():
    args = parse_args(["--rfa-feature-map", "hedgehog", "--rfa-temperature", "0.5"])
    with pytest.raises(ValueError, match="--rfa-temperature=0.5 has no effect with --rfa-feature-map=hedgehog"):
        build_model_from_args(args)


def test_attention_module_builds_without_a_cfg_with_the_flags_defaults():
    """RFAAttention takes the model's RFAConfig whole; without one, RFAConfig's defaults (declared there only)."""
    import inspect

    assert not any(name.startswith(("feature", "num_features", "gate", "sigma", "chunk"))
                   for name in inspect.signature(RFAAttention).parameters)
    module = RFAAttention(16, 2, self_attention=True, causal=True)
    out, _ = module(torch.randn(5, 3, 16), None, None)  # causal by construction: no mask
    assert out.shape == (5, 3, 16) and module.gated and module.feature_map == "hedgehog"
    assert module.num_features == RFAConfig().rfa_num_features


def test_decode_kernel_option_picks_the_kernels_once_per_batch_and_every_kernel_decodes_alike(monkeypatch):
    from rfa_fairseq import kernel_choice

    outputs = {}
    cpp_extension()  # the cpp case needs the C++ module (skipped, with the reason, where it cannot be built)
    for kernel in ("auto", "torch", "cpp"):
        model, d = build_model(_flags("sincos", True, False) + ["--rfa-decode-kernel", kernel] + FP32_STATE)
        assert model.decoder.rfa.rfa_decode_kernel == kernel
        model.eval()
        src, src_lengths, prev = random_batch(d, bsz=3, src_len=8, tgt_len=6, seed=5)
        builds, state = [], {}
        with torch.no_grad():
            encoder_out = model.encoder(src, src_lengths=src_lengths)  # its layers pick their kernels once
        with monkeypatch.context() as patch:
            loader = kernel_choice.load_fused_extension
            patch.setattr(kernel_choice, "load_fused_extension", lambda: builds.append(1) or loader())
            with torch.no_grad():
                outputs[kernel] = decode_incrementally(model, encoder_out, prev, state)
        assert len(builds) == (kernel == "auto"), "the kernels are chosen once per batch; torch never loads C++"
        assert state[DecodingState.KEY].kernels.name == ("torch" if kernel == "torch" else "cpp")
    for kernel, out in outputs.items():
        torch.testing.assert_close(out, outputs["torch"], rtol=1e-5, atol=1e-5)
    with pytest.raises(SystemExit):
        parse_args(["--rfa-decode-kernel", "cuda"])
    model, d = build_model(["--rfa-decode-kernel", "cpp"])
    model.eval().to(torch.bfloat16)
    src, src_lengths, prev = random_batch(d, bsz=2, tgt_len=2)
    with torch.no_grad():
        encoder_out = model.encoder(src, src_lengths=src_lengths)
    with torch.no_grad(), pytest.raises(ValueError, match="--rfa-decode-kernel cpp: the C\\+\\+ decoding step runs on the CPU in fp32"):
        decode_incrementally(model, encoder_out, prev, {})


def test_a_run_set_to_decode_in_cpp_validates_where_cpp_cannot_run():
    """fairseq-train validates in eval mode without autograd, which runs the encoder's inference path on the
    decoding step's kernels: a run configured with --rfa-decode-kernel cpp (to decode on the CPU) that trains in
    another dtype or on a GPU, where those kernels cannot run, validates through fairseq's forward instead of
    failing at its first validation (bf16 stands in for CUDA here): the training forward's outputs."""
    model, d = build_model(["--rfa-decode-kernel", "cpp"])
    model.eval().to(torch.bfloat16)
    src, src_lengths, prev = random_batch(d, bsz=2, tgt_len=4)
    with torch.no_grad():
        validated = model(src, src_lengths, prev)[0]
    with torch.enable_grad():
        trained = model(src, src_lengths, prev)[0].detach()
    torch.testing.assert_close(validated, trained, rtol=0, atol=0)


def test_sequence_kernel_option_reaches_every_causal_module_and_torch_never_asks_triton(monkeypatch):
    from rfa_fairseq import kernel_choice

    outputs = {}
    for kernel in ("auto", "torch"):
        model, d = build_model(_flags("sincos", True, False) + ["--rfa-sequence-kernel", kernel], seed=3)
        assert all(m.sequence_kernel == kernel for m in model.rfa_modules())
        model.eval()
        src, src_lengths, prev = random_batch(d, bsz=3, src_len=8, tgt_len=6, seed=5)
        asked = []
        with monkeypatch.context() as patch:
            # every tensor counts as a CUDA one for the dispatch: auto asks whether Triton can take it
            patch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
            patch.setattr(kernel_choice, "triton_usable", lambda *tensors: asked.append(1) or False)
            patch.setattr(kernel_choice, "triton_import_error", lambda: None)
            with torch.no_grad():
                outputs[kernel], _ = model(src, src_lengths, prev)
        assert bool(asked) == (kernel == "auto"), "only auto may pick the Triton kernels"
    torch.testing.assert_close(outputs["auto"], outputs["torch"], rtol=0, atol=0)
    with pytest.raises(SystemExit):
        parse_args(["--rfa-sequence-kernel", "cpp"])


@pytest.mark.parametrize("role", ["causal", "cross", "encoder_self"])
def test_attention_dropout_drops_values_and_keeps_the_expected_output(role):
    """--attention-dropout in RFA: per-key value dropout in the numerator, so the mean over masks is the
    output without dropout; nothing is dropped in eval."""
    torch.manual_seed(0)
    kwargs = dict(self_attention=role != "cross", encoder_decoder_attention=role == "cross", causal=role == "causal",
                  rfa=RFAConfig(rfa_num_features=8, rfa_feature_map="positive"))
    module = RFAAttention(16, 2, dropout=0.3, **kwargs)
    exact = RFAAttention(16, 2, dropout=0.0, **kwargs)
    exact.load_state_dict(module.state_dict())
    x = torch.randn(6, 2, 16)
    run = lambda m: m(x, x, x)[0]  # noqa: E731
    module.train(), exact.train()
    module.set_num_updates(0), exact.set_num_updates(0)  # training draws: the same matrices in both
    with torch.no_grad():
        want = run(exact)
        first, second = run(module), run(module)
        assert not torch.allclose(first, second) and not torch.allclose(first, want)
        mean = torch.stack([run(module) for _ in range(4000)]).mean(0)
    torch.testing.assert_close(mean, want, rtol=0, atol=0.03)
    module.eval(), exact.eval()
    with torch.no_grad():
        assert torch.equal(run(module), run(exact))


def test_attention_dropout_reaches_rfa_and_softmax_layers():
    model, _ = build_model(["--attention-dropout", "0.2"])  # softmax encoder and cross-attention, RFA decoder
    assert [m.dropout for m in model.rfa_modules()] == [0.2, 0.2]
    assert model.decoder.layers[0].encoder_attn.dropout_module.p == 0.2
    assert model.encoder.layers[0].self_attn.dropout_module.p == 0.2


@pytest.mark.parametrize("normalize_before", [False, True], ids=["post_norm", "pre_norm"])
def test_the_native_encoder_packs_changed_weights_again(normalize_before):
    """The encoder's native pass (eval, no autograd: the CPU kernels on packed weights) gives fairseq's own forward (taken with
    autograd on) on padded sources; after an in-place parameter update (an optimizer step between two validations) its
    runtime is built again, on the new weights."""
    cpp_extension()
    flags = ["--rfa-decode-kernel", "cpp"] + (["--encoder-normalize-before"] if normalize_before else [])
    model, d = build_model(flags)
    model.eval()
    src, src_lengths, _ = random_batch(d, bsz=4, src_len=9, tgt_len=2, seed=3)
    assert src.eq(d.pad()).any(), "the batch must have padding"

    def encode(inference):
        with torch.set_grad_enabled(not inference):
            return model.encoder(src, src_lengths=src_lengths)["encoder_out"][0].detach()

    before = encode(True)
    runtime = model.encoder.encoding_runtime()
    assert runtime is not None, "the native pass must run"
    torch.testing.assert_close(before, encode(False), rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        model.encoder.layers[0].fc2.weight.mul_(-1.0)
        model.encoder.layers[-1].self_attn.v_proj.bias.add_(0.5)
    after = encode(True)
    assert model.encoder.encoding_runtime() not in (None, runtime)
    assert not torch.allclose(after, before, atol=1e-3), "the update must change the encoder's output"
    torch.testing.assert_close(after, encode(False), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("batch_in_flight", [False, True], ids=["decoded", "decoding"])
def test_a_fairseq_training_step_between_two_validations_repacks_the_weights(batch_in_flight):
    """fairseq's Adam updates parameters through .data, which leaves their version counters alone: the packed
    weights of a validation (encoder pass and incremental decoding, eval and no autograd, as fairseq-train's
    validation and --eval-bleu run them) must not outlive the training step after it, also when the decoding
    batch that holds the decoder's workspace is still alive during the step."""
    from fairseq.optim.adam import Adam

    model, d = build_model(["--dropout", "0.0"])
    optimizer = Adam(model.parameters(), lr=0.05)
    src, src_lengths, prev = random_batch(d, bsz=3, src_len=7, tgt_len=5, seed=5)

    def validate(incremental_state):
        """What the packed inference gives, and the same computed with autograd on (fairseq's own forward)."""
        model.eval()
        with torch.no_grad():
            encoder_out = model.encoder(src, src_lengths=src_lengths)
            logits = decode_incrementally(model, encoder_out, prev, incremental_state)
        reference = model(src, src_lengths, prev)[0].detach()
        return logits, reference

    batch = {}
    before, _ = validate(batch)
    if not batch_in_flight:
        del batch
    model.train()
    model(src, src_lengths, prev)[0].logsumexp(-1).mean().backward()
    optimizer.step()
    if batch_in_flight:
        del batch  # its workspace goes back to the decoder only now
    after, reference = validate({})
    assert not torch.allclose(after, before, atol=1e-3), "the step must change what the model computes"
    torch.testing.assert_close(after, reference, rtol=1e-4, atol=1e-4)


def test_a_model_that_has_decoded_deep_copies_and_pickles_and_its_copy_decodes_alike():
    """The packed weights and kernels (a cache in the layers' workspaces: the native programs cannot be copied)
    do not travel with copies of the model (EMA, averaging scripts, whole-module torch.save)."""
    import copy
    import pickle

    model, d = build_model()
    model.eval()
    src, src_lengths, prev = random_batch(d, bsz=2, src_len=7, tgt_len=5, seed=4)
    with torch.no_grad():
        out = decode_incrementally(model, model.encoder(src, src_lengths=src_lengths), prev, {})
    for twin in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        with torch.no_grad():
            twin_out = decode_incrementally(twin, twin.encoder(src, src_lengths=src_lengths), prev, {})
        torch.testing.assert_close(twin_out, out, rtol=0, atol=0)
