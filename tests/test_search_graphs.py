"""The static beam search's whole step as a CUDA graph (generation/static_beam_search.py), checked on the CPU.

A CUDA graph replays the kernels its capture recorded, on the addresses it recorded, and runs no Python: a step
is safe to capture when every replay would dispatch the same operations on the same buffers, whatever the step
number, the batch or the search's progress. The stand-in (`TracingGraphs`) records at capture every operation the
step dispatches, with what it reads and writes (the generator's and the model's persistent buffers by address,
offset, shape and strides; temporaries by shape; Python values by value), leaves every buffer as it was (a
capture runs nothing), and asserts at each replay that the step dispatches exactly that again; a value read back
to the host inside a step (`.item()`, `bool()`) fails at once, as it would fail a capture. The searches run with
what CUDA gets (K/V padded to the source bucket, the finished flags read one step late), and must give exactly
the eager step's hypotheses, batch after batch through one generator (graphs kept across batches), and
SequenceGenerator's. tests/test_cuda.py replays real graphs on a GPU.
"""
import pytest
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from fairseq.sequence_generator import SequenceGenerator
from helpers import build_model, random_batch
from test_static_generator import assert_same_hypotheses

from rfa_fairseq.generation import StaticBeamSearchGenerator, static_beam_search
from rfa_fairseq.modules.decoding import StepGraphs

# the default model's maps and softmax cross-attention, on the torch kernels (those CUDA runs; a dispatch mode
# sees their operations, not the C++ kernels')
FLAGS = ["--rfa-feature-map", "hedgehog", "--rfa-gate", "--rfa-softmax-cross-attn", "--rfa-decode-kernel", "torch"]


class _Recorder(TorchDispatchMode):
    def __init__(self, persistent_storages):
        super().__init__()
        self.persistent, self.ops = persistent_storages, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default:
            raise AssertionError("a step read a value back to the host: a CUDA graph cannot capture it")
        out = func(*args, **kwargs)
        self.ops.append((str(func), tuple(self._describe(x) for x in pytree.tree_leaves((args, kwargs)))))
        return out

    def _describe(self, x):
        if isinstance(x, torch.Tensor):
            ptr = x.untyped_storage().data_ptr()
            if ptr in self.persistent:
                return ("buffer", ptr, x.storage_offset(), tuple(x.shape), x.stride(), x.dtype)
            return ("temporary", tuple(x.shape), x.dtype)
        return x


class TracingGraphs(StepGraphs):
    """StepGraphs on the CPU, its own graph backend: a capture records the step's dispatched operations (and changes
    nothing), a replay runs the step at hand (of this batch, at this step) for real, which must dispatch the same
    operations on the same buffers."""

    persistent = staticmethod(lambda: [])  # -> the tensors whose addresses a graph may capture (set by the test)
    written = staticmethod(lambda: [])  # -> those of them a step may write (restored after a capture)

    def __init__(self, backend=None):
        super().__init__(backend=self)
        self.captures = self.replays = 0

    def reset(self) -> None:
        pass

    def run(self, key, shape, step):
        self.current = step  # what this step would dispatch (a real replay runs the capture's kernels instead)
        return super().run(key, shape, step)

    def _trace(self, step):
        storages = {t.untyped_storage().data_ptr() for t in self.persistent()}
        recorder = _Recorder(storages)
        with recorder:
            step()
        return recorder.ops

    def capture(self, step):
        saved = [(t, t.clone()) for t in self.written()]
        trace = self._trace(step)
        for tensor, copy in saved:  # a capture records without running
            tensor.copy_(copy)
        self.captures += 1
        return (step, trace), ()

    def replay(self, graph, outputs) -> None:
        _, captured = graph
        self.replays += 1
        assert self._trace(self.current) == captured, "a replay dispatched other operations or buffers than its capture"


@pytest.fixture
def cuda_like_search(monkeypatch):
    """Static beam searches on the CPU as on CUDA: bucketed K/V, lagged flag reads, and (cuda_graphs=True) graphs
    traced by TracingGraphs."""
    monkeypatch.setattr(StaticBeamSearchGenerator, "LAGGED_READS_ON", ("cpu",))
    monkeypatch.setattr(StaticBeamSearchGenerator, "BUCKETED_ON", ("cpu",))
    monkeypatch.setattr(StaticBeamSearchGenerator, "GRAPHS_ON", ("cpu",))
    monkeypatch.setattr(static_beam_search, "StepGraphs", TracingGraphs)
    monkeypatch.setattr(static_beam_search, "SOURCE_BUCKET", 8)

    def make(model, d, graphs: bool, **options):
        generator = StaticBeamSearchGenerator(model, d, cuda_graphs=graphs, **{"max_len_b": 14, **options})
        # what a captured step may read at fixed addresses: the generator's buffers, the model's parameters
        generator.graphs = generator.graphs or (TracingGraphs() if graphs else None)
        if graphs:
            lane = generator.lanes[0]  # a CUDA batch is never split
            generator.graphs.written = lambda: (
                list(lane.buffers.buffers.values()) + lane.state.attention_tensors() + list(lane.host_flags))
            generator.graphs.persistent = lambda: generator.graphs.written() + list(model.parameters())
        return generator

    return make


@pytest.fixture(scope="module")
def model_and_batches():
    """A tiny default model whose EOS logit depends strongly on the decoder's output (sentences end at many
    different steps: the batch halves), and three batches of other sizes and source lengths."""
    model, d = build_model(FLAGS, seed=3)
    model.eval()
    with torch.no_grad():
        W = model.decoder.output_projection.weight
        W[d.eos()] = 0.7 * torch.randn(W.size(1), generator=torch.Generator().manual_seed(0))
    batches = []
    for bsz, src_len, seed in ((8, 9, 1), (8, 13, 2), (3, 5, 3)):
        src, src_lengths, _ = random_batch(d, bsz=bsz, src_len=src_len, seed=seed)
        batches.append({"net_input": {"src_tokens": src, "src_lengths": src_lengths}, "id": torch.arange(bsz)})
    return model, d, batches


def _hypotheses(generator, model, sample):
    with torch.no_grad():
        hyps = generator.generate([model], sample)
    return [[(h["tokens"].tolist(), h["positional_scores"].tolist(), float(h["score"])) for h in sent] for sent in hyps]


@pytest.mark.parametrize("options", [{"beam_size": 4}, {"beam_size": 3, "len_penalty": 0.6, "min_len": 3},
                                     {"beam_size": 1}])
def test_whole_step_replays_give_the_eager_steps_hypotheses_batch_after_batch(options, model_and_batches,
                                                                              cuda_like_search):
    model, d, batches = model_and_batches
    graphed, eager = cuda_like_search(model, d, True, **options), cuda_like_search(model, d, False, **options)
    for sample in batches:
        want = _hypotheses(eager, model, sample)
        captures_before = graphed.graphs.captures
        assert _hypotheses(graphed, model, sample) == want
        print(f"batch of {sample['id'].numel()}: captures {graphed.graphs.captures - captures_before}, "
              f"replays {graphed.graphs.replays}")
    lengths = {len(tokens) for sample in batches for sent in _hypotheses(eager, model, sample) for tokens, _, _ in sent}
    assert len(lengths) > 2  # sentences finished at different steps: the batches halved
    assert graphed.graphs.replays > 3 * graphed.graphs.captures


def test_graphs_are_kept_across_batches_of_the_same_shape(model_and_batches, cuda_like_search):
    """A second batch of the same sentences and source bucket replays the first one's graphs: no capture."""
    model, d, batches = model_and_batches
    generator = cuda_like_search(model, d, True, beam_size=4)
    first = _hypotheses(generator, model, batches[0])
    captures = generator.graphs.captures
    assert captures >= 2  # two buffer parities at least
    assert _hypotheses(generator, model, batches[0]) == first
    assert generator.graphs.captures == captures


def test_bucketed_lagged_search_equals_sequence_generator(model_and_batches, cuda_like_search):
    """Padded K/V (masked) and flags read one step late change no hypothesis: SequenceGenerator's."""
    model, d, batches = model_and_batches
    generator = cuda_like_search(model, d, True, beam_size=4)
    for sample in batches:
        want = SequenceGenerator([model], d, beam_size=4, max_len_b=14).generate([model], sample)
        with torch.no_grad():
            got = generator.generate([model], sample)
        assert_same_hypotheses(want, got)


def test_a_host_read_inside_the_step_fails_the_stand_in(model_and_batches, cuda_like_search, monkeypatch):
    """The stand-in catches what a real capture refuses: here a step that asks the host whether anything ended."""
    model, d, batches = model_and_batches
    generator = cuda_like_search(model, d, True, beam_size=4)
    finalize = static_beam_search._Search.finalize

    def reads_back(self, eos_mask, *args):
        bool(eos_mask.any())
        return finalize(self, eos_mask, *args)

    monkeypatch.setattr(static_beam_search._Search, "finalize", reads_back)
    with pytest.raises(AssertionError, match="read a value back to the host"):
        _hypotheses(generator, model, batches[0])


def test_batches_halve_to_the_same_sizes_and_replay_the_first_batches_graphs(model_and_batches, cuda_like_search):
    """With graphs a batch halves to ceil(N / 2^j) places of its largest batch's N (finished sentences fill the rest),
    so batches that finish differently run the same shapes: captures stay within two per size, however many batches,
    and hypotheses stay the eager search's (which keeps only the unfinished sentences)."""
    model, d, _ = model_and_batches
    graphed, eager = cuda_like_search(model, d, True, beam_size=3), cuda_like_search(model, d, False, beam_size=3)
    shapes, captures = set(), []
    for seed in range(5):
        src, src_lengths, _ = random_batch(d, bsz=8, src_len=7, seed=10 + seed)  # one source bucket
        sample = {"net_input": {"src_tokens": src, "src_lengths": src_lengths}, "id": torch.arange(8)}
        before = graphed.graphs.captures
        assert _hypotheses(graphed, model, sample) == _hypotheses(eager, model, sample)
        captures.append(graphed.graphs.captures - before)
        shapes |= {key[0] for key in graphed.graphs.graphs}
    print(f"captures per batch {captures}, places {sorted(shapes)}")
    assert shapes <= {8, 4, 2, 1} and len(shapes) > 1  # the batches halved, to the ladder's sizes only
    assert sum(captures) <= 2 * len(shapes)  # each size captured once per state parity, whatever the batch
