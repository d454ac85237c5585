"""The static beam search's native step (generation/static_beam_search.py: on the CPU in fp32 one
`DecodeProgram.search_step` per step) beyond the default model: against fairseq's SequenceGenerator on the model
variants the native program serves (RFA cross-attention, pre-norm, the random feature maps, a gelu FFN), on one it
does not (a tanh FFN: the torch step), and at --rfa-decode-precision int8; then end to end, the user's batches joined
and decoded two at once at 2 threads, counted (fairseq-generate, fairseq-interactive, none at --buffer-size 1,
hub.translate), hub.translate's refusal of a sentence that is not a string, and fairseq-interactive against
fairseq-generate."""
import json
import math
import sys
import threading
import types

import pytest
import torch
from cli_support import run, synthetic_data, train_generate_model
from conftest import PLUGIN_DIR
from fairseq.sequence_generator import SequenceGenerator
from helpers import build_model, cpp_extension, random_batch
from test_static_generator import assert_same_hypotheses

from rfa_fairseq.generation import StaticBeamSearchGenerator, static_beam_search
from rfa_fairseq.modules.decoding import DecodingState
from rfa_fairseq.kernel_choice import step_kernels

N_SENTENCES = 8
GENERATION = {"beam_size": 4, "max_len_b": 20}


def eos_varying_model(flags, eos_scale=0.7):
    """A tiny model whose EOS logit depends strongly on the decoder's output (an untrained model's EOS is as likely
    as any token), so that the batch's sentences end at very different steps and the batch halves (eos_scale: the
    EOS row's size; pre-norm's final layer norm makes 0.7 end every sentence at once)."""
    model, d = build_model(["--rfa-num-features", "6", *flags])
    model.eval()
    with torch.no_grad():
        W = model.decoder.output_projection.weight  # (V, C)
        W[d.eos()] = eos_scale * torch.randn(W.size(1), generator=torch.Generator().manual_seed(0))
    return model, d


def sample_of(d):
    src, src_lengths, _ = random_batch(d, bsz=N_SENTENCES, src_len=9, seed=1)  # (N, S) left-padded, (N,)
    return {"net_input": {"src_tokens": src, "src_lengths": src_lengths}, "id": torch.arange(N_SENTENCES)}


def search_both(model, d, sample, monkeypatch):
    """fairseq's SequenceGenerator and the static search on the same model and batch -> (want, got, what ran):
    the static search's runtime, how many of its steps ran in Python (`_step`: the torch step), the batch sizes
    it halved from and to, and how many native calls ran steps (search_steps)."""
    ran = {"python_steps": 0, "halvings": [], "native_calls": 0}
    python_step, keep_sentences = StaticBeamSearchGenerator._step, static_beam_search._Search.keep_sentences

    def counted_step(self, *args, **kwargs):
        ran["python_steps"] += 1
        return python_step(self, *args, **kwargs)

    def recorded_halving(self, state, kept):
        ran["halvings"].append((self.rows.sentences, kept.numel()))
        return keep_sentences(self, state, kept)

    with torch.no_grad():
        want = SequenceGenerator([model], d, **GENERATION).generate([model], sample)
        generator = StaticBeamSearchGenerator(model, d, parts=1, **GENERATION)
        monkeypatch.setattr(StaticBeamSearchGenerator, "_step", counted_step)  # after the warm-up step at build
        monkeypatch.setattr(static_beam_search._Search, "keep_sentences", recorded_halving)
        runtime = model.decoder.decoding_runtime()
        if runtime.program is not None:
            monkeypatch.setattr(runtime, "program", CountedSearchSteps(runtime.program, ran))
        got = generator.generate([model], sample)
    ran["runtime"] = generator.lanes[0].state.runtime
    return want, got, ran


def assert_sentences_end_apart(hypotheses, ran):
    """The batch's sentences end at different steps, and the search took the path of its step: the native step's
    whole search one native call, never halving (its steps decode only the places still translating); the torch
    step's halving when half the places have finished."""
    lengths = {len(sentence[0]["tokens"]) for sentence in hypotheses}
    assert len(lengths) >= 3, f"the test needs sentences that end at different steps: best lengths {lengths}"
    if ran["runtime"].program is not None:
        assert ran["native_calls"] == 1 and not ran["halvings"], ran
    else:
        assert ran["halvings"] and ran["halvings"][0][0] == N_SENTENCES, f"the batch never halved: {ran['halvings']}"


VARIANTS = [  # (flags, the step's kernels, the EOS row's size)
    pytest.param(["--no-rfa-softmax-cross-attn"], "cpp", 0.7, id="rfa_cross_attn"),
    pytest.param(["--decoder-normalize-before", "--encoder-normalize-before"], "cpp", 0.35, id="pre_norm"),
    pytest.param(["--rfa-feature-map", "sincos"], "cpp", 0.7, id="sincos"),
    pytest.param(["--rfa-feature-map", "arccos"], "cpp", 0.7, id="arccos"),
    pytest.param(["--rfa-feature-map", "positive"], "cpp", 0.7, id="positive"),
    pytest.param(["--activation-fn", "gelu"], "cpp", 0.7, id="gelu_ffn"),
    pytest.param(["--activation-fn", "tanh"], "torch", 0.7, id="tanh_ffn_torch_step"),  # the program has no tanh
]


@pytest.mark.parametrize("flags,kernels,eos_scale", VARIANTS)
def test_static_search_equals_sequence_generator_on_model_variants(flags, kernels, eos_scale, monkeypatch):
    """Hypotheses and scores of the static search == SequenceGenerator's, on the step the variant must run: the
    native program (every search step one native call, none in Python) or, for what it cannot run, the torch step."""
    if kernels == "cpp":
        cpp_extension()
    model, d = eos_varying_model(flags, eos_scale)
    sample = sample_of(d)
    want, got, ran = search_both(model, d, sample, monkeypatch)
    runtime = ran["runtime"]
    with torch.no_grad():
        assert runtime is model.decoder.decoding_runtime()  # the runtime SequenceGenerator's steps decoded on too
    assert runtime.kernels.name == kernels
    if kernels == "cpp":
        assert runtime.program is not None and ran["python_steps"] == 0, ran
    else:
        assert runtime.program is None and ran["python_steps"] > 0, ran
    assert_same_hypotheses(want, got)
    assert_sentences_end_apart(got, ran)


class CountedSearchSteps:
    """A runtime's program that counts its search_steps calls (each a batch's whole native search) in ran."""

    def __init__(self, program, ran):
        self.program, self.ran = program, ran

    def __getattr__(self, name):
        return getattr(self.program, name)

    def search_steps(self, *args):
        self.ran["native_calls"] += 1
        return self.program.search_steps(*args)


class OneStepAtATime:
    """A runtime's program whose search_steps runs the same steps one native search_step each, checking around each
    that it decoded only the places still translating, their causal states kept at their places' rows: a step writes
    the live places' rows (at the first step each place's first row) and leaves every other row as it was."""

    def __init__(self, program):
        self.program, self.steps_with_finished_places = program, 0
        self.search = None  # the _Search whose NativeSearch the calls get (recorded as it is made)

    def __getattr__(self, name):
        return getattr(self.program, name)

    def search_steps(self, batch, native_search, t0, parity, first, last_step, max_len):
        search = self.search
        N, K = search.rows.sentences, search.rows.beam
        t, steps = t0, 0
        while True:
            first = t == 0
            live = torch.arange(N) if first else (~search.views.finished[:N]).nonzero().squeeze(1)
            rows = live * K if first else (live.unsqueeze(1) * K + torch.arange(K)).view(-1)
            others = torch.ones(N * K, dtype=torch.bool)
            others[rows] = False
            # the states' bits (a buffer's unwritten rows may hold NaNs)
            written = [layer.self_attn.states[1 - parity][: N * K].view(torch.uint8) for layer in search.state.layers]
            before = [w.clone() for w in written]
            finished = self.program.search_step(batch, native_search, t, parity, first, t >= max_len)
            self.steps_with_finished_places += int(0 < live.numel() < N)
            for w, old in zip(written, before):
                assert torch.equal(w[others], old[others]), f"step {t} wrote a row of no live beam"
                changed = (w[rows] != old[rows]).flatten(1).any(1)
                assert bool(changed.all()), f"step {t} left live rows {rows[~changed].tolist()} unwritten"
            parity, steps = 1 - parity, steps + 1
            if t >= last_step or finished == N:
                return types.SimpleNamespace(last_step=t, finished=finished, steps=steps)
            t += 1


def test_the_native_step_decodes_only_the_places_still_translating(monkeypatch):
    """Sentences that finish before the others cost no more rows: each native step decodes the places still
    translating (their states written at their places' rows, the finished places' states untouched), and the
    hypotheses and scores stay SequenceGenerator's."""
    cpp_extension()
    model, d = eos_varying_model([])
    sample = sample_of(d)
    with torch.no_grad():
        runtime = model.decoder.decoding_runtime()
    stepper = OneStepAtATime(runtime.program)
    native_search = static_beam_search._Search._native_search

    def recorded_native_search(search):
        stepper.search = search
        return native_search(search)

    monkeypatch.setattr(static_beam_search._Search, "_native_search", recorded_native_search)
    monkeypatch.setattr(runtime, "program", stepper)
    want, got, ran = search_both(model, d, sample, monkeypatch)
    assert ran["runtime"] is runtime and ran["python_steps"] == 0, ran
    assert stepper.steps_with_finished_places > 0, "no step ran with finished places: the test checks nothing"
    assert_same_hypotheses(want, got)
    assert_sentences_end_apart(got, ran)


SEARCH_OPTIONS = [
    pytest.param({}, None, id="plain"),
    pytest.param({"min_len": 5, "unk_penalty": 1.5}, None, id="min_len_unkpen"),
    pytest.param({"no_repeat_ngram_size": 2}, None, id="no_repeat_ngram2"),
    pytest.param({}, "prefix", id="prefix_tokens"),
    pytest.param({"no_repeat_ngram_size": 3, "unk_penalty": -2.0}, "prefix_ending_in_eos", id="prefix_eos_ngram3"),
]


@pytest.mark.parametrize("options,prefix", SEARCH_OPTIONS)
@torch.no_grad()
def test_the_torch_search_and_the_native_search_agree_step_by_step_on_the_same_logits(options, prefix, monkeypatch):
    """The one search contract, in its two implementations: the torch search's step (StaticBeamSearchGenerator._step,
    what CUDA captures) and the native search's (DecodeProgram.choose, what the CPU runs), fed the same logits at
    every step, leave the same buffers after every step (tokens, scores, the beams continued, the finished flags and
    the finalized hypotheses), with the masks of the options the CLIs offer: minimum length, unk penalty, n-gram
    blocking, prefix tokens (one ending in EOS: its place's beams copied from the first)."""
    cpp_extension()
    model, d = eos_varying_model([])
    N, K, V, max_len = 5, 3, len(d), 9
    g = torch.Generator().manual_seed(11)
    prefix_tokens = None
    if prefix is not None:
        prefix_tokens = torch.randint(4, V, (N, 3), generator=g)
        prefix_tokens[1, 2] = d.pad()  # a shorter prefix
        if prefix == "prefix_ending_in_eos":
            prefix_tokens[2, 1] = d.eos()
    generator = StaticBeamSearchGenerator(model, d, beam_size=K, max_len_b=max_len, **options)
    runtime = model.decoder.decoding_runtime()
    src, src_lengths, _ = random_batch(d, bsz=N, src_len=6, seed=2)
    key, pad = model.decoder.encoder_keys(model.encoder(src, src_lengths=src_lengths))
    searches = []
    for lane in (static_beam_search.Lane(), static_beam_search.Lane()):
        state = lane.state.start(runtime, N * K, K, key, pad)
        searches.append(static_beam_search._Search(generator, lane, state, max_len, d.eos(), torch.device("cpu"),
                                                   lagged=False, prefix_tokens=prefix_tokens))
    torch_search, native_search = searches
    logits = {}
    monkeypatch.setattr(DecodingState, "compute", lambda self, *args, **kwargs: (logits["rows"], None))
    for t in range(max_len + 1):
        first, last = t == 0, t >= max_len
        rows = 2.5 * torch.randn(N * K, V, generator=g)
        rows[:, d.eos()] += 3.0 * torch.rand(N * K, 1, generator=g).squeeze(1) * (t / max_len) - 1.0
        rows[torch.arange(0, N * K, 2), d.unk()] += 4.0  # <unk> often among the best: its penalty matters
        logits["rows"] = rows
        live = torch.arange(N) if first else (~native_search.views.finished).nonzero().squeeze(1)
        if live.numel() == 0:
            break
        packed = rows.view(N, K, V)[live][:, :1 if first else K].reshape(-1, V).contiguous()
        step_prefix = prefix_tokens if prefix_tokens is not None and t < prefix_tokens.size(1) and not last else None
        generator._step(torch_search, torch_search.state, t, first, last, step_prefix)
        parity = native_search.rows.parity
        runtime.program.search_choose(native_search.native, packed, t, parity, first, last)
        for search in searches:
            search.after_step(search.state, t)
        a, b = torch_search.views, native_search.views
        fin = b.finished.clone()
        assert torch.equal(a.finished, fin), f"step {t}: finished {a.finished} != {fin}"
        assert torch.equal(a.fin_count, b.fin_count), f"step {t}: fin_count"
        for n in range(N):  # the finalized hypotheses, slot by slot
            for slot in range(n * K, n * K + int(b.fin_count[n])):
                steps = int(b.fin_steps[slot])
                assert int(a.fin_steps[slot]) == steps, f"step {t}: place {n} slot {slot}"
                assert torch.equal(a.fin_tokens[slot, : steps + 2], b.fin_tokens[slot, : steps + 2]), f"step {t}"
                torch.testing.assert_close(a.fin_scores[slot, : steps + 1], b.fin_scores[slot, : steps + 1],
                                           rtol=0, atol=1e-5)
        # the places still translating continue alike (a finished place's rows: the native search leaves them)
        going = (~fin).nonzero().squeeze(1)
        rows_going = (going.unsqueeze(1) * K + torch.arange(K)).view(-1)
        assert torch.equal(torch_search.tokens[rows_going, : t + 2], native_search.tokens[rows_going, : t + 2]), \
            f"step {t}: tokens"
        torch.testing.assert_close(torch_search.scores[rows_going, : t + 1], native_search.scores[rows_going, : t + 1],
                                   rtol=0, atol=1e-5)
        assert torch.equal(a.cands_to_ignore[going], b.cands_to_ignore[going]), f"step {t}: cands_to_ignore"
        # the order has one meaning: the row of its place each row continues
        assert torch.equal(a.order[rows_going], b.order[rows_going]), f"step {t}: order"
    assert bool(native_search.views.finished.all()), "every place ends by the last step"
    assert 0 < int(native_search.views.fin_count.sum()) <= N * K


def test_static_search_at_int8_equals_sequence_generator_on_the_same_int8_model(monkeypatch):
    """--rfa-decode-precision int8: the native search step and SequenceGenerator (the decoder's DecodingState on the
    same int8 native kernels) give the same hypotheses and scores; the int8 linear layers really ran."""
    cpp_extension()
    try:
        step_kernels("auto", torch.device("cpu"), torch.float32, "int8")
    except ValueError as why:
        print(f"int8 decoding is unavailable here: {why}")
        pytest.skip(f"int8 decoding is unavailable here: {why}")
    model, d = eos_varying_model([])
    sample = sample_of(d)
    with torch.no_grad():
        fp32 = StaticBeamSearchGenerator(model, d, parts=1, **GENERATION).generate([model], sample)
    model.decoder.rfa.rfa_decode_precision = "int8"  # one RFAConfig: the encoder's layers read it too
    want, got, ran = search_both(model, d, sample, monkeypatch)
    runtime = ran["runtime"]
    assert runtime.kernels.name == "cpp" and runtime.kernels.gemm.startswith("int8"), runtime.kernels.gemm
    assert runtime.program is not None and ran["python_steps"] == 0, ran
    assert_same_hypotheses(want, got)
    assert_sentences_end_apart(got, ran)
    # the causal layers' state in fp16 (half the bytes a step reads and writes), fp32 where asked for
    assert runtime.kernels.state_dtype == torch.float16
    with torch.no_grad():
        key, pad = model.decoder.encoder_keys(model.encoder(sample["net_input"]["src_tokens"],
                                                            src_lengths=sample["net_input"]["src_lengths"]))
        state = DecodingState().start(runtime, N_SENTENCES * 4, 4, key, pad)
    assert {t.dtype for layer in state.layers for t in layer.self_attn.states} == {torch.float16}
    model.decoder.rfa.rfa_decode_state = "fp32"
    with torch.no_grad():
        assert model.decoder.decoding_runtime().kernels.state_dtype == torch.float32
    model.decoder.rfa.rfa_decode_state = "auto"
    # int8 is not fp32 in disguise: some score moves by more than fp32 rounding
    moved = max(abs(float(a[0]["score"]) - float(b[0]["score"])) for a, b in zip(fp32, got))
    assert moved > 1e-4, f"int8 scores equal fp32's to {moved}: the int8 layers did not run"


# ---------------------------------------------------------------- fairseq-generate and fairseq-interactive

TEST_SENTENCES = 160  # batches of 64, 64 and 32: at 2 threads the 64s decoded at once
DECODE = ["--beam", "4", "--max-len-b", "25", "--cpu"]

# fairseq-generate or fairseq-interactive ($1) with the plugin spied on, what it saw written to $2's file as JSON:
# "searches", every StaticBeamSearchGenerator._search (thread, sentences, warm-up, kernels); "joins", the user batches
# of each joined batch the task's iterator made (batch_groups.join_batches of more than one)
SPIED_CLI = """
import json, sys, threading
from rfa_fairseq.generation import batch_groups, joined_sample, static_beam_search as sbs
searches, joins = [], []
search, join_batches = sbs.StaticBeamSearchGenerator._search, batch_groups.join_batches
def spied_search(self, lane, runtime, key, pad, N, *args):
    searches.append({"thread": threading.current_thread().name, "sentences": N, "warm_up": args[-1] is not None,
                     "kernels": runtime.kernels.name})
    return search(self, lane, runtime, key, pad, N, *args)
def spied_join(batches, *args):
    joined = join_batches(batches, *args)
    if len(batches) > 1:
        joins.append(len(joined_sample.user_batches(joined)))
    return joined
sbs.StaticBeamSearchGenerator._search = spied_search
batch_groups.join_batches = spied_join
tool, spy_file, sys.argv = sys.argv[1], sys.argv[2], ["fairseq-" + sys.argv[1], *sys.argv[3:]]
if tool == "generate":
    from fairseq_cli.generate import cli_main
else:
    from fairseq_cli.interactive import cli_main
cli_main()
with open(spy_file, "w") as f:
    json.dump({"searches": searches, "joins": joins}, f)
"""


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(corpus, checkpoint): a tiny rfa_transformer trained briefly on a synthetic corpus of 160 test sentences
    (100 updates, ~15 s: about 100 distinct hypotheses of 2 to 25 tokens; at 30 updates only 10 distinct ones)."""
    data = synthetic_data(tmp_path_factory, test=TEST_SENTENCES)
    return data, train_generate_model(data, tmp_path_factory.mktemp("native_search_variants"), max_update=100)


def hypothesis_lines(stdout):
    """{sentence id: (score, hypothesis)} of fairseq's H- lines ("H-7\\t-0.31\\tw1 w2")."""
    rows = [line.split("\t") for line in stdout.splitlines() if line.startswith("H-")]
    return {int(row[0][2:]): (float(row[1]), row[2]) for row in rows}


def source_lines(stdout):
    """{sentence id: source} of fairseq's S- lines ("S-7\\tw3 w9")."""
    rows = [line.split("\t") for line in stdout.splitlines() if line.startswith("S-")]
    return {int(row[0][2:]): row[1] for row in rows}


def assert_same_lines(want, got, sentences=TEST_SENTENCES):
    """The same sentences with the same hypotheses, scores up to fp32 rounding (other batch shapes); hypotheses
    varied enough that sentences matched wrongly would differ."""
    assert sorted(want) == sorted(got) and len(want) == sentences
    assert len({hypothesis for _, hypothesis in want.values()}) > sentences // 4, want
    for i in want:
        assert want[i][1] == got[i][1], f"sentence {i}: {want[i]} != {got[i]}"
        assert math.isclose(want[i][0], got[i][0], abs_tol=1e-4), f"sentence {i}: {want[i]} != {got[i]}"


def spied_cli(tmp_path, tool, threads, *args, stdin=None):
    """fairseq-`tool` (generate, interactive) at OMP_NUM_THREADS=threads under SPIED_CLI -> (the process, the searches
    that ran, not the warm-up, all on the native step, the joined batches' user batch counts)."""
    spy_file = tmp_path / f"spied_{len(list(tmp_path.iterdir()))}.json"
    proc = run(sys.executable, "-c", SPIED_CLI, tool, spy_file, *args, stdin=stdin, OMP_NUM_THREADS=str(threads))
    assert "static beam search generator" in proc.stdout + proc.stderr
    spied = json.loads(spy_file.read_text())
    searches = [s for s in spied["searches"] if not s["warm_up"]]
    assert searches and all(s["kernels"] == "cpp" for s in searches), searches
    return proc, searches, spied["joins"]


def spied_generate(trained, tmp_path, parts, batch_size=64, threads=2):
    """fairseq-generate of the test split; parts: None (auto) or --rfa-decode-parts.
    -> ({id: (score, hypothesis)}, the searches that ran, the joined batches' user batch counts)."""
    data, checkpoint = trained
    overrides = [] if parts is None else ["--model-overrides", f"{{'rfa_decode_parts': {parts}}}"]
    proc, searches, joins = spied_cli(tmp_path, "generate", threads, data / "bin", "--user-dir", PLUGIN_DIR,
                                      "--path", checkpoint, "--gen-subset", "test", "--batch-size", str(batch_size),
                                      "--required-batch-size-multiple", "1", *DECODE, *overrides)
    return hypothesis_lines(proc.stdout), searches, joins


def on_part_threads(searches):
    return [s for s in searches if s["thread"].startswith("rfa-decode-part")]


@pytest.mark.slow
def test_fairseq_generate_at_two_threads_decodes_two_batches_at_once_with_one_threads_lines(trained, tmp_path):
    """Auto (no --rfa-decode-parts) at 2 threads: fairseq-generate's batches of 64, 64 and 32 come as one joined batch
    and are searched two at a time on the generator's two threads; the lines, scores included, are those of one
    thread. One batch of all 160 sentences is not joined, but split into 2 parts of 80."""
    one_thread, unsplit, joins = spied_generate(trained, tmp_path, parts=None, threads=1)
    assert sorted(s["sentences"] for s in unsplit) == [32, 64, 64] and not on_part_threads(unsplit), unsplit
    assert joins == []
    auto, searches, joins = spied_generate(trained, tmp_path, parts=None)
    assert joins == [3]  # the three batches, joined into one
    assert sorted(s["sentences"] for s in on_part_threads(searches)) == [32, 64, 64], searches
    assert len({s["thread"] for s in searches}) == 2, searches  # the two part threads
    assert one_thread == auto
    assert len({hypothesis for _, hypothesis in auto.values()}) > TEST_SENTENCES // 4, auto

    one_batch, searches, joins = spied_generate(trained, tmp_path, parts=None, batch_size=TEST_SENTENCES)
    assert joins == []
    assert sorted(s["sentences"] for s in on_part_threads(searches)) == [80, 80], searches
    assert_same_lines(one_thread, one_batch)  # other batches: the same hypotheses, scores to fp32 rounding

    at_once, searches, joins = spied_generate(trained, tmp_path, parts=1)  # --rfa-decode-parts 1: one at a time
    assert joins == [] and not on_part_threads(searches), searches
    assert at_once == one_thread


def spied_interactive(trained, tmp_path, threads, buffer_size=40, batch_size=16, lines=None):
    """fairseq-interactive of the test split's source lines (or `lines`) -> (the process, the searches that ran, the
    joined batches' user batch counts)."""
    data, checkpoint = trained
    lines = lines or (data / "raw" / "test.src").read_text().splitlines()
    proc, searches, joins = spied_cli(tmp_path, "interactive", threads, data / "bin", "--user-dir", PLUGIN_DIR,
                                      "--path", checkpoint, "--batch-size", str(batch_size), *DECODE,
                                      "--source-lang", "src", "--target-lang", "tgt", "--buffer-size", str(buffer_size),
                                      stdin="\n".join(lines) + "\n")
    assert len(source_lines(proc.stdout)) == len(lines)
    return proc, searches, joins


def printed(proc):
    return [line for line in proc.stdout.splitlines() if line[:2] in ("S-", "H-", "P-", "D-")]


@pytest.mark.slow
def test_fairseq_interactive_at_two_threads_decodes_two_batches_at_once_with_one_threads_lines(trained, tmp_path):
    """Buffers of 40 lines in batches of 16 (16, 16, 8 a buffer): at 2 threads each buffer's three batches are joined
    (the dict fairseq-interactive rebuilds from the joined tensors gets its record back) and searched on the part
    threads; the lines of one thread, which joins none."""
    one, searches, joins = spied_interactive(trained, tmp_path, threads=1)
    assert joins == [] and not on_part_threads(searches), searches
    two, searches, joins = spied_interactive(trained, tmp_path, threads=2)
    assert joins == [3, 3, 3, 3]
    assert sorted(s["sentences"] for s in on_part_threads(searches)) == [8] * 4 + [16] * 8, searches
    assert printed(one) == printed(two)


@pytest.mark.slow
def test_fairseq_interactive_at_buffer_size_1_joins_no_batch(trained, tmp_path):
    """--buffer-size 1 (and --batch-size 1) at 2 threads: each line is a batch of its own, so none is joined and every search runs on the
    main thread; the hypotheses of buffers of 24 lines, whose batches of 8 are joined."""
    data, _ = trained
    lines = (data / "raw" / "test.src").read_text().splitlines()[:24]
    one_line, searches, joins = spied_interactive(trained, tmp_path, threads=2, buffer_size=1, batch_size=1,
                                                  lines=lines)
    assert joins == [] and not on_part_threads(searches), searches
    assert [s["sentences"] for s in searches] == [1] * 24
    buffered, searches, joins = spied_interactive(trained, tmp_path, threads=2, buffer_size=24, batch_size=8,
                                                  lines=lines)
    assert joins == [3] and len(on_part_threads(searches)) == 3, searches
    assert_same_lines(hypothesis_lines(one_line.stdout), hypothesis_lines(buffered.stdout), sentences=24)


@pytest.mark.slow
def test_hub_translate_at_two_threads_decodes_two_batches_at_once_with_one_threads_translations(trained, monkeypatch):
    from rfa_fairseq import hub
    from rfa_fairseq.generation import batch_groups

    data, checkpoint = trained
    lines = (data / "raw" / "test.src").read_text().splitlines()
    translator = hub.load(checkpoint, data / "bin", sentencepiece_model=None, batch_size=16, device="cpu",
                          source_lang="src", target_lang="tgt")
    threads_seen, joins = [], []
    search, join_batches = StaticBeamSearchGenerator._search, batch_groups.join_batches

    def spied(self, lane, *args):
        threads_seen.append(threading.current_thread().name)
        return search(self, lane, *args)

    def spied_join(batches, *args):
        joins.append(len(batches))
        return join_batches(batches, *args)

    monkeypatch.setattr(StaticBeamSearchGenerator, "_search", spied)
    monkeypatch.setattr(batch_groups, "join_batches", spied_join)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = translator.translate(lines, beam=4, max_len_b=25)
        assert not any(name.startswith("rfa-decode-part") for name in threads_seen) and joins == []
        torch.set_num_threads(2)
        threads_seen.clear()
        two = translator.translate(lines, beam=4, max_len_b=25)
    finally:
        torch.set_num_threads(before)
    assert joins == [TEST_SENTENCES // 16]  # the 10 batches, joined into one
    assert sum(name.startswith("rfa-decode-part") for name in threads_seen) == TEST_SENTENCES // 16
    assert one == two and len(one) == TEST_SENTENCES


@pytest.mark.slow
def test_hub_translate_names_a_sentence_that_is_not_a_string_before_encoding_any(trained, monkeypatch):
    from rfa_fairseq import hub

    data, checkpoint = trained
    line = (data / "raw" / "test.src").read_text().splitlines()[0]
    translator = hub.load(checkpoint, data / "bin", sentencepiece_model=None, device="cpu",
                          source_lang="src", target_lang="tgt")
    encoded = []
    encode = translator.encode
    monkeypatch.setattr(translator, "encode", lambda sentence: encoded.append(sentence) or encode(sentence))
    with pytest.raises(TypeError, match=r"^sentences\[1\] is int \(3\), not str"):
        translator.translate([line, 3], beam=4)
    with pytest.raises(TypeError, match=r"^sentences\[2\] is NoneType \(None\), not str"):
        translator.translate([line, line, None], beam=4)
    with pytest.raises(TypeError, match=r"^translate takes a str or a list of str, got int"):
        translator.translate(3, beam=4)
    assert encoded == []  # refused before any sentence was encoded
    assert translator.translate(iter([line]), beam=4) == translator.translate([line], beam=4)
    assert encoded == [line, line]


@pytest.mark.slow
def test_fairseq_interactive_prints_fairseq_generates_hypotheses(trained):
    """The test split's source lines through fairseq-interactive (batches of 16 from buffers of 40, numbered in input
    order) and fairseq-generate (batches of 16 of the length-sorted split, numbered by dataset id = line): the same
    source and hypothesis for every sentence, both on the static search."""
    data, checkpoint = trained
    common = ["--user-dir", PLUGIN_DIR, "--path", checkpoint, "--batch-size", "16", *DECODE]
    generate = run("fairseq-generate", data / "bin", *common, "--gen-subset", "test",
                   "--required-batch-size-multiple", "1")
    lines = (data / "raw" / "test.src").read_text().splitlines()
    interactive = run("fairseq-interactive", data / "bin", *common, "--source-lang", "src", "--target-lang", "tgt",
                      "--buffer-size", "40", stdin="\n".join(lines) + "\n")
    for proc in (generate, interactive):
        assert "static beam search generator" in proc.stdout + proc.stderr
    sources = source_lines(interactive.stdout)
    assert len(sources) == len(lines) == TEST_SENTENCES
    assert sources == source_lines(generate.stdout)  # interactive's ids are generate's: the same sentences
    assert_same_lines(hypothesis_lines(generate.stdout), hypothesis_lines(interactive.stdout))
