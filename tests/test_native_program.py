"""The native decoding program at its boundary with Python (cpu/csrc/decode_program.cpp, native_search.cpp): it is
built from the decoding records by name, the native search from its one declared record (a field missing or unknown
refused as the search is made, named), every tensor it takes a pointer of is checked before the GIL is released (a
wrong one is a Python error naming it, never a crash), its profile regions do not nest, and the rows a batch's state
accounts for are the ones it reads, also after a reorder that breaks the beam layout."""
import dataclasses
import types

import pytest
import torch
from helpers import build_model, random_batch, use_decoding_step
from torch.profiler import ProfilerActivity, profile

from rfa_fairseq.generation import StaticBeamSearchGenerator, static_beam_search
from rfa_fairseq.modules.decoding import DecodingState

FLAGS = ["--rfa-feature-map", "hedgehog", "--rfa-gate", "--rfa-softmax-cross-attn"]
N, K = 3, 2  # sentences, beam


@pytest.fixture(scope="module")
def native():
    """A tiny default model on the native step, a batch state of N sentences x K beams after its first step, and a
    static search's buffers for it."""
    model, d = build_model(FLAGS, seed=3)
    model.eval()
    src, src_lengths, _ = random_batch(d, bsz=N, src_len=7, seed=1)
    with torch.no_grad():
        runtime = model.decoder.decoding_runtime()
        if runtime.program is None:
            pytest.skip("the native step is not available here (no C++ build): its boundary is not reached")
        key, pad = model.decoder.encoder_keys(model.encoder(src, src_lengths=src_lengths))
        generator = StaticBeamSearchGenerator(model, d, beam_size=K, max_len_b=10)
        lane = generator.lanes[0]
        state = lane.state.start(runtime, N * K, K, key, pad)
        search = static_beam_search._Search(generator, lane, state, 12, d.eos(), torch.device("cpu"), lagged=False)
    return model, d, runtime, state, search


def _decode(runtime, state, **changes):
    """program.decode of a second step (rows through the order) with `changes` to its arguments."""
    R = N * K
    args = dict(batch=state.native_batch(), tokens=torch.full((R,), 4, dtype=torch.long), positions=None,
                order=torch.arange(R), read=0, first=False, padded_inputs=False, weights=None, beam=K)
    args.update(changes)
    with torch.no_grad():
        return runtime.program.decode(**args)


def test_a_well_formed_step_runs(native):
    _, d, runtime, state, _ = native
    assert _decode(runtime, state).shape == (N * K, len(d))


@pytest.mark.parametrize("change,named", [
    (dict(tokens=torch.full((N * K,), 4.0)), "tokens"),
    (dict(tokens=torch.full((N * K,), 10 ** 6, dtype=torch.long)), "tokens[0]"),
    (dict(order=torch.arange(N * K - 1)), "order"),
    (dict(order=torch.full((N * K,), 99, dtype=torch.long)), "order[0]"),
    (dict(order=torch.arange(N * K, dtype=torch.int32)), "order"),
    (dict(positions=torch.zeros(N * K, 5)), "positions"),
    (dict(weights=torch.zeros(N * K - 1, 7)), "weights"),
    (dict(read=2), "read"),
    (dict(beam=0), "beam"),
])
def test_wrong_arguments_raise_errors_naming_them(native, change, named):
    _, _, runtime, state, _ = native
    with pytest.raises(RuntimeError, match=named.replace("[", r"\[").replace("]", r"\]")):
        _decode(runtime, state, **change)


@pytest.mark.parametrize("field,wrong,named", [
    ("states", lambda t: t.double(), r"state.layers\[0\].self_attn.states\[0\] is Double"),
    ("states", lambda t: t.float(), r"state.layers\[0\].self_attn.states\[1\] is Half, not Float"),  # both alike
    ("states", lambda t: t[:1], r"state.layers\[0\].self_attn.states\[0\] has shape"),
    ("states", lambda t: t.transpose(2, 3).contiguous().transpose(2, 3), r"states\[0\] is not contiguous"),
    ("key", lambda t: t[..., :-1], r"state.layers\[0\].cross.key has shape"),
    ("key", lambda t: t[:1], r"state.layers\[0\].cross.key has shape"),
    ("value", lambda t: t.half(), r"state.layers\[0\].cross.value is Half"),
    ("key_bias", lambda t: t[:, :-1], r"state.layers\[0\].cross.key_bias has shape"),
])
def test_wrong_cache_tensors_raise_errors_naming_them(native, field, wrong, named):
    _, _, runtime, state, _ = native
    layer = state.layers[0]
    owner, name = (layer.self_attn, "states") if field == "states" else (layer.cross, field)
    kept = getattr(owner, name)
    try:
        setattr(owner, name, [wrong(kept[0]), kept[1]] if field == "states" else wrong(kept))
        state._native = None  # the native view is made again from the caches
        with pytest.raises(RuntimeError, match=named):
            _decode(runtime, state)
    finally:
        setattr(owner, name, kept)
        state._native = None


@pytest.mark.parametrize("field,wrong,named", [
    ("finished", lambda t: t.long(), "search.finished is Long"),
    ("fin_count", lambda t: t[:-1], "search.fin_count has shape"),
    ("fin_count", lambda t: t + 7, r"search.fin_count\[0\] = 7"),
    ("cands_to_ignore", lambda t: t.t(), "search.cands_to_ignore has shape"),
    ("cand_scores", lambda t: t[:1], "search.cand_scores has shape"),
    ("fin_steps", lambda t: t.float(), "search.fin_steps is Float"),
    ("eos_bias", lambda t: t[:0], "search.eos_bias has shape"),
    ("step", lambda t: t.view(1, 1), "search.step has shape"),
    ("order", lambda t: t[: N * K - 1], "search.order has shape"),
])
def test_wrong_search_buffers_raise_errors_naming_them(native, field, wrong, named):
    _, _, runtime, state, search = native
    record = static_beam_search.NativeSearchRecord.of(search)
    wrong_search = runtime.kernels.ext.NativeSearch(dataclasses.replace(record, **{field: wrong(getattr(record, field))}))
    with pytest.raises(RuntimeError, match=named):
        runtime.program.search_step(state.native_batch(), wrong_search, 0, 0, True, False)


def test_a_step_past_the_token_buffer_is_an_error(native):
    _, _, runtime, state, search = native
    L = search.views.token_pair[0].size(1)  # max_len + 2
    with pytest.raises(RuntimeError, match=f"step {L - 1} of a token buffer of length {L}"):
        runtime.program.search_step(state.native_batch(), search.native, L - 1, 0, True, False)


def test_the_native_search_reads_exactly_its_declared_record(native):
    """The search's record is declared once: the Python record has exactly the fields the native search declares, and
    a record with one missing (a field renamed on either side) or one more is refused as the search is made, the
    error naming the field."""
    _, _, runtime, _, search = native
    NativeSearch = runtime.kernels.ext.NativeSearch
    record = static_beam_search.NativeSearchRecord.of(search)
    fields = [f.name for f in dataclasses.fields(record)]
    assert fields == NativeSearch.fields()
    assert search.native is not None  # made with the search
    for name in fields:
        missing = types.SimpleNamespace(**{f: getattr(record, f) for f in fields if f != name})
        with pytest.raises(RuntimeError, match=f"the search record has no field '{name}'"):
            NativeSearch(missing)
    renamed = types.SimpleNamespace(**{("beams" if f == "beam" else f): getattr(record, f) for f in fields})
    with pytest.raises(RuntimeError, match="the search record has a field 'beams' that the native search does not"):
        NativeSearch(renamed)
    with pytest.raises(RuntimeError, match=r"search record\.order is None, a tensor is needed"):
        NativeSearch(dataclasses.replace(record, order=None))


def test_the_program_is_built_from_the_records_by_name_and_read_only(native):
    """A record without a field the program reads is an error naming where; nothing of the program is writable."""
    model, _, runtime, _, _ = native
    ext = runtime.kernels.ext
    record = runtime.layers[0].self_attn
    gated = record.gated
    try:
        del record.gated
        with pytest.raises(RuntimeError, match=r"runtime.layers\[0\].self_attn has no field 'gated'"):
            ext.DecodeProgram(runtime, runtime.kernels.library)
    finally:
        record.gated = gated
    with pytest.raises(AttributeError):
        runtime.program.layers = []


def test_profile_regions_of_the_step_do_not_nest(native):
    """Each part of the step's profile (RECORD_FUNCTION rfa::*) is exclusive: no region holds another, so their times
    add up (benchmarks/profile_generate.py sums them)."""
    _, _, runtime, state, _ = native
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _decode(runtime, state)
    regions = [e for e in prof.events() if e.name.startswith("rfa::")]
    names = {e.name for e in regions}
    assert {"rfa::linear", "rfa::causal_attention", "rfa::cross_attention", "rfa::layer_norm",
            "rfa::output_projection", "rfa::embedding"} <= names
    for outer in regions:
        inside = [inner.name for inner in regions if inner is not outer and inner.thread == outer.thread
                  and outer.time_range.start <= inner.time_range.start and inner.time_range.end <= outer.time_range.end]
        assert not inside, f"{outer.name} holds {inside}"


@pytest.mark.parametrize("path", ["fused", "torch"])
@pytest.mark.parametrize("beam", [2, 4])
def test_a_reorder_that_breaks_the_beam_layout_reads_each_rows_own_sentence(path, beam, monkeypatch):
    """Rows n * beam + b of sentence n (K/V kept once per sentence), then a reorder to as many rows as there were
    sentences, each from another sentence's beams (the layout broken, the count unchanged): the steps after it equal
    decoding those rows' sentences from scratch, on the native step and on the torch step."""
    use_decoding_step(path, monkeypatch)
    model, d = build_model(FLAGS, seed=5)
    model.eval()
    sentences, k = 4, 3
    src, src_lengths, prev = random_batch(d, bsz=sentences, src_len=7, tgt_len=6, seed=2)
    rows = torch.arange(sentences).repeat_interleave(beam)  # fairseq's expansion to beams
    src, src_lengths, prev = src[rows], src_lengths[rows], prev[rows]
    new_order = torch.tensor([1, 2 * beam + 1, beam, 3 * beam])  # 4 rows, of sentences 0, 2, 1, 3: no beam groups
    model.set_beam_size(beam)
    with torch.no_grad():
        encoder_out = model.encoder(src, src_lengths=src_lengths)
        incremental_state = {}
        for t in range(k):
            model.decoder(prev[:, : t + 1], encoder_out=encoder_out, incremental_state=incremental_state)
        state = incremental_state[DecodingState.KEY]
        assert (state.beam, state.sentences) == (beam, sentences)
        assert state.kernels.name == ("cpp" if path == "fused" else "torch")
        model.decoder.reorder_incremental_state_scripting(incremental_state, new_order)
        assert state.rows == sentences and state.beam == 1
        reordered_out = model.encoder.reorder_encoder_out(encoder_out, new_order)
        continued = torch.cat([model.decoder(prev[new_order][:, : t + 1], encoder_out=reordered_out,
                                             incremental_state=incremental_state)[0] for t in range(k, prev.size(1))], 1)
        model.set_beam_size(1)
        fresh = model.encoder(src[new_order], src_lengths=src_lengths[new_order])
        scratch_state = {}
        scratch = torch.cat([model.decoder(prev[new_order][:, : t + 1], encoder_out=fresh,
                                           incremental_state=scratch_state)[0] for t in range(prev.size(1))], 1)[:, k:]
    torch.testing.assert_close(continued, scratch, rtol=1e-5, atol=1e-5)


def test_the_runtime_follows_its_weights_and_only_them():
    """decoding_runtime() keeps its runtime while the decoder's tensors are the same, unmodified (the tensors are listed
    once, WeightsWatch), and builds another after an in-place update, after `.to()` moves a weight's storage, and
    after an assignment replaces a parameter (which a cached list alone would miss)."""
    model, _ = build_model(FLAGS, seed=4)
    model.eval()
    with torch.no_grad():
        first = model.decoder.decoding_runtime()
        assert model.decoder.decoding_runtime() is first
        model.decoder.layers[0].fc1.weight.mul_(1.0)  # in place: the version moves
        second = model.decoder.decoding_runtime()
        assert second is not first and model.decoder.decoding_runtime() is second
        fc2 = model.decoder.layers[-1].fc2
        fc2.weight = torch.nn.Parameter(fc2.weight.detach().clone())
        third = model.decoder.decoding_runtime()
        assert third is not second and model.decoder.decoding_runtime() is third
        model.decoder.embed_tokens.weight.data = model.decoder.embed_tokens.weight.data.clone()  # new storage
        assert model.decoder.decoding_runtime() is not third
