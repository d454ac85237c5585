"""The decoding step as CUDA graphs (modules.decoding.StepGraphs), checked on the CPU with a stand-in graph backend.

A CUDA graph replays the kernels it captured on the addresses it captured: it sees no Python. The stand-in
(`RerunBackend`, in place of CUDAGraphBackend) runs the captured step again at each replay and writes its outputs
where the captured ones are, and it records the addresses every causal step reads and writes that outlive the step
(state in, beam order, state out): a replay whose addresses differ from its capture's is what a real graph would get
wrong (a stale beam order, the wrong state buffer), and fails here. Beam search with the stand-in must give
exactly the eager step's hypotheses and scores. tests/test_cuda.py replays real graphs on a GPU.
"""
import pytest
import torch
from fairseq.sequence_generator import SequenceGenerator
from helpers import build_model, random_batch
from test_model import assert_beam_reorder_equals_decoding_the_reordered_batch

import rfa_fairseq.models.rfa_transformer as rfa_transformer
from rfa_fairseq.modules.decoding import CUDAGraphBackend, StepGraphs, step_graphs_for
from rfa_fairseq.ops.step import TorchKernels

# the default model's maps, its softmax cross-attention; the torch kernels are the ones CUDA runs
FLAGS = ["--rfa-feature-map", "hedgehog", "--rfa-gate", "--rfa-softmax-cross-attn", "--rfa-decode-kernel", "torch"]


class RerunBackend:
    """A graph backend on the CPU: a 'graph' is the step itself plus the addresses its causal steps used."""

    recording = None  # the address list of the capture or replay running now

    def __init__(self):
        self.captures = self.replays = 0

    def reset(self) -> None:
        pass

    def capture(self, step):
        RerunBackend.recording = addresses = []
        outputs = step()
        RerunBackend.recording = None
        self.captures += 1
        return (step, addresses), outputs

    def replay(self, graph, outputs) -> None:
        step, captured = graph
        RerunBackend.recording = addresses = []
        fresh = step()
        RerunBackend.recording = None
        self.replays += 1
        assert addresses == captured, "a replay read or wrote other buffers than its capture"
        for out, new in zip(outputs, fresh):
            if out is not None and out.data_ptr() != new.data_ptr():
                out.copy_(new)  # a graph writes its outputs where the capture put them


@pytest.fixture
def rerun_graphs(monkeypatch):
    """Every batch decodes through StepGraphs on a RerunBackend; -> the list of their backends."""
    made = []

    def factory(device, enabled):
        made.append(RerunBackend())
        return StepGraphs(made[-1])

    monkeypatch.setattr(rfa_transformer, "step_graphs_for", factory)
    original = TorchKernels.causal_layer_step

    def recorded(phi_q, phi_k, v, gate_logits, key_pad, state_in, order, state_out, *args, **kwargs):
        if RerunBackend.recording is not None:
            RerunBackend.recording.append(tuple(None if t is None else t.data_ptr() for t in (state_in, order, state_out)))
        return original(phi_q, phi_k, v, gate_logits, key_pad, state_in, order, state_out, *args, **kwargs)

    monkeypatch.setattr(TorchKernels, "causal_layer_step", staticmethod(recorded))
    return made


def _hypotheses(generator, model, sample):
    with torch.no_grad():
        hyps = generator.generate([model], sample)
    return [[(h["tokens"].tolist(), h["positional_scores"].tolist()) for h in sent] for sent in hyps]


def test_graph_replays_give_the_eager_steps_hypotheses(rerun_graphs, monkeypatch):
    """fairseq's SequenceGenerator (what the static beam search does not serve), beam 3 over 6 sentences that finish
    at different steps (the batch shrinks: new shapes, graphs captured again): hypotheses and per-token scores
    identical to the eager step's, and most steps are replays. The static beam search captures its whole step
    instead: tests/test_search_graphs.py."""
    model, d = build_model(FLAGS, seed=3)
    model.eval()
    src, src_lengths, _ = random_batch(d, bsz=6, src_len=7, seed=11)
    sample = {"net_input": {"src_tokens": src, "src_lengths": src_lengths}}

    def make():
        return SequenceGenerator([model], d, beam_size=3, max_len_b=12)

    with monkeypatch.context() as eager:
        eager.setattr(rfa_transformer, "step_graphs_for", lambda device, enabled: None)
        want = _hypotheses(make(), model, sample)
    rerun_graphs.clear()
    got = _hypotheses(make(), model, sample)
    assert got == want
    graphs = rerun_graphs[-1]  # the last batch's backend
    lengths = sorted({len(tokens) for sent in want for tokens, _ in sent})
    print(f"hypothesis lengths {lengths}; captures {graphs.captures}, replays {graphs.replays}")
    assert len(lengths) > 1  # sentences finished at different steps
    assert graphs.captures >= 2 and graphs.replays > graphs.captures


def test_two_graphs_per_shape_one_per_state_buffer(rerun_graphs, monkeypatch):
    """Greedy steps without reorders (identity order): step 1 eager (fills the buffers), step 2 eager (the
    shape's first), then one capture per state buffer, and replays only: the logits equal the eager run's."""
    model, d = build_model(FLAGS, seed=5)
    model.eval()
    src, src_lengths, prev = random_batch(d, bsz=2, src_len=6, tgt_len=9, seed=2)

    def decode():
        state, out = {}, []
        with torch.no_grad():
            encoder_out = model.encoder(src, src_lengths=src_lengths)
            for t in range(prev.size(1)):
                logits, _ = model.decoder(prev[:, : t + 1], encoder_out=encoder_out, incremental_state=state)
                out.append(logits[:, -1].clone())
        return torch.stack(out, 1)

    captured = []
    original_run = StepGraphs.run
    monkeypatch.setattr(StepGraphs, "run", lambda self, key, *a: captured.append(key) or original_run(self, key, *a))
    graphed = decode()
    graphs = rerun_graphs[-1]
    assert (graphs.captures, graphs.replays) == (2, prev.size(1) - 2)
    assert len({key[-1] for key in captured}) == 2  # the two state buffers
    rerun_graphs.clear()
    monkeypatch.setattr(rfa_transformer, "step_graphs_for", lambda device, enabled: None)
    torch.testing.assert_close(graphed, decode(), rtol=0, atol=0)


def test_graphs_only_on_cuda_and_when_enabled():
    assert step_graphs_for("cpu", True) is None
    assert step_graphs_for("cuda", False) is None
    graphs = step_graphs_for("cuda", True)  # made without touching the device
    assert type(graphs) is StepGraphs and type(graphs.backend) is CUDAGraphBackend


def test_no_rfa_cuda_graphs_reaches_the_decoder(monkeypatch):
    """--no-rfa-cuda-graphs (a model override at decoding) is what the decoder asks graphs for."""
    asked = []
    monkeypatch.setattr(rfa_transformer, "step_graphs_for", lambda device, enabled: asked.append(enabled))
    for flag in ("--rfa-cuda-graphs", "--no-rfa-cuda-graphs"):
        model, d = build_model(FLAGS + [flag], seed=5)
        model.eval()
        src, src_lengths, prev = random_batch(d, bsz=2, src_len=6, tgt_len=2, seed=2)
        with torch.no_grad():
            model.decoder(prev[:, :1], encoder_out=model.encoder(src, src_lengths=src_lengths), incremental_state={})
    assert asked == [True, False]


def test_replayed_logits_stay_as_handed_out_and_reorders_apply_inside_the_graph(rerun_graphs):
    """Decode 4 steps, reorder (permute / duplicate / shrink), decode on with replays, every step's logits kept
    by the caller: the logits of decoding the reordered batch from scratch (a replay rewrites its graph's
    buffers, never logits a caller still holds)."""
    model, d = build_model(FLAGS, seed=3)
    model.eval()
    batch = random_batch(d, bsz=4, src_len=8, tgt_len=9, seed=3)
    orders = [torch.tensor(order) for order in ([2, 0, 3, 1], [3, 3, 0, 1], [2, 0])]
    assert_beam_reorder_equals_decoding_the_reordered_batch(model, batch, orders, tolerance=1e-5)
    assert sum(g.replays for g in rerun_graphs) > 0
