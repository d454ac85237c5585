"""A batch's incremental decoding: `IncrementalDecoder`, the one object a beam search drives (start, step,
reorder), and the caches that each layer's attention owns.

Every tensor of an RFA decoding step keeps its shape for the whole batch: the causal state never grows and
the cross-attention reads a source K/V (or an RFA state) fixed per sentence. So at a batch's start each decoder
layer makes its cache (`start_step`: its attentions make theirs) and every later step (`step`) runs in place from
them:

- a causal layer's `CausalCache`: two fp32 state buffers (rows, H, F, d + 1) used in turn: a step reads one
  (through the pending beam order, so a reorder costs no pass of its own) and writes the other;
- a cross-attention's `SentenceCache`: K and V (or the RFA state) once per source sentence, shared by its
  beams; when sentences finish, the kept ones are compacted (rows shrink, nothing grows);
- activations and logits in a workspace that outlives the batch (the decoder keeps it for the next one), so
  steady-state decoding allocates no large tensor; the caches' buffers come from it too;
- the linear layers' weights as the kernels want them (oneDNN's packed layout on the CPU), in the same
  workspace: packed at the first batch and again only when a parameter they derive from changes.

fairseq's incremental_state holds one reference to the batch's IncrementalDecoder and nothing else.

On CUDA the SequenceGenerator path captures a step as a CUDA graph and replays it (`StepGraphs`): its inputs
(the last tokens, their position embeddings and the pending beam order) are copied into fixed buffers first,
so the same kernels run on the same addresses each step with one launch; the beam reorder happens inside the
graph. The static beam search captures its whole step instead (generation/static_beam_search.py), this
object's `compute` inside it.

`follow_rows` is the one account of which rows are copies of which: the decoder's sentences and the
encoder's reorder_encoder_out both follow beam search's reorders with it.
"""
import math
import weakref
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .. import torch_internals


class Workspace:
    """Named flat buffers, grown on demand and reused between steps and batches."""

    def __init__(self):
        self.buffers: Dict[str, Tensor] = {}
        self.packed: Dict[str, tuple] = {}  # name -> (key of the parameters and kernels, packed weight)
        self.kernels = None  # (where, kernels) for a module that picks its kernels once (SoftmaxEncoderLayer)
        # bumped whenever a buffer or a packed weight is (re)allocated: a CUDA graph captured over this workspace
        # is valid while it stays the same (the addresses it captured are still the buffers')
        self.generation = 0

    # a cache: copies and pickles of a model start with an empty one (oneDNN's packed tensors cannot be copied,
    # nor can the kernels' C++ module)
    def __deepcopy__(self, memo):
        return Workspace()

    def __reduce__(self):
        return (Workspace, ())

    def take(self, name: str, shape: Tuple[int, ...], dtype: torch.dtype, device: torch.device,
             returned: bool = False) -> Tensor:
        """A (shape) view of buffer `name`. returned=True for what a step hands to its caller (logits,
        log-probabilities): two buffers are used in turn (beam search still holds the last step's
        log-probabilities while it asks for the next), and one that a caller still views is never
        overwritten: a new buffer replaces it."""
        numel = math.prod(shape)
        names = (name + ".0", name + ".1") if returned else (name,)
        target = names[0]  # where a new buffer goes when none can be used
        for key in names:
            buf = self.buffers.get(key)
            if returned and buf is not None and _viewed_elsewhere(buf):
                continue
            if buf is not None and buf.numel() >= numel and buf.dtype == dtype and buf.device == device:
                return buf[:numel].view(shape)
            target = key
            break
        buf = self.buffers[target] = torch.empty(max(numel, 1), dtype=dtype, device=device)
        self.generation += 1
        return buf[:numel].view(shape)

    def tensors(self) -> List[Tensor]:
        return list(self.buffers.values())

    def packed_linear(self, name: str, kernels, sources: Sequence[Tensor],
                      build: Callable[[], Tuple[Tensor, Optional[Tensor]]]):
        """kernels.pack_linear(*build()) for the linear layer `name`, reused while the kernels and every
        parameter in `sources` (what build reads) stay the same tensors, unmodified (an in-place update bumps their
        version, and the layer is packed again; updates through `.data` do not: see forget_packed)."""
        key = (kernels.name, kernels.gemm, tuple((id(t), t.data_ptr(), torch_internals.tensor_version(t)) for t in sources))
        cached = self.packed.get(name)
        if cached is None or cached[0] != key:
            with torch.no_grad():
                cached = self.packed[name] = (key, kernels.pack_linear(*build()))
            self.generation += 1
        return cached[1]

    def forget_packed(self) -> None:
        """Drop the packed weights (packed again at their next use). For what the key above cannot see: fairseq's
        optimizers update parameters through `.data`, which leaves their version counters alone."""
        self.packed.clear()
        self.generation += 1

    def packed_linears(self, name: str, kernels, linears: Sequence[torch.nn.Linear]):
        """packed_linear of nn.Linear layers that read the same input, as one product (their outputs side
        by side: q, k, v or k, v); their biases all present or all absent."""
        if len(linears) == 1:
            weight, bias = linears[0].weight, linears[0].bias
            return self.packed_linear(name, kernels, [p for p in (weight, bias) if p is not None], lambda: (weight, bias))
        biased = [m.bias is not None for m in linears]
        if any(biased) != all(biased):
            raise ValueError(f"{name}: linear layers packed as one need all or none of their biases")

        def build():
            bias = torch.cat([m.bias for m in linears]) if all(biased) else None
            return torch.cat([m.weight for m in linears]), bias

        return self.packed_linear(name, kernels, [p for m in linears for p in (m.weight, m.bias) if p is not None], build)


class HeldWorkspaces:
    """The workspaces a module handed to callers that keep them across batches (weakly: a generator that is gone
    holds none). A cache, as a workspace is: copies and pickles of a model start with none."""

    def __init__(self):
        self._held = weakref.WeakSet()

    def add(self, workspace: Workspace) -> Workspace:
        self._held.add(workspace)
        return workspace

    def __iter__(self):
        return iter(list(self._held))

    def __deepcopy__(self, memo):
        return HeldWorkspaces()

    def __reduce__(self):
        return (HeldWorkspaces, ())


def _viewed_elsewhere(buf: Tensor) -> bool:
    """Whether any tensor besides `buf` shares its storage (a view handed out and still alive). Without
    the storage's use count (a torch internal), every handed-out buffer counts as still viewed."""
    use_count = torch_internals.storage_use_count(buf)
    return use_count is None or use_count > 1  # buf itself


def follow_rows(source: Tensor, new_order: Tensor) -> Optional[Tensor]:
    """Beam search's reorder of a row -> source map (source[i]: what row i is a copy of): source[new_order],
    or None when it changes nothing (every row keeps a copy of the same source: within-beam reorders)."""
    moved = source.index_select(0, new_order)
    return None if moved.numel() == source.numel() and torch.equal(moved, source) else moved


class CausalCache:
    """A causal RFA layer's cache: its input projection [q | k | v | gate logits] (q_width: H * D or C) and output
    projection packed for the kernels, and two fp32 state buffers (>= rows, H, F, d + 1) used in turn: a step reads
    `states[0]` (through the pending beam order) and writes `states[1]`, and `swap` turns them after it."""

    def __init__(self, proj, q_width: int, out_proj, states: List[Tensor]):
        self.proj, self.q_width, self.out_proj, self.states = proj, q_width, out_proj, states

    def swap(self) -> None:
        self.states.reverse()

    def keep_rows(self, row_sources: Tensor) -> None:
        """Row i' of the state read next becomes row row_sources[i'] of it (in place, from the first row)."""
        self.states[0][: row_sources.numel()].copy_(self.states[0].index_select(0, row_sources))

    def tensors(self, rows: int) -> List[Tensor]:
        return [t[:rows] for t in self.states]


class SentenceCache:
    """A cross-attention's cache: tensors kept once per source sentence (the fields named in SENTENCE_TENSORS,
    shared by the sentence's beams) and its projections packed for the kernels."""

    SENTENCE_TENSORS: Tuple[str, ...] = ()

    def tensors(self) -> List[Tensor]:
        return [t for t in (getattr(self, name) for name in self.SENTENCE_TENSORS) if t is not None]

    def select_sentences(self, kept: Tensor) -> bool:
        """Keep sentences `kept` (in that order): in place where the count stays (captured graphs read them at
        their addresses), new tensors where it shrinks. -> whether any tensor moved."""
        moved_any = False
        for name in self.SENTENCE_TENSORS:
            value = getattr(self, name)
            if value is not None:
                moved = value.index_select(0, kept)
                if moved.shape == value.shape:
                    value.copy_(moved)
                else:
                    setattr(self, name, moved)
                    moved_any = True
        return moved_any

    def keep_sentences(self, kept: Tensor) -> None:
        """Keep sentences `kept` as the first ones of the same buffers (prefix views: the static beam search's
        graphs of the smaller shape read them there)."""
        for name in self.SENTENCE_TENSORS:
            value = getattr(self, name)
            if value is not None:
                moved = value.index_select(0, kept)
                setattr(self, name, value.view(-1)[: moved.numel()].view(moved.shape).copy_(moved))


class IncrementalDecoder:
    """One batch's incremental decoding on a decoder (RFATransformerDecoder): `start` makes the layers' caches
    from the encoder output, `step` decodes one token per row (eagerly or as a CUDA graph's replay), `reorder`
    follows beam search. `compute` and `step_done` are a step's two halves for a caller that captures the
    step itself (the static beam search): the device work, and what the host does after it.

    rows: the batch's rows (beam search: sentences x beam). beam, sentences: rows n * beam .. n * beam + beam - 1
    read source sentence n (beam 1 once a reorder breaks that layout). order: the pending beam order, applied by
    the next step. layers: each decoder layer's cache.
    """

    KEY = "rfa_incremental_decoder"  # its entry in fairseq's incremental_state
    NO_HOST_READS_ON = ("cuda",)  # device types whose reorders read nothing back (a read waits for the device)

    def __init__(self, decoder, kernels, workspace: Workspace, rows: int, beam: int,
                 graphs: Optional["StepGraphs"] = None):
        weight = decoder.embed_tokens.weight
        self.decoder, self.kernels, self.workspace = decoder, kernels, workspace
        self.rows, self.beam, self.sentences = rows, beam, rows // beam
        self.device, self.dtype = weight.device, weight.dtype
        self.order: Optional[Tensor] = None
        self.order_buffer: Optional[Tensor] = None  # use_order_buffer's
        self.first = True
        self.sentence_of_row = torch.arange(self.sentences, device=self.device).repeat_interleave(beam)
        self.layers: list = []
        self.graphs = graphs  # CUDA graphs of the steps (None: every step runs eagerly)

    def start(self, key: Optional[Tensor], key_padding_mask: Optional[Tensor], source_len: Optional[int] = None):
        """The layers' caches: key (S, sentences, C) the encoder output once per sentence (or None), its padding
        (sentences, S) or None. source_len >= S pads the cross-attention's K/V to that length (masked), so that
        batches of nearby source lengths share shapes. -> self"""
        self.layers = [layer.start_step(self, i, key, key_padding_mask, source_len)
                       for i, layer in enumerate(self.decoder.layers)]
        return self

    def use_order_buffer(self, order: Tensor) -> None:
        """Every step reads the pending beam order from `order` (R,), which the caller rewrites each step."""
        self.order = self.order_buffer = order

    # ------------------------------------------------------------ a step

    def step(self, tokens: Tensor, positions: Optional[Tensor]):
        """One step of every row: tokens (R,) the last tokens, positions (R, C) or None -> logits (R, V) in a
        buffer no caller views, the last layer's head-averaged cross-attention weights (R, S) or None."""
        R = tokens.size(0)
        if R != self.rows:
            raise RuntimeError(f"RFA decoding: {R} rows for a state of {self.rows} (reorder missing?)")
        if self.graphs is None or self.first:  # the first step fills the buffers that a graph would read
            logits, attn = self.compute(tokens, positions)
        else:
            # a graph reads its inputs from fixed buffers, the beam order included (identity when none is pending)
            tokens = self.buffer("step.tokens", R, dtype=torch.long).copy_(tokens)
            if positions is not None:
                positions = self.buffer("step.positions", *positions.shape).copy_(positions)
            order = self.buffer("step.order", R, dtype=torch.long)
            if self.order is not None:
                order.copy_(self.order)
            else:
                torch.arange(R, out=order)
            self.order = order
            shape, key = self.graph_key()
            replayed, attn = self.graphs.run(key, shape, lambda: self.compute(tokens, positions))
            # a graph writes the same logits buffer at every replay, and a caller may still hold the last step's:
            # handed out as the eager step hands them out, in a buffer no caller views
            logits = self.buffer("logits.replayed", *replayed.shape, returned=True).copy_(replayed)
        self.step_done()
        return logits, attn

    def compute(self, tokens: Tensor, positions: Optional[Tensor], need_weights: bool = True,
                padded_inputs: bool = True):
        """The step's device work (the decoder's step_layers): reads and writes only this batch's buffers and
        reads nothing back to the host, so a CUDA graph can capture it."""
        return self.decoder.step_layers(self, tokens, positions, need_weights=need_weights, padded_inputs=padded_inputs)

    def step_done(self) -> None:
        """What the host does after a step (a replayed graph runs no Python): the causal states turn."""
        for layer in self.layers:
            layer.self_attn.swap()
        self.order, self.first = self.order_buffer, False

    def graph_key(self) -> Tuple[tuple, tuple]:
        """(shape, key) of this step's CUDA graph (StepGraphs.run): the rows and their layout, and with them the
        causal state buffer the step reads (each shape has a graph per buffer)."""
        shape = (self.rows, self.beam, self.sentences)
        state_in = self.layers[0].self_attn.states[0].data_ptr() if self.layers else 0
        return shape, shape + (state_in,)

    # ------------------------------------------------------------ beam search

    def reorder(self, new_order: Tensor) -> None:
        """Beam search: row i continues row new_order[i] (new_order may drop finished sentences).
        The causal states apply it in the next step; K/V move only when rows read another sentence."""
        new_order = new_order.to(self.device)
        self.order = new_order if self.order is None else self.order.index_select(0, new_order)
        unchanged_rows, self.rows = self.rows == new_order.numel(), new_order.numel()
        if not unchanged_rows and self.graphs is not None:
            self.graphs.clear()  # captured for the old shape and the old K/V
        if new_order.device.type in self.NO_HOST_READS_ON:
            # checking the rows would wait for the device: trust fairseq's beam search, whose beams of a
            # sentence stay together and whose sentences only leave (the batch shrinks). K/V kept once per row
            # (beam 1: greedy search, a caller that sets no beam size) follow every order, as fairseq's own
            # attention does.
            if unchanged_rows and self.beam > 1:
                return
            kept = self.sentence_of_row.index_select(0, new_order).view(-1, self.beam)[:, 0]
        else:
            sentence = follow_rows(self.sentence_of_row, new_order)
            if sentence is None:
                return
            groups = sentence.view(-1, self.beam) if self.beam > 1 and self.rows % self.beam == 0 else None
            if groups is not None and bool((groups == groups[:, :1]).all()):
                kept = groups[:, 0]
            else:  # rows of one sentence went apart: keep K/V once per row from now on
                kept, self.beam = sentence, 1
        resized = any([layer.cross.select_sentences(kept) for layer in self.layers if layer.cross is not None])
        if resized and self.graphs is not None:
            self.graphs.clear()
        self.sentences = kept.numel()
        self.sentence_of_row = torch.arange(self.sentences, device=self.device).repeat_interleave(self.beam)

    def keep_sentences(self, kept: Tensor, row_sources: Tensor) -> None:
        """The static beam search's halving, in place: only the sentences `kept` (N',) stay, as the first N'
        sentences of every buffer (same addresses: the CUDA graphs of the smaller shape read them there). Causal
        row i' takes the state that the pending beam order gives it, row_sources[i'] of the state buffer read
        next (the order is applied here: it is the identity afterwards); per-sentence tensors keep their kept
        sentences."""
        for layer in self.layers:
            layer.self_attn.keep_rows(row_sources)
            if layer.cross is not None:
                layer.cross.keep_sentences(kept)
        self.rows, self.sentences = row_sources.numel(), kept.numel()
        self.sentence_of_row = torch.arange(self.sentences, device=self.device).repeat_interleave(self.beam)

    # ------------------------------------------------------------ buffers

    def buffer(self, name: str, *shape: int, dtype=None, returned: bool = False) -> Tensor:
        return self.workspace.take(name, shape, dtype or self.dtype, self.device, returned=returned)

    def packed_linear(self, name: str, *linears, sources: Sequence[Tensor] = (), build=None):
        """The nn.Linear layers `linears` as one product (Workspace.packed_linears), or the (weight, bias)
        that build() derives from `sources` (Workspace.packed_linear), packed for the kernels."""
        if linears:
            return self.workspace.packed_linears(name, self.kernels, linears)
        return self.workspace.packed_linear(name, self.kernels, sources, build)

    def attention_tensors(self) -> List[Tensor]:
        """The attention state proper: every causal layer's state buffers (the batch's rows) and the
        cross-attention's per-sentence tensors."""
        causal = [t for layer in self.layers for t in layer.self_attn.tensors(self.rows)]
        return causal + [t for layer in self.layers if layer.cross is not None for t in layer.cross.tensors()]

    def tensors(self) -> List[Tensor]:
        """Every tensor the batch keeps between steps: K/V and the workspace (the causal states are in it)."""
        cross = [t for layer in self.layers if layer.cross is not None for t in layer.cross.tensors()]
        return cross + self.workspace.tensors()


def step_graphs_for(device, enabled: bool) -> Optional["StepGraphs"]:
    """CUDA graphs for a batch's steps on `device`: on CUDA when enabled (--rfa-cuda-graphs), else None."""
    if torch.device(device).type != "cuda" or not enabled:
        return None
    return StepGraphs(torch.device(device))


class StepGraphs:
    """The decoding step captured as CUDA graphs and replayed.

    A step launches some 15 kernels per layer, each a few microseconds of work at decoding's batch sizes: on a
    GPU the launches, not the arithmetic, set the step's time. Captured once, a step is one graph launch.
    A graph fixes every address it reads and writes, so one is kept per (rows, state buffer read): the causal
    states alternate between two buffers, hence two graphs per batch shape, replayed in turn. The inputs that
    change each step go through fixed buffers (the decoder copies them there); the kernels read no value back
    to the host, so a step captures whole. A shape's first step runs eagerly (it warms the kernels for that
    shape and is all a shape seen once needs), its next steps are captured and replayed. `clear` drops the
    graphs when the rows change (sentences left: new shapes, compacted K/V).
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.graphs: Dict[tuple, Tuple[object, object]] = {}  # key -> (graph, the step's outputs)
        self.seen: set = set()  # shapes that ran eagerly once
        self.pool = None  # one memory pool for the batch's graphs
        self.stream = None  # the side stream captures run on
        self.captures = self.replays = 0

    def clear(self) -> None:
        self.graphs.clear()
        self.pool = None  # a pool whose graphs are all gone cannot take another capture (torch asserts): a new one

    def run(self, key: tuple, shape: tuple, step: Callable[[], object]):
        """The step's outputs: step() itself at a shape's first step, else its graph's replay (captured now
        if missing). key: what the graph's addresses depend on (shape and buffers); step: reads only
        fixed buffers and writes into them."""
        entry = self.graphs.get(key)
        if entry is None:
            if shape not in self.seen:
                self.seen.add(shape)
                return step()
            entry = self.graphs[key] = self._capture(step)
            self.captures += 1
        graph, outputs = entry
        self._replay(graph, outputs)  # a capture records without running: its first replay computes this step
        self.replays += 1
        return outputs

    def _capture(self, step: Callable[[], object]):
        # capture_begin/end on a side stream rather than `with torch.cuda.graph(...)`, which synchronizes, runs
        # the garbage collector and empties the allocator's cache at every capture (tens of ms in fairseq-generate,
        # for a batch's few captures)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        if self.stream is None:
            self.stream = torch.cuda.Stream(self.device)
        graph = torch.cuda.CUDAGraph()
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)  # the inputs copied just before
        with torch.cuda.stream(self.stream):
            graph.capture_begin(pool=self.pool)
            try:
                outputs = step()
            finally:
                graph.capture_end()
        current.wait_stream(self.stream)
        return graph, outputs

    def _replay(self, graph, outputs) -> None:
        graph.replay()
