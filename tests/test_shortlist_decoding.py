"""Decoding with a vocabulary shortlist (--rfa-shortlist): each batch's output projection and log-softmax over the
union of its sentences' candidate target tokens (shortlist.Shortlist.union), hypotheses in the full vocabulary's ids.

The reference is fairseq's SequenceGenerator on the model without the option, its logits masked to -inf outside the
batch's union (tests' own mask, from the union computed here): the log-softmax over the full vocabulary then equals
the one over the union's columns, so every path must give its hypotheses: the native search (fp32 and int8), the
torch search, fairseq's generator through the plugin's decoder (the fallback), the CUDA-like torch search with padded
columns and graphs traced. A shortlist of every token gives exactly the full vocabulary's hypotheses and scores; the
restricted projection's blocks equal the selected rows packed on their own; prefix tokens outside the list are added;
hub.load takes the option; bad values are errors naming the option and the file."""
import contextlib
import os
import shutil

import numpy as np
import pytest
import torch
from cli_support import run, synthetic_data, train_generate_model
from conftest import PLUGIN_DIR
from fairseq.data import Dictionary
from fairseq.sequence_generator import SequenceGenerator
from helpers import FP32_STATE, build_model, cpp_extension, make_dictionary, random_batch
from test_static_generator import assert_same_hypotheses

from rfa_fairseq import shortlist
from rfa_fairseq.generation import StaticBeamSearchGenerator, forced_tokens_reach_shortlists, static_beam_search
from rfa_fairseq.modules.decoding import DecodingState

VOCABULARY_WORDS = 200  # + fairseq's 4 specials: a union of a batch is a fraction of it
N_SENTENCES = 6
K_CANDIDATES, N_FREQUENT = 2, 4


def shortlist_model(flags=(), seed=1):
    """A tiny default model (fp32 state: the native step's results the torch step's) over a 204-token dictionary,
    whose EOS logit depends strongly on the decoder's output (sentences end at different steps)."""
    model, d = build_model([*FP32_STATE, "--rfa-num-features", "6", *flags], seed=seed,
                           dictionary=make_dictionary(VOCABULARY_WORDS))
    model.eval()
    with torch.no_grad():
        W = model.decoder.output_projection.weight
        W[d.eos()] = 0.7 * torch.randn(W.size(1), generator=torch.Generator().manual_seed(0))
    return model, d


def shortlist_table(d, k=K_CANDIDATES, n=N_FREQUENT, seed=0, every_token=False):
    """A random shortlist for dictionary d (source and target): k candidates per source token, n frequent tokens; with
    every_token, the frequent tokens are every non-special token (the union is the whole vocabulary)."""
    rng = np.random.default_rng(seed)
    V = len(d)
    candidates = np.full((V, k), -1, dtype=np.int32)
    for s in range(d.nspecial, V):
        candidates[s] = rng.choice(np.arange(d.nspecial, V), size=k, replace=False)
    frequent = (np.arange(d.nspecial, V) if every_token
                else rng.choice(np.arange(d.nspecial, V), size=n, replace=False)).astype(np.int32)
    header = {"format": shortlist.FORMAT_NAME, "version": shortlist.FORMAT_VERSION,
              "source_dictionary": shortlist._dictionary_record(d), "target_dictionary": shortlist._dictionary_record(d),
              "k": k, "n": len(frequent), "alignment": {"model": "test"}, "data": {}}
    return shortlist.ShortlistTable(header=header, candidates=candidates,
                                    probabilities=np.ones((V, k), dtype=np.float32), frequent=frequent)


def shortlist_file(tmp_path, d, name="shortlist.npz", **table_options):
    path = tmp_path / name
    shortlist.save(str(path), shortlist_table(d, **table_options))
    return str(path)


def sample_of(d, bsz=N_SENTENCES, src_len=9, seed=1):
    src, src_lengths, _ = random_batch(d, bsz=bsz, src_len=src_len, seed=seed)
    return {"net_input": {"src_tokens": src, "src_lengths": src_lengths}, "id": torch.arange(bsz)}


@contextlib.contextmanager
def decoding(model, **options):
    """The model's RFA decoding options set for the block (one RFAConfig: the encoder reads it too), then restored."""
    rfa = model.decoder.rfa
    saved = {name: getattr(rfa, name) for name in options}
    for name, value in options.items():
        setattr(rfa, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(rfa, name, value)


def reference(model, d, sample, union, prefix_tokens=None, **generation):
    """SequenceGenerator's hypotheses over the full vocabulary with every logit outside `union` at -inf."""
    decoder = model.decoder
    forward = decoder.forward
    outside = torch.ones(len(d), dtype=torch.bool)
    outside[union] = False

    def masked(*args, **kwargs):
        logits, extra = forward(*args, **kwargs)
        return logits.masked_fill(outside, float("-inf")), extra

    with torch.no_grad(), decoding(model, rfa_shortlist=""):
        decoder.forward = masked
        try:
            return SequenceGenerator([model], d, **generation).generate([model], sample, prefix_tokens=prefix_tokens)
        finally:
            del decoder.forward


def static_search(model, d, sample, prefix_tokens=None, parts=1, **generation):
    with torch.no_grad():
        generator = StaticBeamSearchGenerator(model, d, parts=parts, **generation)
        return generator.generate([model], sample, prefix_tokens=prefix_tokens)


def fairseq_fallback(model, d, sample, prefix_tokens=None, **generation):
    """fairseq's generator on the plugin's decoder with the shortlist (its decoder returns the union's logits at
    -inf elsewhere), the prefix reaching the union as build_generator's fallback hands it over."""
    with torch.no_grad():
        generator = SequenceGenerator([model], d, **generation)
        forced_tokens_reach_shortlists(generator, [model])
        return generator.generate([model], sample, prefix_tokens=prefix_tokens)


def assert_inside(hypotheses, union):
    allowed = set(union.tolist())
    for sentence, hypos in enumerate(hypotheses):
        for h in hypos:
            assert set(h["tokens"].tolist()) <= allowed, f"sentence {sentence}: a token outside the union"


GENERATION = {"beam_size": 4, "max_len_b": 12}
OPTIONS = [
    pytest.param({}, id="defaults"),
    pytest.param({"min_len": 5, "len_penalty": 0.6}, id="min_len_lenpen"),
    pytest.param({"unk_penalty": -3.0}, id="unkpen"),  # <unk> raised: its column's mask matters
    pytest.param({"no_repeat_ngram_size": 2}, id="no_repeat_ngram2"),
]


@pytest.mark.parametrize("options", OPTIONS)
def test_every_path_gives_the_masked_reference_hypotheses(options, tmp_path):
    """The native search, the torch search and fairseq's generator through the plugin's decoder, all with the
    shortlist, give the hypotheses and scores of fairseq's generator over the full vocabulary with -inf outside the
    batch's union; every token of them is in the union, and the shortlist changed some hypothesis."""
    cpp_extension()
    model, d = shortlist_model()
    sample = sample_of(d)
    path = shortlist_file(tmp_path, d)
    union = shortlist.Shortlist.load(path, d, d).union(sample["net_input"]["src_tokens"])
    assert union.numel() < len(d) // 2, f"the test needs a restrictive union: {union.numel()} of {len(d)}"
    generation = {**GENERATION, **options}
    want = reference(model, d, sample, union, **generation)
    with torch.no_grad():
        full = static_search(model, d, sample, **generation)
    with decoding(model, rfa_shortlist=path), torch.no_grad():
        native = static_search(model, d, sample, **generation)
        assert model.decoder.decoding_runtime().program is not None
        fallback = fairseq_fallback(model, d, sample, **generation)
        with decoding(model, rfa_decode_kernel="torch"):
            torch_search = static_search(model, d, sample, **generation)
            assert model.decoder.decoding_runtime().program is None
    for got in (native, torch_search, fallback):
        assert_same_hypotheses(want, got)
    assert_inside(native, union)
    assert any(a[0]["tokens"].tolist() != b[0]["tokens"].tolist() for a, b in zip(full, native)), \
        "the shortlist changed no hypothesis: the test's union does not restrict"


def test_int8_with_the_shortlist_equals_fairseqs_generator_on_the_same_steps(tmp_path):
    """--rfa-decode-precision int8: the native search over the union's int8 rows gives the hypotheses of fairseq's
    generator on the same int8 steps with -inf outside the union."""
    cpp_extension()
    model, d = shortlist_model()
    sample = sample_of(d)
    path = shortlist_file(tmp_path, d)
    union = shortlist.Shortlist.load(path, d, d).union(sample["net_input"]["src_tokens"])
    with decoding(model, rfa_decode_precision="int8"), torch.no_grad():
        want = reference(model, d, sample, union, **GENERATION)
        with decoding(model, rfa_shortlist=path):
            got = static_search(model, d, sample, **GENERATION)
            assert model.decoder.decoding_runtime().kernels.gemm.startswith("int8")
    assert_same_hypotheses(want, got)
    assert_inside(got, union)


@pytest.mark.parametrize("path_name", ["native", "native_int8", "torch"])
def test_a_shortlist_of_every_token_gives_exactly_the_full_vocabulary_hypotheses(path_name, tmp_path):
    """A union of every token: the restricted projection is the whole one, column c token c, so hypotheses, scores
    and positional scores equal the full vocabulary's to the bit (the mapping's strong check), with the masks of the
    options (minimum length, unk penalty, n-grams) and prefix tokens."""
    cpp_extension()
    model, d = shortlist_model()
    sample = sample_of(d)
    path = shortlist_file(tmp_path, d, every_token=True)
    assert shortlist.Shortlist.load(path, d, d).union(sample["net_input"]["src_tokens"]).numel() == len(d)
    prefix = torch.randint(d.nspecial, len(d), (N_SENTENCES, 2), generator=torch.Generator().manual_seed(4))
    options = {"rfa_decode_precision": "int8"} if path_name == "native_int8" else {}
    if path_name == "torch":
        options["rfa_decode_kernel"] = "torch"
    generation = {**GENERATION, "min_len": 3, "unk_penalty": -1.0, "no_repeat_ngram_size": 3}
    with decoding(model, **options):
        for prefix_tokens in (None, prefix):
            want = static_search(model, d, sample, prefix_tokens=prefix_tokens, **generation)
            with decoding(model, rfa_shortlist=path):
                got = static_search(model, d, sample, prefix_tokens=prefix_tokens, **generation)
            for w, g in zip(want, got):
                assert [h["tokens"].tolist() for h in w] == [h["tokens"].tolist() for h in g]
                for hw, hg in zip(w, g):
                    assert torch.equal(hw["score"], hg["score"])
                    assert torch.equal(hw["positional_scores"], hg["positional_scores"])


def test_prefix_tokens_outside_the_list_are_added_in_every_path(tmp_path):
    """Prefix tokens that no candidate list holds: the union adds them (never dropped), every hypothesis starts with
    its prefix at a finite score, and the paths agree with the masked reference over the union with the prefix."""
    cpp_extension()
    model, d = shortlist_model()
    sample = sample_of(d)
    path = shortlist_file(tmp_path, d)
    loaded = shortlist.Shortlist.load(path, d, d)
    union = loaded.union(sample["net_input"]["src_tokens"])
    outside = torch.tensor([t for t in range(d.nspecial, len(d)) if t not in set(union.tolist())])
    prefix = outside[torch.randperm(outside.numel(), generator=torch.Generator().manual_seed(5))[: 2 * N_SENTENCES]]
    prefix = prefix.view(N_SENTENCES, 2).clone()
    prefix[1, 1] = d.pad()  # a shorter prefix
    with_prefix = loaded.union(sample["net_input"]["src_tokens"], prefix)
    assert with_prefix.numel() > union.numel()
    want = reference(model, d, sample, with_prefix, prefix_tokens=prefix, **GENERATION)
    with decoding(model, rfa_shortlist=path):
        results = {"native": static_search(model, d, sample, prefix_tokens=prefix, **GENERATION),
                   "fallback": fairseq_fallback(model, d, sample, prefix_tokens=prefix, **GENERATION)}
        with decoding(model, rfa_decode_kernel="torch"):
            results["torch"] = static_search(model, d, sample, prefix_tokens=prefix, **GENERATION)
    for name, got in results.items():
        assert_same_hypotheses(want, got)
        for n, hypos in enumerate(got):
            forced = [t for t in prefix[n].tolist() if t != d.pad()]
            for h in hypos:
                assert h["tokens"][: len(forced)].tolist() == forced, name
                assert torch.isfinite(h["score"]), name


def test_a_batch_split_into_parts_decodes_over_the_whole_batchs_union(tmp_path):
    """--rfa-decode-parts 2: each part of one batch decodes over the whole batch's union, so its hypotheses are those
    of the batch decoded in one part."""
    cpp_extension()
    model, d = shortlist_model()
    sample = sample_of(d, bsz=8)
    path = shortlist_file(tmp_path, d)
    with decoding(model, rfa_shortlist=path):
        whole = static_search(model, d, sample, parts=1, **GENERATION)
        split = static_search(model, d, sample, parts=2, **GENERATION)
    assert_same_hypotheses(whole, split)


def test_the_cuda_like_search_pads_the_columns_and_replays_its_graphs(tmp_path, monkeypatch):
    """The torch search as CUDA runs it (K/V and the output columns padded to buckets, the finished flags read a step
    late, the plain steps captured as graphs and replayed: TracingGraphs asserts each replay dispatches its capture's
    operations on the same buffers), batch after batch of other unions: the eager torch search's hypotheses."""
    from test_search_graphs import TracingGraphs

    model, d = shortlist_model(["--rfa-decode-kernel", "torch"])
    path = shortlist_file(tmp_path, d)
    samples = [sample_of(d, bsz=bsz, src_len=src_len, seed=seed) for bsz, src_len, seed in ((6, 9, 1), (6, 11, 2),
                                                                                          (3, 5, 3))]
    with decoding(model, rfa_shortlist=path):
        eager = [static_search(model, d, sample, **GENERATION) for sample in samples]
        monkeypatch.setattr(StaticBeamSearchGenerator, "LAGGED_READS_ON", ("cpu",))
        monkeypatch.setattr(StaticBeamSearchGenerator, "BUCKETED_ON", ("cpu",))
        monkeypatch.setattr(StaticBeamSearchGenerator, "GRAPHS_ON", ("cpu",))
        monkeypatch.setattr(static_beam_search, "StepGraphs", TracingGraphs)
        monkeypatch.setattr(static_beam_search, "SOURCE_BUCKET", 8)
        monkeypatch.setattr(static_beam_search, "OUTPUT_BUCKET", 16)
        with torch.no_grad():
            generator = StaticBeamSearchGenerator(model, d, cuda_graphs=True, **GENERATION)
            generator.graphs = generator.graphs or TracingGraphs()
            lane = generator.lanes[0]
            generator.graphs.written = lambda: (list(lane.buffers.buffers.values()) + lane.state.attention_tensors()
                                                + list(lane.state.buffers.inputs.values()) + list(lane.host_flags))
            generator.graphs.persistent = lambda: generator.graphs.written() + list(model.parameters())
            graphed = [generator.generate([model], sample) for sample in samples]
            columns = lane.state.output.columns
    assert columns % 16 == 0 and columns > lane.state.output.size, "the columns were not padded"
    assert generator.graphs.replays > 0
    for want, got in zip(eager, graphed):
        assert_same_hypotheses(want, got)


@torch.no_grad()
def test_the_restricted_projection_is_the_selected_rows_packed_on_their_own():
    """LinearLibrary.select_outputs: the fp32 blocks, int8 codes, code sums and scales of ids are those of the rows
    W[ids] packed on their own, and their products equal the whole layer's columns at ids (to the bit), at few rows
    and many."""
    ext = cpp_extension()
    g = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(203, 48, generator=g), torch.randn(203, generator=g)
    ids = torch.tensor([0, 1, 2, 3, 17, 18, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 99, 150, 202])
    for precision in ("fp32", "int8"):
        library = ext.LinearLibrary(precision)
        packed = native_packed(library, precision, weight, bias)
        blocks, sub_bias, scales, sums = library.select_outputs(packed, ids)
        own = native_packed(library, precision, weight[ids].contiguous(), bias[ids])
        assert torch.equal(blocks, own.weight) and torch.equal(sub_bias, own.bias)
        if precision == "int8":
            assert torch.equal(scales, own.w_scales) and torch.equal(sums, own.w_sums)
        sub = type(packed)(blocks, sub_bias, 48, ids.numel(), w_scales=scales, w_sums=sums)
        for rows in (1, 4, 37):
            x = torch.randn(rows, 48, generator=g)
            assert torch.equal(library.linear(sub, x), library.linear(packed, x)[:, ids])


def native_packed(library, precision, weight, bias):
    from rfa_fairseq.ops.step import PackedLinear

    if precision == "fp32":
        return PackedLinear(library.pack_fp32(weight), bias.clone(), weight.size(1), weight.size(0))
    blocks, sums, scales = library.pack_int8(weight)
    return PackedLinear(blocks, bias.clone(), weight.size(1), weight.size(0), w_scales=scales, w_sums=sums)


def test_without_the_option_nothing_is_restricted(tmp_path):
    """No --rfa-shortlist: no union, no batch projection, the native search's record has no vocabulary."""
    cpp_extension()
    model, d = shortlist_model()
    recorded = []
    original = static_beam_search.NativeSearchRecord.of

    def spy(search):
        record = original(search)
        recorded.append((search.state.output, record.vocabulary))
        return record

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(static_beam_search.NativeSearchRecord, "of", staticmethod(spy))
        static_search(model, d, sample_of(d), **GENERATION)
    assert model.decoder.shortlist() is None
    assert recorded and all(output is None and vocabulary is None for output, vocabulary in recorded)


@torch.no_grad()
def test_the_native_search_refuses_a_vocabulary_without_a_prefix_token(tmp_path):
    """The native search checks its vocabulary: a prefix token outside it is an error, not a dropped token."""
    cpp_extension()
    model, d = shortlist_model()
    runtime = model.decoder.decoding_runtime()
    generator = StaticBeamSearchGenerator(model, d, **GENERATION)
    src, src_lengths, _ = random_batch(d, bsz=2, src_len=5, seed=2)
    key, pad = model.decoder.encoder_keys(model.encoder(src, src_lengths=src_lengths))
    lane = static_beam_search.Lane()
    state = lane.state.start(runtime, 2 * 4, 4, key, pad, state_buffers=1)  # as the native search starts it
    state.restrict_output(torch.tensor([0, 1, 2, 3, 10, 11, 12]))
    prefix = torch.tensor([[10], [50]])
    search = static_beam_search._Search(generator, lane, state, 8, d.eos(), torch.device("cpu"), lagged=False,
                                       prefix_tokens=prefix)
    with pytest.raises(RuntimeError, match="prefix token 50 is not in search.vocabulary"):
        runtime.program.search_steps(state.native_batch(), search.native, 0, state.batch.parity, True, 8, 8)


# ---------------------------------------------------------------- options, hub.load, errors


def test_bad_option_values_are_errors_naming_the_option_and_the_file(tmp_path):
    cpp_extension()
    model, d = shortlist_model()
    missing = str(tmp_path / "nowhere.npz")
    other = shortlist_file(tmp_path, make_dictionary(30), name="other.npz")
    path = shortlist_file(tmp_path, d)
    with pytest.raises(shortlist.ShortlistError, match=r"--rfa-shortlist .*nowhere\.npz: file not found"):
        build_model([*FP32_STATE, "--rfa-shortlist", missing], dictionary=make_dictionary(VOCABULARY_WORDS))
    with pytest.raises(shortlist.ShortlistError, match=r"--rfa-shortlist .*other\.npz: built for another source "
                                                       r"dictionary \(34 symbols, the model's has 204\)"):
        build_model(["--rfa-shortlist", other], dictionary=make_dictionary(VOCABULARY_WORDS))
    with pytest.raises(shortlist.ShortlistError, match=r"rfa_shortlist_k=9.*asked for K=9, N=4, but the file holds "
                                                       r"K=2, N=4"):
        build_model(["--rfa-shortlist", path, "--rfa-shortlist-k", "9"], dictionary=make_dictionary(VOCABULARY_WORDS))
    with pytest.raises(ValueError, match="--rfa-shortlist-k must be an integer >= 1"):
        build_model(["--rfa-shortlist", path, "--rfa-shortlist-k", "0"], dictionary=make_dictionary(VOCABULARY_WORDS))
    with pytest.raises(ValueError, match="--rfa-shortlist-n=2 is given without --rfa-shortlist"):
        build_model(["--rfa-shortlist-n", "2"], dictionary=make_dictionary(VOCABULARY_WORDS))
    # set on a built model (as --model-overrides does before building, or a test here): refused at the next batch
    with decoding(model, rfa_shortlist=missing), pytest.raises(shortlist.ShortlistError, match="nowhere.npz"):
        static_search(model, d, sample_of(d), **GENERATION)
    with decoding(model, rfa_shortlist=path, rfa_shortlist_k=2, rfa_shortlist_n=0):
        loaded = model.decoder.shortlist()
        assert (loaded.k, loaded.n) == (2, 0) and loaded is model.decoder.shortlist()  # read once


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The synthetic corpus, a tiny model trained on it, and its shortlist built by rfa-build-shortlist."""
    data = synthetic_data(tmp_path_factory)
    checkpoint = train_generate_model(data, tmp_path_factory.mktemp("shortlist_model"), 60)
    bin_dir = tmp_path_factory.mktemp("shortlist_bin") / "bin"
    shutil.copytree(data / "bin", bin_dir)
    run("rfa-build-shortlist", bin_dir, "--k", "4", "--n", "6", "--quiet")
    return data, bin_dir, checkpoint, str(bin_dir / "shortlist.src-tgt.npz")


@pytest.mark.slow
def test_hub_load_and_fairseq_generate_take_the_option(trained):
    """hub.load(..., rfa_shortlist=PATH) and fairseq-generate --model-overrides "{'rfa_shortlist': PATH}" decode over
    each batch's union (the decoder's shortlist is the file's); their hypotheses lie inside the sources' union. A
    missing file is refused by hub.load, naming the option and the file."""
    from rfa_fairseq import hub

    data, bin_dir, checkpoint, path = trained
    sentences = (data / "raw" / "test.src").read_text().splitlines()[:12]
    translator = hub.load(checkpoint, bin_dir, sentencepiece_model=None, batch_size=4, rfa_shortlist=path)
    model = translator.models[0]
    assert model.decoder.shortlist() is not None and model.decoder.shortlist().path == path
    restricted = []
    original = DecodingState.restrict_output

    def spy(self, vocabulary, bucket=1):
        restricted.append(vocabulary)
        return original(self, vocabulary, bucket)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(DecodingState, "restrict_output", spy)
        outputs = translator.translate(sentences, beam=4)
    batches = [v for v in restricted if v is not None]
    assert len(batches) >= 3, restricted  # a union per batch of 4 sentences
    source = Dictionary.load(str(bin_dir / "dict.src.txt"))
    target = Dictionary.load(str(bin_dir / "dict.tgt.txt"))
    # every batch's union lies inside the union of all the sentences' tokens
    everything = model.decoder.shortlist().union(torch.tensor([source.index(w) for s in sentences for w in s.split()]))
    for output in outputs:
        assert {target.index(w) for w in output.split()} <= set(everything.tolist()), output
    # fairseq-generate: the native search and the torch search (fp32 states: the same steps up to the last bits of
    # the scores) give the same hypotheses, inside the sources' union
    generated = {}
    for kernel in ("auto", "torch"):
        proc = run("fairseq-generate", bin_dir, "--user-dir", PLUGIN_DIR, "--path", checkpoint, "--beam", "4",
                   "--batch-size", "8", "--cpu", "--model-overrides",
                   repr({"rfa_shortlist": path, "rfa_decode_kernel": kernel, "rfa_decode_state": "fp32"}))
        lines = [line.split("\t") for line in proc.stdout.splitlines() if line.startswith(("S-", "H-"))]
        generated[kernel] = sorted((fields[0], fields[-1]) for fields in lines)  # (S-/H-id, the tokens)
    assert generated["auto"] == generated["torch"]
    sources = [text for name, text in generated["auto"] if name.startswith("S-")]
    hypotheses = [text for name, text in generated["auto"] if name.startswith("H-")]
    assert len(hypotheses) == len(sources) == 40
    all_sources = model.decoder.shortlist().union(torch.tensor([source.index(w) for s in sources for w in s.split()]))
    for hypothesis in hypotheses:
        assert {target.index(w) for w in hypothesis.split()} <= set(all_sources.tolist()), hypothesis
    with pytest.raises(shortlist.ShortlistError, match=r"--rfa-shortlist .*nowhere\.npz: file not found"):
        hub.load(checkpoint, bin_dir, sentencepiece_model=None, rfa_shortlist=os.path.join(bin_dir, "nowhere.npz"))


@pytest.mark.slow
def test_the_profile_takes_the_shortlist_and_a_forced_length(trained, tmp_path):
    """benchmarks/profile_generate.py --shortlist FILE --forced-length L decodes over the batches' unions with every
    hypothesis L tokens long: each batch takes L steps and EOS's, its rows name the shortlist and the length, and a
    second run at another length keeps the first's rows."""
    import csv
    import sys

    _, bin_dir, checkpoint, path = trained
    prep = tmp_path / "prep"
    prep.mkdir()
    (prep / "data-bin").symlink_to(bin_dir)
    csv_path = tmp_path / "profile.csv"
    script = os.path.join(os.path.dirname(PLUGIN_DIR), "benchmarks", "profile_generate.py")
    for length in (5, 7):
        run(sys.executable, script, "--prep", prep, "--path", checkpoint, "--batch-sizes", "8", "--threads", "1",
            "--shortlist", path, "--forced-length", str(length), "--csv", csv_path)
    with open(csv_path) as f:
        rows = list(csv.DictReader(f))
    sentences = 40
    batches = -(-sentences // 8)
    for length in (5, 7):
        at = {row["part"]: row for row in rows if row["forced_length"] == str(length)}
        assert {row["shortlist"] for row in at.values()} == {os.path.basename(path)}
        assert int(at["rfa total"]["calls"]) == batches * (length + 1), at["rfa total"]  # L tokens, then EOS
        assert int(at["decoder: output projection"]["calls"]) > 0
