"""The static beam search (rfa_fairseq/generation/) against fairseq's SequenceGenerator: the same hypotheses
and scores for every option it serves, fairseq's generator (and a log line naming why) for the others, and
fairseq-generate's H-/P- lines identical with either generator."""
import argparse
import csv
import logging
import os
import sys
import threading
import types

import pytest
import torch
from cli_support import run, synthetic_data, train_generate_model
from conftest import PLUGIN_DIR, REPO
from fairseq.sequence_generator import SequenceGenerator
from fairseq.tasks import FairseqTask
from helpers import build_model, random_batch

from rfa_fairseq.generation import StaticBeamSearchGenerator, static_beam_search


@pytest.fixture(scope="module")
def model_and_batch():
    """A tiny model whose EOS logit depends strongly on the decoder's output, so that the batch's sentences
    end at very different steps (an untrained model's EOS is as likely as any token: nothing would end)."""
    model, d = build_model([])
    model.eval()
    with torch.no_grad():
        W = model.decoder.output_projection.weight
        W[d.eos()] = 0.7 * torch.randn(W.size(1), generator=torch.Generator().manual_seed(0))
    src, src_lengths, prev = random_batch(d, bsz=8, src_len=9, tgt_len=7, seed=1)
    sample = {"net_input": {"src_tokens": src, "src_lengths": src_lengths}, "id": torch.arange(8)}
    return model, d, sample, prev


class TokensSoFar(torch.nn.Module):
    """fairseq's NGramRepeatBlock handed the tokens so far (as its CUDA kernel reads them): SequenceGenerator hands it
    the whole token buffer, whose last columns its CPU fallback takes for a hypothesis' last tokens (padding), so on
    the CPU it blocks nothing; the static beam search blocks the repeats."""

    def __init__(self, blocker):
        super().__init__()
        self.blocker = blocker

    def forward(self, tokens, lprobs, bsz: int, beam_size: int, step: int):
        return self.blocker(tokens[:, : step + 1], lprobs, bsz, beam_size, step)


def sequence_generator(model, d, **options) -> SequenceGenerator:
    """fairseq's generator, the reference, with its n-gram blocker reading the tokens so far (TokensSoFar)."""
    generator = SequenceGenerator([model], d, **options)
    if generator.repeat_ngram_blocker is not None:
        generator.repeat_ngram_blocker = TokensSoFar(generator.repeat_ngram_blocker)
    return generator


def _generate_both(model, d, sample, prefix_tokens=None, **options):
    options = {"max_len_b": 20, **options}
    want = sequence_generator(model, d, **options).generate([model], sample, prefix_tokens=prefix_tokens)
    got = StaticBeamSearchGenerator(model, d, **options).generate([model], sample, prefix_tokens=prefix_tokens)
    return want, got


def assert_same_hypotheses(want, got):
    assert len(want) == len(got)
    for sentence, (w, g) in enumerate(zip(want, got)):
        assert [h["tokens"].tolist() for h in w] == [h["tokens"].tolist() for h in g], f"sentence {sentence}"
        for hw, hg in zip(w, g):
            assert abs(float(hw["score"]) - float(hg["score"])) <= 1e-4
            torch.testing.assert_close(hg["positional_scores"], hw["positional_scores"], rtol=0, atol=1e-4)


OPTIONS = [
    pytest.param({}, id="defaults"),
    pytest.param({"len_penalty": 0.6}, id="lenpen0.6"),
    pytest.param({"len_penalty": 1.5}, id="lenpen1.5"),
    pytest.param({"min_len": 6}, id="min_len"),
    pytest.param({"max_len_a": 1.2, "max_len_b": 3}, id="max_len_a_b"),
    pytest.param({"max_len": 8}, id="max_len"),
    pytest.param({"unk_penalty": -3.0}, id="unkpen"),
    pytest.param({"no_repeat_ngram_size": 2}, id="no_repeat_ngram2"),
    pytest.param({"normalize_scores": False}, id="unnormalized"),
]


@pytest.mark.parametrize("beam", [1, 4, 5])
@pytest.mark.parametrize("options", OPTIONS)
def test_static_generator_equals_sequence_generator(model_and_batch, beam, options):
    model, d, sample, _ = model_and_batch
    want, got = _generate_both(model, d, sample, beam_size=beam, **options)
    assert_same_hypotheses(want, got)
    if beam > 1 and not options:
        lengths = {len(sentence[0]["tokens"]) for sentence in want}
        assert min(lengths) <= 3 and max(lengths) >= 15, f"sentences should end at very different steps: {lengths}"
    if "unk_penalty" in options:  # a negative penalty makes <unk> win somewhere: the option is exercised
        assert any(d.unk() in h["tokens"].tolist() for sentence in got for h in sentence)


@pytest.mark.parametrize("beam", [1, 4])
@pytest.mark.parametrize("prefix_size", [1, 3])
def test_static_generator_equals_sequence_generator_with_prefix_tokens(model_and_batch, beam, prefix_size):
    model, d, sample, prev = model_and_batch
    prefix = prev[:, 1: 1 + prefix_size].clone()
    prefix[0, 1:] = d.pad()  # a shorter target: its prefix is padded
    if prefix_size > 1:
        prefix[1, 1] = d.eos()  # a target that ends inside the prefix: its first beam is copied to every beam
    want, got = _generate_both(model, d, sample, prefix_tokens=prefix, beam_size=beam)
    assert_same_hypotheses(want, got)
    for sentence, hypos in enumerate(got):
        if sentence not in (0, 1):
            assert hypos[0]["tokens"][:prefix_size].tolist() == prefix[sentence].tolist()


@pytest.mark.parametrize("kernel", ["auto", "torch"])
@pytest.mark.parametrize("beam", [4, 5])  # (at beam 1 too few sentences of this batch end early)
def test_the_batch_halves_when_half_its_sentences_have_finished(model_and_batch, beam, kernel, monkeypatch):
    """With the torch step the batch halves (and the decoder's rows follow: the next step reads each kept row's state
    through the pending order) when half its sentences have finished; the native step, which decodes only the places
    still translating, keeps its places to the end. The hypotheses stay SequenceGenerator's with either step."""
    model, d, sample, _ = model_and_batch
    monkeypatch.setattr(model.decoder.rfa, "rfa_decode_kernel", kernel)
    sizes = []
    keep_sentences = static_beam_search._Search.keep_sentences

    def recorded(self, state, kept):
        sizes.append((self.rows.sentences, kept.numel()))
        return keep_sentences(self, state, kept)

    monkeypatch.setattr(static_beam_search._Search, "keep_sentences", recorded)
    want, got = _generate_both(model, d, sample, beam_size=beam)
    assert_same_hypotheses(want, got)
    with torch.no_grad():
        native = model.decoder.decoding_runtime().program is not None
    assert len({len(sentence[0]["tokens"]) for sentence in got}) >= 3, "the sentences must end at different steps"
    if native:
        assert sizes == [], sizes
    else:
        assert sizes and sizes[0][0] == 8 and all(2 * kept <= places for places, kept in sizes), sizes


@pytest.mark.parametrize("parts", [2, 3])
@pytest.mark.parametrize("kernel", ["auto", "torch"])
def test_a_batch_split_into_parts_decoded_at_once_gives_the_hypotheses_of_one_part(model_and_batch, parts, kernel,
                                                                                   monkeypatch):
    """--rfa-decode-parts N: the batch's sentences dealt out to N parts, each searched on its own thread (the native
    step: the CPU in fp32; the torch step runs one part); the hypotheses of one part, in the batch's order."""
    model, d, sample, _ = model_and_batch
    monkeypatch.setattr(model.decoder.rfa, "rfa_decode_kernel", kernel)
    threads = []
    search = StaticBeamSearchGenerator._search

    def recorded(self, lane, *args):
        threads.append((threading.current_thread().name, lane, torch.get_num_threads(), torch.is_grad_enabled()))
        return search(self, lane, *args)

    monkeypatch.setattr(StaticBeamSearchGenerator, "_search", recorded)
    caller_threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the process's teams: a part's thread limits its own to one thread
    try:
        with torch.no_grad():
            one_part = StaticBeamSearchGenerator(model, d, beam_size=4, max_len_b=20, parts=1)
            in_parts = StaticBeamSearchGenerator(model, d, beam_size=4, max_len_b=20, parts=parts)
            one = one_part.generate([model], sample)
            threads.clear()
            split = in_parts.generate([model], sample)
        teams_after = torch.get_num_threads()
    finally:
        torch.set_num_threads(caller_threads)
    assert_same_hypotheses(one, split)
    if kernel == "auto":  # the native step: parts on the generator's worker threads, one lane each
        assert len(threads) == parts and all(name.startswith("rfa-decode-part") for name, *_ in threads)
        assert {id(lane) for _, lane, *_ in threads} <= {id(lane) for lane in in_parts.part_lanes}  # the parts' own
        assert len(in_parts.part_lanes) == parts  # one per thread
        assert all(teams == 1 and not grad for *_, teams, grad in threads), threads  # set up once per thread
        assert teams_after == 2  # the caller's teams stay
    else:
        assert len(threads) == 1



def test_a_generator_warms_up_only_weights_no_generator_prepared(monkeypatch):
    """Building the generator runs one warm-up step (the weights packed before the first batch), unless an earlier
    generator of the same model did it for the same weights (hub.translate builds a generator per call); a changed
    weight warms up again. The hypotheses do not depend on it."""
    model, d = build_model([], seed=5)
    model.eval()
    src, src_lengths, _ = random_batch(d, bsz=3, src_len=6, seed=2)
    sample = {"net_input": {"src_tokens": src, "src_lengths": src_lengths}}
    warm_ups = []
    generate = StaticBeamSearchGenerator.generate

    def counted(self, models, sample, *args, max_steps=None, **kwargs):
        warm_ups.extend([max_steps] if max_steps is not None else [])
        return generate(self, models, sample, *args, max_steps=max_steps, **kwargs)

    monkeypatch.setattr(StaticBeamSearchGenerator, "generate", counted)
    trims = []  # the freed heap is given back after each warm-up, and only then
    monkeypatch.setattr(static_beam_search, "return_freed_memory", lambda: trims.append(len(warm_ups)))
    with torch.no_grad():
        first = StaticBeamSearchGenerator(model, d, beam_size=2, max_len_b=8)
        assert warm_ups == [1] and trims == [1]
        second = StaticBeamSearchGenerator(model, d, beam_size=2, max_len_b=8)
        assert warm_ups == [1] and trims == [1]
        assert_same_hypotheses(first.generate([model], sample), second.generate([model], sample))
        model.decoder.layers[0].fc1.weight.mul_(1.0)  # in place: the runtime is built again, and warmed up
        StaticBeamSearchGenerator(model, d, beam_size=2, max_len_b=8)
        assert warm_ups == [1, 1] and trims == [1, 2]


def resident_mb() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) / 1024


def test_return_freed_memory_gives_the_freed_heap_back():
    """Memory freed in the middle of the heap (the C library keeps it for later allocations) leaves the process's
    resident memory when return_freed_memory runs (glibc's malloc_trim)."""
    import ctypes

    if not os.path.exists("/proc/self/status") or getattr(ctypes.CDLL(None), "malloc_trim", None) is None:
        pytest.skip("no glibc malloc_trim or no /proc here: return_freed_memory does nothing")
    blocks = [torch.ones(8192) for _ in range(3000)]  # 32 KB each, below glibc's mmap threshold: on the heap
    kept = torch.ones(8192)  # allocated after them: the freed blocks are not the heap's top, which glibc trims itself
    held = resident_mb()
    del blocks
    static_beam_search.return_freed_memory()
    assert resident_mb() < held - 60, (held, resident_mb())
    del kept

def test_parts_per_batch():
    """Auto: one part per thread while each part keeps MIN_PART_SENTENCES sentences; --rfa-decode-parts overrides
    (at most one part per sentence)."""
    least = static_beam_search.MIN_PART_SENTENCES
    assert static_beam_search.parts_for(32, 1, 0) == 1
    assert static_beam_search.parts_for(32, 2, 0) == (2 if 32 >= 2 * least else 1)
    assert static_beam_search.parts_for(2 * least - 1, 2, 0) == 1
    assert static_beam_search.parts_for(1000, 4, 0) == 4
    assert static_beam_search.parts_for(32, 2, 1) == 1
    assert static_beam_search.parts_for(32, 1, 3) == 3
    assert static_beam_search.parts_for(2, 4, 3) == 2


def test_the_decode_parts_option_reaches_the_generator(model_and_batch, monkeypatch):
    model, d, _, _ = model_and_batch
    monkeypatch.setattr(model.decoder.rfa, "rfa_decode_parts", 3)
    assert _build([model], d).parts == 3


def test_static_generator_returns_sequence_generators_entries(model_and_batch):
    model, d, sample, _ = model_and_batch
    want, got = _generate_both(model, d, sample, beam_size=4)
    for w, g in zip(want, got):
        assert len(w) == len(g) == 4
        for hw, hg in zip(w, g):
            assert set(hg) == set(hw) == {"tokens", "score", "attention", "alignment", "positional_scores"}
            assert hg["tokens"].dtype == hw["tokens"].dtype and hg["score"].dtype == hw["score"].dtype


# ---------------------------------------------------------------- which generator build_generator gives


def _build(models, d, **options):
    task = types.SimpleNamespace(target_dictionary=d)  # build_generator reads only the target dictionary
    return FairseqTask.build_generator(task, models, argparse.Namespace(beam=4, **options))


@pytest.mark.parametrize("options", [{}, {"lenpen": 0.6, "unkpen": 1.0, "min_len": 2, "max_len_a": 1.5, "max_len_b": 3,
                                         "no_repeat_ngram_size": 2, "prefix_size": 1, "nbest": 4}])
def test_plain_beam_search_gets_the_static_generator_with_its_options(model_and_batch, options, caplog):
    """fairseq-generate's options reach the static search: its hypotheses are those of fairseq's own generator built
    from the same options (FairseqTask.build_generator without the plugin's wrapper)."""
    model, d, sample, _ = model_and_batch
    with caplog.at_level(logging.INFO, logger="rfa_fairseq.generation"):
        generator = _build([model], d, **options)
    assert isinstance(generator, StaticBeamSearchGenerator)
    assert "static beam search generator" in caplog.text
    task = types.SimpleNamespace(target_dictionary=d)
    fairseqs = FairseqTask.build_generator.__wrapped__(task, [model], argparse.Namespace(beam=4, **options))
    assert isinstance(fairseqs, SequenceGenerator)
    if fairseqs.repeat_ngram_blocker is not None:
        fairseqs.repeat_ngram_blocker = TokensSoFar(fairseqs.repeat_ngram_blocker)
    with torch.no_grad():
        assert_same_hypotheses(fairseqs.generate([model], sample), generator.generate([model], sample))


@pytest.mark.parametrize("options,reason", [
    ({"sampling": True}, "--sampling True"),
    ({"diverse_beam_groups": 2}, "--diverse-beam-groups 2"),
    ({"print_alignment": "hard"}, "--print-alignment hard"),
    ({"match_source_len": True}, "--match-source-len True"),
    ({"constraints": "ordered"}, "--constraints ordered"),
    ({"retain_dropout": True}, "--retain-dropout True"),
    ({"temperature": 0.5}, "--temperature 0.5"),
    ({"iter_decode_max_iter": 3}, "--iter-decode-max-iter 3"),
])
def test_other_options_fall_back_with_a_log_line(model_and_batch, options, reason, caplog):
    model, d, _, _ = model_and_batch
    with caplog.at_level(logging.INFO, logger="rfa_fairseq.generation"):
        generator = _build([model], d, **options)
    assert not isinstance(generator, StaticBeamSearchGenerator)
    assert f"fairseq's generator, not the static beam search: {reason}" in caplog.text


def test_an_ensemble_falls_back_with_a_log_line(model_and_batch, caplog):
    model, d, _, _ = model_and_batch
    with caplog.at_level(logging.INFO, logger="rfa_fairseq.generation"):
        generator = _build([model, model], d)
    assert type(generator) is SequenceGenerator
    assert "not the static beam search: an ensemble of 2 models" in caplog.text


def test_no_rfa_static_beam_search_gives_sequence_generator(caplog):
    model, d = build_model(["--no-rfa-static-beam-search"])
    model.eval()
    with caplog.at_level(logging.INFO, logger="rfa_fairseq.generation"):
        assert type(_build([model], d)) is SequenceGenerator
    assert "not the static beam search: --no-rfa-static-beam-search" in caplog.text


# ---------------------------------------------------------------- fairseq-generate

@pytest.mark.slow
def test_fairseq_generate_at_two_threads_two_batches_at_once_print_one_at_a_times_lines(tmp_path_factory):
    """fairseq-generate at 2 threads (OMP_NUM_THREADS), batches of 16 sentences: two at once (--rfa-decode-parts 2),
    each on a thread of its own, print the same H-/P- lines as one at a time on both threads (--rfa-decode-parts 1)."""
    data = synthetic_data(tmp_path_factory)
    checkpoint = train_generate_model(data, tmp_path_factory.mktemp("static_generator_parts"), max_update=30)
    outputs = {}
    for parts in (2, 1):
        proc = run("fairseq-generate", data / "bin", "--user-dir", PLUGIN_DIR, "--path", checkpoint, "--gen-subset", "test",
                   "--batch-size", "16", "--max-len-b", "25", "--required-batch-size-multiple", "1", "--cpu", "--beam", "4",
                   "--model-overrides", f"{{'rfa_decode_parts': {parts}}}", OMP_NUM_THREADS="2")
        outputs[parts] = [line for line in proc.stdout.splitlines() if line[:2] in ("H-", "P-")]
        assert sum(line.startswith("H-") for line in outputs[parts]) == 40
        at_once = "2 batches decoded at once" in proc.stdout + proc.stderr
        assert at_once == (parts == 2), f"rfa_decode_parts {parts}: the log says two batches at once: {at_once}"
    assert outputs[2] == outputs[1]


@pytest.mark.slow
def test_fairseq_generate_prints_the_same_lines_with_either_generator(tmp_path_factory):
    data = synthetic_data(tmp_path_factory)
    checkpoint = train_generate_model(data, tmp_path_factory.mktemp("static_generator_generate"), max_update=30)
    for options in (["--beam", "1"], ["--beam", "5", "--lenpen", "0.6", "--prefix-size", "1", "--min-len", "2"]):
        outputs = {}
        for name, static in (("static", True), ("fairseq", False)):
            proc = run("fairseq-generate", data / "bin", "--user-dir", PLUGIN_DIR, "--path", checkpoint,
                       "--gen-subset", "test", "--batch-size", "16", "--max-len-b", "25", "--required-batch-size-multiple",
                       "1", "--cpu", *options, "--model-overrides", f"{{'rfa_static_beam_search': {static}}}")
            expected_log = ("static beam search generator" if name == "static"
                            else "not the static beam search: --no-rfa-static-beam-search")
            assert expected_log in proc.stdout + proc.stderr
            assert "rfa_fairseq: decoding step: native (cpp); linear layers: " in proc.stdout + proc.stderr  # the GEMM used
            outputs[name] = [line.split("\t") for line in proc.stdout.splitlines() if line[:2] in ("H-", "P-", "D-")]
            assert sum(fields[0].startswith("H-") for fields in outputs[name]) == 40
        assert len(outputs["static"]) == len(outputs["fairseq"])
        for static, fairseq in zip(outputs["static"], outputs["fairseq"]):
            # the same lines, scores up to fp32 rounding: fairseq's batch shrinks as sentences finish, and
            # a matrix product over fewer rows may round differently
            if static[0].startswith("P-"):  # positional scores, printed with 4 decimals
                diffs = [abs(float(a) - float(b)) for a, b in zip(static[1].split(), fairseq[1].split())]
                assert static[0] == fairseq[0] and len(static[1].split()) == len(fairseq[1].split())
                assert max(diffs) <= 1.5e-4, (static, fairseq)
            else:  # H-/D-: id, score, hypothesis
                assert (static[0], static[2]) == (fairseq[0], fairseq[2]), options
                assert abs(float(static[1]) - float(fairseq[1])) <= 1e-4, (static, fairseq)

    # the step's profile (benchmarks/profile_generate.py) on the same model: every part, a GEMM floor below the
    # step's linear layers' time, parts within the total
    prep = tmp_path_factory.mktemp("profile_prep")
    (prep / "data-bin").symlink_to(data / "bin")
    csv_path = prep / "profile.csv"
    run(sys.executable, os.path.join(REPO, "benchmarks", "profile_generate.py"), "--prep", prep, "--path", checkpoint,
        "--batch-sizes", "8", "--threads", "1", "--csv", csv_path)
    with open(csv_path) as f:
        rows = {row["part"]: row for row in csv.DictReader(f)}
    totals = {"rfa total", "rfa total (profiled pass)", "gemm_floor"}
    parts = {"encoder", "decoder: linear layers", "decoder: output projection", "decoder: causal RFA",
             "decoder: softmax cross-attention", "decoder: layer norm", "decoder: embeddings",
             "search: candidates, finalize, reorder", "other (profiled pass)"}
    assert parts | totals <= set(rows), sorted(rows)
    seconds = {part: float(row["seconds"]) for part, row in rows.items()}
    # the parts are exclusive regions (tests/test_native_program.py): measured apart, they fit in the pass's total
    measured = sum(seconds[p] for p in parts - {"other (profiled pass)"})
    assert 0 < measured <= seconds["rfa total (profiled pass)"], seconds
    assert seconds["other (profiled pass)"] >= 0
    assert all(int(rows[p]["calls"]) > 0 for p in parts - {"other (profiled pass)"}), rows  # every part was seen
    assert 0 < seconds["gemm_floor"] and 0 < seconds["decoder: linear layers"] < seconds["rfa total"]
