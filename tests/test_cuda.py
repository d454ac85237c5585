"""The CUDA path: the Triton kernels (training's causal RFA, the decoding step's causal update) against the torch
references, the decoding step against the full forward, and fairseq-train / fairseq-generate on a GPU. Every test
is skipped, with the reason, where CUDA or Triton is missing.

Shapes: 8 heads of dim 64 (the base models), F = 64 features (the default's 2 x 32). The Triton kernels' products
on fp32 inputs run on TF32 tensor cores (~1e-3 relative per product), so tolerances are relative to each tensor's
range, and the measured errors are printed.
"""
import math
import os
import subprocess
import sys

import pytest
import torch
from cli_support import env, json_losses, run
from conftest import PLUGIN_DIR, REPO
from helpers import build_model, decode_incrementally, random_batch
from test_decoding_step import assert_beam_grouped_state_follows_reorders_and_shrinks
from test_model import assert_beam_reorder_equals_decoding_the_reordered_batch
from tiny_models import tiny_model_flags

from rfa_fairseq.gpu import triton_self_check
from rfa_fairseq.gpu.triton_support import triton_import_error
from rfa_fairseq.kernel_choice import causal_rfa, step_kernels
from rfa_fairseq.ops import causal_rfa_chunked, causal_rfa_recurrent, causal_rfa_reference, gate_keys
from graph_counting import CountingBackend
from rfa_fairseq.ops.step import TORCH_KERNELS
from rfa_fairseq.gpu.triton_self_check import SEQUENCE_TOLERANCES, STEP_TOLERANCES, relative_error


def _skip_reason():
    if not torch.cuda.is_available():
        return "no CUDA device"
    error = triton_import_error()
    return f"Triton does not import ({error})" if error else None


SKIP_REASON = _skip_reason()
pytestmark = pytest.mark.skipif(SKIP_REASON is not None, reason=f"CUDA path not tested: {SKIP_REASON}")

H, F_, D = 8, 64, 64  # heads, features (2 x 32, as the default's), head dim
GPU_MODEL = [  # override helpers.TINY_ARGS: the base models' head shape, 2 layers
    "--encoder-embed-dim", str(H * D), "--decoder-embed-dim", str(H * D),
    "--encoder-attention-heads", str(H), "--decoder-attention-heads", str(H),
]
TOLERANCE = SEQUENCE_TOLERANCES[torch.float32]  # of each tensor's range (relative_error): the chunked kernels' TF32


def flags(feature_map="sincos", gate=True, rfa_encoder=False, rfa_cross=True):
    """Every RFA option these tests depend on, explicit (defaults move); F = 64 for every map:
    2 x 32 for sincos and hedgehog, --rfa-num-features 64 for the others (elu, whose F is the head
    dimension, is left to the CPU tests)."""
    out = ["--rfa-feature-map", feature_map, "--rfa-chunk-size", "4", "--rfa-gate" if gate else "--no-rfa-gate",
           "--no-rfa-softmax-cross-attn" if rfa_cross else "--rfa-softmax-cross-attn"]
    out += ["--rfa-num-features", str(F_ // 2 if feature_map in ("sincos", "hedgehog") else F_)]
    return out + (["--rfa-encoder-self-attn"] if rfa_encoder else [])


def features(*shape, dtype=torch.float32):
    """Positive features with healthy denominators (each phi(q).phi(k) around 1/4)."""
    return (torch.rand(*shape, device="cuda") * F_ ** -0.5).to(dtype)


# ------------------------------------------------------------------ ops


CASES = [(gated, dtype, state, 200) for gated in (False, True) for dtype in ("fp32", "bf16") for state in (False, True)]
CASES += [(True, "fp32", True, length) for length in (1, 64, 65)]


@pytest.mark.parametrize("gated,dtype,with_state,length", CASES)
def test_triton_kernels_match_reference_outputs_states_gradients(gated, dtype, with_state, length):
    """causal_rfa_triton (forward and backward, compiled) == the O(T^2) reference in fp64: outputs, final state and
    gradients w.r.t. phi_q, phi_k, v, gate logits and the initial state; right padding folded in by gate_keys;
    lengths that are not a multiple of the kernels' 32-position chunks."""
    from rfa_fairseq.gpu.triton_chunk import causal_rfa_triton

    torch.manual_seed(0)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    B, T = 2, length
    phi_q = features(B, H, T, F_, dtype=dtype).requires_grad_()
    phi_k = features(B, H, T, F_, dtype=dtype).requires_grad_()
    v = torch.randn(B, H, T, D, device="cuda", dtype=dtype, requires_grad=True)
    logits = (2 * torch.randn(B, H, T, device="cuda", dtype=dtype)).requires_grad_() if gated else None
    state = torch.rand(B, H, F_, D + 1, device="cuda", requires_grad=True) if with_state else None
    pad = torch.zeros(B, T, dtype=torch.bool, device="cuda")
    pad[1, T - T // 5:] = True  # fairseq pads targets on the right
    w_out = torch.randn(B, H, T, D, device="cuda")
    leaves = [x for x in (phi_q, phi_k, v, logits, state) if x is not None]
    results = []
    for fn, cast in ((causal_rfa_triton, lambda x: x), (causal_rfa_reference, lambda x: x.double())):
        k, log_gate = gate_keys(cast(phi_k), cast(logits) if gated else None, pad)
        out, final = fn(cast(phi_q), k, cast(v), log_gate, cast(state) if with_state else None)
        results.append([out, final.detach(), *torch.autograd.grad((out * cast(w_out)).sum(), leaves)])
    got, want = results
    assert got[0].dtype == got[1].dtype == torch.float32  # outputs and states in fp32
    assert [g.dtype for g in got[2:]] == [x.dtype for x in leaves]
    names = ["out", "state", "d_phi_q", "d_phi_k", "d_v"] + (["d_gate"] if gated else []) + (["d_state"] if with_state else [])
    errors = {name: relative_error(a, b) for name, a, b in zip(names, got, want)}
    print(" ".join(f"{name} {error:.1e}" for name, error in errors.items()))
    assert all(math.isfinite(e) and e < SEQUENCE_TOLERANCES[dtype] for e in errors.values()), errors


def test_dispatch_takes_triton_for_cuda_and_torch_when_disabled_or_fp64():
    from rfa_fairseq.gpu.triton_chunk import causal_rfa_triton

    torch.manual_seed(1)
    q, k, v = features(2, H, 100, F_), features(2, H, 100, F_), torch.randn(2, H, 100, D, device="cuda")
    log_gate = -torch.rand(2, H, 100, device="cuda")
    assert torch.equal(causal_rfa(q, k, v, log_gate, chunk_size=64, sequence_kernel="auto")[0],
                       causal_rfa_triton(q, k, v, log_gate)[0])
    torch_path = causal_rfa(q, k, v, log_gate, chunk_size=64, sequence_kernel="torch")[0]
    assert torch.equal(torch_path, causal_rfa_chunked(q, k, v, log_gate)[0])
    q64, k64, v64 = q.double(), k.double(), v.double()
    assert torch.equal(causal_rfa(q64, k64, v64, chunk_size=64, sequence_kernel="auto")[0],
                       causal_rfa_chunked(q64, k64, v64)[0])


@pytest.mark.parametrize("activation,gated,first", [("hedgehog", True, False), ("hedgehog", False, True),
                                                    ("relu", True, False), (None, True, False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_step_kernel_matches_the_torch_step_on_cuda(activation, gated, first, dtype):
    """The decoding step's causal update in one Triton launch == TorchKernels' operations (fp32 state; fp16
    projections as fairseq-generate --fp16 gives them), through a beam order over more rows."""
    from rfa_fairseq.gpu.triton_step import launch_causal_layer_step

    torch.manual_seed(2)
    R, W = 24, (F_ // 2 if activation == "hedgehog" else F_)
    proj = torch.randn(R, H * (2 * W + D + 1), device="cuda").to(dtype)
    q, k, v = proj[:, : H * W], proj[:, H * W: 2 * H * W], proj[:, 2 * H * W: 2 * H * W + H * D]
    if activation is None:
        q, k = q.float().abs(), k.float().abs()
    gate = proj[:, 2 * H * W + H * D:] if gated else None
    state_in = None if first else torch.rand(R + 8, H, F_, D + 1, device="cuda")
    order = None if first else torch.randperm(R + 8, device="cuda")[:R]
    outs, states = [], []
    for step in (launch_causal_layer_step, TORCH_KERNELS.causal_layer_step):  # the kernel itself, unchecked
        state_out = torch.full((R, H, F_, D + 1), float("nan"), device="cuda")
        outs.append(step(q, k, v, gate, None, state_in, order, state_out, 1e-3, activation))
        states.append(state_out)
    errors = (relative_error(outs[0], outs[1]), relative_error(states[0], states[1]))
    print(f"out {errors[0]:.1e} state {errors[1]:.1e}")
    assert outs[0].dtype == outs[1].dtype and max(errors) < STEP_TOLERANCES[dtype]


@pytest.mark.parametrize("decode_kernel,name", [("torch", "torch"), ("auto", "triton")])
@pytest.mark.parametrize("gated", [False, True], ids=["ungated", "gated"])
def test_decoding_step_kernels_on_cuda_with_beam_order(gated, decode_kernel, name):
    """The decoding step's kernels on CUDA (the torch kernels; auto's: the causal update in Triton) == the
    recurrence on state[order], in fp32."""
    torch.manual_seed(2)
    kernels = step_kernels(decode_kernel, torch.device("cuda"), torch.float32)
    assert kernels.name == name
    state = torch.rand(4, H, F_, D + 1, device="cuda")
    for order in (torch.tensor([3, 0, 3], device="cuda"), None):
        rows = 3 if order is not None else 4
        q, k = features(rows, H, 1, F_), features(rows, H, 1, F_)
        v = torch.randn(rows, H, 1, D, device="cuda")
        gate = torch.randn(rows, H, device="cuda") if gated else None
        new_state = torch.empty(4, H, F_, D + 1, device="cuda")
        out = kernels.causal_layer_step(q.reshape(rows, -1), k.reshape(rows, -1), v.reshape(rows, -1), gate, None, state,
                                        order, new_state, 1e-3)
        keys, log_gate = gate_keys(k, gate.unsqueeze(-1) if gated else None, None)
        entering = state[order] if order is not None else state
        want_out, want_state = causal_rfa_recurrent(q.double(), keys.double(), v.double(),
                                                    log_gate.double() if gated else None, entering.double())
        assert relative_error(out.view(rows, H, 1, D), want_out) < 1e-5
        assert relative_error(new_state[:rows], want_state) < 1e-5


def test_self_check_trusts_every_kernel_a_model_runs_on_this_gpu():
    """Training (fp32 and bf16, a padded batch, short and long targets: both chunk sizes), scoring and decoding
    with the default map: each Triton variant met is self-checked once, passes, and its check's cost is printed."""
    with triton_self_check.installed(triton_self_check.TritonTrust()):  # no verdicts yet, as in a fresh process
        model, d = gpu_model(flags("hedgehog", gate=True, rfa_cross=False))
        for dtype in (torch.float32, torch.bfloat16):
            model.to(dtype)
            for tgt_len in (10, 40):
                src, src_lengths, prev = on_cuda(*random_batch(d, bsz=3, src_len=9, tgt_len=tgt_len))
                model.train()
                model(src, src_lengths, prev)[0].float().sum().backward()
                model.eval()
                with torch.no_grad():
                    model(src, src_lengths, prev)
                    decode_incrementally(model, model.encoder(src, src_lengths=src_lengths), prev[:, :4], {})
        records = triton_self_check.checks()
    for record in records:
        print(f"{record.kernel} ({record.variant}) {record.dtypes}: {record.outcome}, {record.largest_error:.1e} "
              f"({record.worst}), {record.milliseconds:.0f} ms")
    assert {r.kernel for r in records} == {"causal_rfa", "causal_layer_step"}
    assert all(r.outcome == "passed" for r in records)
    assert len({(r.kernel, r.dtypes, r.variant) for r in records}) == len(records)  # once each


# ------------------------------------------------------------------ model


def gpu_model(options, seed=1, dictionary=None):
    model, d = build_model([*options, *GPU_MODEL], seed=seed, dictionary=dictionary)
    return model.cuda().eval(), d


def on_cuda(*tensors):
    return [t.cuda() for t in tensors]


MODEL_VARIANTS = [  # feature map, gated, RFA encoder, RFA cross-attention
    ("sincos", False, False, True), ("sincos", True, True, True), ("positive", True, False, True),
    ("arccos", False, False, True), ("hedgehog", True, False, False), ("relu", False, False, True),
]


@pytest.mark.parametrize("feature_map,gate,rfa_encoder,rfa_cross", MODEL_VARIANTS)
def test_incremental_decoding_equals_full_forward_on_cuda(feature_map, gate, rfa_encoder, rfa_cross):
    """Full forward (the Triton chunked kernels) == step by step (the decoding step, Triton on CUDA) through a whole model."""
    model, d = gpu_model(flags(feature_map, gate, rfa_encoder, rfa_cross))
    src, src_lengths, prev = on_cuda(*random_batch(d, bsz=3, src_len=9, tgt_len=70))
    with torch.no_grad():
        full, _ = model(src, src_lengths, prev)
        incremental = decode_incrementally(model, model.encoder(src, src_lengths=src_lengths), prev, {})
    error = relative_error(incremental, full)
    print(f"max |full - incremental| = {error:.1e} of the logits' range")
    assert error < TOLERANCE


@pytest.mark.parametrize("gate", [False, True], ids=["ungated", "gated"])
def test_beam_reorder_equals_decoding_the_reordered_batch_on_cuda(gate):
    model, d = gpu_model(flags("sincos", gate))
    batch = on_cuda(*random_batch(d, bsz=4, src_len=8, tgt_len=9, seed=3))
    orders = [torch.tensor(order, device="cuda") for order in ([2, 0, 3, 1], [3, 3, 0, 1], [2, 0])]
    assert_beam_reorder_equals_decoding_the_reordered_batch(model, batch, orders, tolerance=1e-4)


def test_beam_grouped_cross_state_and_shrinking_batch_on_cuda():
    """The cross state once per sentence (beam 3); within-beam reorders and a finished sentence."""
    model, d = gpu_model(flags("sincos", gate=True))
    src, src_lengths, prev = on_cuda(*random_batch(d, bsz=3, src_len=8, tgt_len=8, seed=5))
    assert_beam_grouped_state_follows_reorders_and_shrinks(model, src, src_lengths, prev, tolerance=1e-4)


@pytest.mark.parametrize("feature_map,gate,rfa_cross", [("sincos", False, True), ("hedgehog", True, False)],
                         ids=["sincos-ungated-rfa_cross", "hedgehog-gated-softmax_cross"])
def test_beam_search_scores_equal_full_forward_rescoring_on_cuda(feature_map, gate, rfa_cross):
    """fairseq's beam search on CUDA (decoding steps, reorders, finishing sentences): per-token scores ==
    teacher-forced full forward (the Triton chunked kernels), up to TF32."""
    from fairseq.sequence_generator import SequenceGenerator

    model, d = gpu_model(flags(feature_map, gate, rfa_cross=rfa_cross), seed=4)
    src, src_lengths, _ = on_cuda(*random_batch(d, bsz=5, src_len=7, seed=9))
    gen = SequenceGenerator([model], d, beam_size=4, max_len_b=10, normalize_scores=False)
    worst = 0.0
    with torch.no_grad():
        hyps = gen.generate([model], {"net_input": {"src_tokens": src, "src_lengths": src_lengths}})
        model.set_beam_size(1)  # fairseq's softmax cross-attention would fold the rescoring batch by the beam
        for i, sent in enumerate(hyps):
            for hyp in sent:
                tokens = hyp["tokens"]
                prev = torch.cat([tokens.new_tensor([d.eos()]), tokens[:-1]]).unsqueeze(0)
                logits, _ = model(src[i : i + 1], src_lengths[i : i + 1], prev)
                lprobs = torch.log_softmax(logits.float(), dim=-1)[0].gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
                worst = max(worst, (hyp["positional_scores"] - lprobs).abs().max().item())
    print(f"max |beam score - rescored| = {worst:.1e}")
    assert worst < 2e-2


# ------------------------------------------------------------------ the step as CUDA graphs

GRAPH_VARIANTS = [(fm, gate, fm != "hedgehog") for fm in ("sincos", "positive", "arccos", "hedgehog", "relu")
                  for gate in (False, True)]  # every map, gated and ungated; hedgehog with softmax cross-attention


@pytest.fixture
def graph_counts(monkeypatch):
    """The graph backends of every batch decoded in the test (their captures and replays)."""
    import rfa_fairseq.models.rfa_transformer as rfa_transformer

    made, original = [], rfa_transformer.step_graphs_for

    def spy(device, enabled):
        graphs = original(device, enabled)
        made.append(CountingBackend.of(graphs))
        return graphs

    monkeypatch.setattr(rfa_transformer, "step_graphs_for", spy)
    return made


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
@pytest.mark.parametrize("feature_map,gate,rfa_cross", GRAPH_VARIANTS,
                         ids=[f"{fm}-{'gated' if g else 'ungated'}" for fm, g, _ in GRAPH_VARIANTS])
def test_cuda_graph_replays_give_the_eager_steps_hypotheses(feature_map, gate, rfa_cross, dtype, graph_counts,
                                                            monkeypatch):
    """The static beam search (its whole step one graph, kept across batches) and fairseq's SequenceGenerator (the
    decoder's step a graph per batch; where a sentence finishes early the batch shrinks and graphs are captured
    again), beam 4, hypotheses ending at different steps, two batches of other sources and sizes through the same
    generator: the eager step's hypotheses, and its scores up to the last bits (the same kernels run, in one
    launch)."""
    from fairseq.sequence_generator import SequenceGenerator

    from rfa_fairseq.generation import StaticBeamSearchGenerator

    model, d = gpu_model(flags(feature_map, gate, rfa_cross=rfa_cross), seed=4)
    if dtype == "fp16":
        model.half()
    samples = []
    for bsz, src_len, seed in ((6, 7, 9), (6, 12, 10), (3, 7, 11)):
        src, src_lengths, _ = on_cuda(*random_batch(d, bsz=bsz, src_len=src_len, seed=seed))
        samples.append({"net_input": {"src_tokens": src, "src_lengths": src_lengths}})

    def decode(generator):
        tokens, scores = [], []
        with torch.no_grad():
            for sample in samples:
                hyps = generator.generate([model], sample)
                tokens += [[h["tokens"].tolist() for h in sent] for sent in hyps]
                scores += [h["positional_scores"].float().cpu() for sent in hyps for h in sent]
        return tokens, torch.cat(scores)

    for name in ("static", "fairseq"):
        if name == "static":
            eager = StaticBeamSearchGenerator(model, d, beam_size=4, max_len_b=12, cuda_graphs=False)
            graphed = StaticBeamSearchGenerator(model, d, beam_size=4, max_len_b=12)
            CountingBackend.of(graphed.graphs)  # made as the generator prepared its weights: counted from here
        else:
            eager = graphed = SequenceGenerator([model], d, beam_size=4, max_len_b=12)
        model.decoder.rfa.rfa_cuda_graphs = False  # --no-rfa-cuda-graphs (the SequenceGenerator path's switch)
        want_tokens, want_scores = decode(eager)
        model.decoder.rfa.rfa_cuda_graphs = True
        graph_counts.clear()
        got_tokens, got_scores = decode(graphed)
        if name == "static":
            graphs = [graphed.graphs.backend]
        else:
            graphs = [g for g in graph_counts if g is not None]
        captures, replays = sum(g.captures for g in graphs), sum(g.replays for g in graphs)
        lengths = sorted({len(t) for sent in want_tokens for t in sent})
        print(f"{name}: lengths {lengths}, captures {captures}, replays {replays}, "
              f"max |score difference| {(got_scores - want_scores).abs().max().item():.1e}")
        assert captures >= 2 and replays > captures
        assert got_tokens == want_tokens
        torch.testing.assert_close(got_scores, want_scores, rtol=0, atol=1e-5 if dtype == "fp32" else 1e-3)


# ------------------------------------------------------------------ fairseq-train / fairseq-generate

CLI_MODEL = ["--arch", "rfa_transformer",
             *tiny_model_flags(embed_dim=H * D, ffn_dim=1024, heads=H, encoder_layers=1, decoder_layers=2)]
CLI_TRAIN = [
    "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--lr", "5e-4", "--lr-scheduler", "inverse_sqrt",
    "--warmup-updates", "50", "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1",
    "--dropout", "0.1", "--max-tokens", "4096", "--num-workers", "0", "--seed", "3", "--log-format", "json",
    "--log-interval", "10", "--no-epoch-checkpoints", "--save-interval", "1000",  # one checkpoint, at the end
    "--disable-validation",
]


def run_module(module, *args, timeout=900):
    """python -m MODULE ARGS (no console scripts needed), with this checkout importable."""
    path = os.pathsep.join([REPO] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    proc = subprocess.run([sys.executable, "-m", module, *map(str, args)], capture_output=True, text=True,
                          env=env(PYTHONPATH=path), timeout=timeout)
    assert proc.returncode == 0, f"{module} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("cuda_cli")
    run(os.path.join(REPO, "data-prep", "make_synthetic_corpus.py"), root / "raw",
        "--train", "4000", "--valid", "60", "--test", "40")
    run_module("fairseq_cli.preprocess", "--source-lang", "src", "--target-lang", "tgt",
        "--trainpref", root / "raw/train", "--validpref", root / "raw/valid", "--testpref", root / "raw/test",
        "--destdir", root / "bin", "--joined-dictionary", "--workers", "4")
    return root


def hypotheses(generate_stdout):
    return [line for line in generate_stdout.splitlines() if line.startswith("H-")]


@pytest.mark.parametrize("precision,rfa_flags", [
    ("fp16", ["--no-rfa-gate", "--no-rfa-softmax-cross-attn"]),  # ungated, RFA cross-attention
    ("bf16", ["--rfa-gate", "--rfa-softmax-cross-attn"]),  # gated, softmax cross-attention
], ids=["fp16-ungated-rfa_cross", "bf16-gated-softmax_cross"])
def test_fairseq_train_and_generate_on_cuda(corpus, precision, rfa_flags, updates=200):
    """200 updates of fairseq-train on the GPU (--fp16: fairseq's loss scaling; --bf16 through
    rfa-train, since fairseq 0.12.3 reads --bf16 as a TPU run): every logged loss finite, the loss
    goes down; then fairseq-generate (beam 4) on the test set, in fp16 after --fp16 training.
    fp32 is covered above (the model tests and fairseq's SequenceGenerator on CUDA)."""
    save_dir = corpus / f"ckpt_{precision}"
    precision_flags = {"fp16": ["--fp16"], "bf16": ["--bf16"]}[precision]
    proc = run_module("rfa_fairseq.cli.train", corpus / "bin", "--user-dir", PLUGIN_DIR, *CLI_MODEL, *rfa_flags, *CLI_TRAIN,
                      *precision_flags, "--max-update", updates, "--save-dir", save_dir)
    log = proc.stdout + proc.stderr
    losses = json_losses(log)
    print(f"{precision}: losses every 10 updates: {[round(losses[u], 3) for u in sorted(losses)]}")
    assert max(losses) == updates, f"training stopped at update {max(losses)}"
    assert all(math.isfinite(loss) for loss in losses.values()), losses
    first, last = losses[min(losses)], losses[max(losses)]
    assert last < first, f"loss did not go down: {first} -> {last}"
    if precision == "bf16":
        assert "'bf16': True" in log and "'tpu': False" in log  # bfloat16 on the GPU, not the TPU path
    out = run_module("fairseq_cli.generate", corpus / "bin", "--user-dir", PLUGIN_DIR,
                     "--path", save_dir / "checkpoint_last.pt", "--gen-subset", "test", "--beam", "4",
                     "--batch-size", "16", "--max-len-b", "30", "--required-batch-size-multiple", "1",
                     *(["--fp16"] if precision == "fp16" else [])).stdout
    assert len(hypotheses(out)) == 40


# ------------------------------------------------------------------ host synchronisation (last: -x)


def test_decoding_steps_and_reorders_do_not_synchronize_the_host():
    """RFA's decoding step (embeddings, every layer's self and cross attention, logits) and the beam reorder
    queue GPU work without waiting for it: torch's sync debug mode turns any host synchronisation into an
    error. (fairseq's beam search itself still synchronises; this checks the decoder's part.)"""
    model, d = gpu_model(flags("sincos", gate=True))
    beam, sentences = 4, 3
    model.decoder.set_beam_size(beam)
    src, src_lengths, prev = on_cuda(*random_batch(d, bsz=sentences, src_len=7, tgt_len=8))
    expand = torch.arange(sentences, device="cuda").repeat_interleave(beam)
    src, src_lengths, prev = src[expand], src_lengths[expand], prev[expand]
    within_beam = torch.tensor([1, 1, 0, 3], device="cuda")
    order = expand * beam + within_beam.repeat(sentences)  # (B * beam,) beams swap within their sentence
    state = {}
    with torch.no_grad():
        encoder_out = model.encoder(src, src_lengths=src_lengths)

        def step(t):
            model.decoder(prev[:, : t + 1], encoder_out=encoder_out, incremental_state=state)
            model.decoder.reorder_incremental_state_scripting(state, order)

        for t in range(2):  # the first step builds the batch's state
            step(t)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for t in range(2, prev.size(1)):
                step(t)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
