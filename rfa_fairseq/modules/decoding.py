"""A batch's incremental decoding state: buffers allocated at its first step, and which rows read which
source sentence.

Every tensor of an RFA decoding step keeps its shape for the whole batch: the causal state never grows and
the cross-attention reads a source K/V (or an RFA state) fixed per sentence. So the decoder layers, their
causal attention and their cross-attention each fill their buffers at the first step (`prepare_step`) and
every later step (`step`) runs in place from them:

- per causal layer, two fp32 state buffers (rows, H, F, d + 1) used in turn: a step reads one (through the
  pending beam order, so a reorder costs no pass of its own) and writes the other;
- per cross-attention layer, K and V (or the RFA state) once per source sentence, shared by its beams;
  when sentences finish, the kept ones are compacted (rows shrink, nothing grows);
- activations, logits and log-probabilities in a workspace that outlives the batch (the decoder keeps it
  for the next one), so steady-state decoding allocates no large tensor;
- the linear layers' weights as the kernels want them (oneDNN's packed layout on the CPU), in the same
  workspace: packed at the first batch and again only when a parameter they derive from changes.

On CUDA a step is captured as a CUDA graph and replayed (`StepGraphs`): its inputs (the last tokens,
their position embeddings and the pending beam order) are copied into fixed buffers first, so the same
kernels run on the same addresses each step with one launch; the beam reorder happens inside the graph.

`follow_rows` is the one account of which rows are copies of which: the state's sentences and the
encoder's reorder_encoder_out both follow beam search's reorders with it.
"""
import math
import os
import weakref
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor


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
        key = (kernels.name, tuple((id(t), t.data_ptr(), t._version) for t in sources))
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
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None:
        return True
    return use_count(buf.untyped_storage()._cdata) > 2  # buf itself + the storage object made for the call


def follow_rows(source: Tensor, new_order: Tensor) -> Optional[Tensor]:
    """Beam search's reorder of a row -> source map (source[i]: what row i is a copy of): source[new_order],
    or None when it changes nothing (every row keeps a copy of the same source: within-beam reorders)."""
    moved = source.index_select(0, new_order)
    return None if moved.numel() == source.numel() and torch.equal(moved, source) else moved


class DecodeState:
    """One batch's decoding state; lives in fairseq's incremental_state under KEY.

    rows: the batch's rows (beam search: sentences x beam). beam, sentences: rows n * beam .. n * beam + beam - 1
    read source sentence n (beam 1 once a reorder breaks that layout). order: the pending beam order,
    applied by the next step. layers[i]: layer i's buffers by module ("self", "cross"), filled at the first
    step; per-sentence ones (cross-attention K/V) are compacted when sentences leave.
    """

    KEY = "rfa_decoding"
    NO_HOST_READS_ON = ("cuda",)  # device types whose reorders read nothing back (a read waits for the device)

    def __init__(self, kernels, workspace: Workspace, rows: int, beam: int, num_layers: int, device, dtype,
                 graphs: Optional["StepGraphs"] = None):
        self.kernels, self.workspace = kernels, workspace
        self.rows, self.beam, self.sentences = rows, beam, rows // beam
        self.device, self.dtype = device, dtype
        self.order: Optional[Tensor] = None
        self.first = True
        self.sentence_of_row = torch.arange(self.sentences, device=device).repeat_interleave(beam)
        self.layers: List[Dict[str, dict]] = [{"self": {}, "cross": {}} for _ in range(num_layers)]
        self.graphs = graphs  # CUDA graphs of the step (None: every step runs eagerly)

    def swap_causal_states(self) -> None:
        """After a step: the state buffer it wrote becomes the one the next step reads (each causal layer reads
        states[0] and writes states[1])."""
        for layer in self.layers:
            states = layer["self"].get("states")
            if states is not None:
                states.reverse()

    def graph_key(self) -> Tuple[tuple, tuple]:
        """(shape, key) of this step's CUDA graph (StepGraphs.run): the rows and their layout, and with them the
        causal state buffer the step reads (each shape has a graph per buffer)."""
        shape = (self.rows, self.beam, self.sentences)
        states = next((layer["self"]["states"] for layer in self.layers if "states" in layer["self"]), None)
        return shape, shape + (states[0].data_ptr() if states else 0,)

    def buffer(self, name: str, *shape: int, dtype=None, returned: bool = False) -> Tensor:
        return self.workspace.take(name, shape, dtype or self.dtype, self.device, returned=returned)

    def packed_linear(self, name: str, *linears, sources: Sequence[Tensor] = (), build=None):
        """The nn.Linear layers `linears` as one product (Workspace.packed_linears), or the (weight, bias)
        that build() derives from `sources` (Workspace.packed_linear), packed for the kernels."""
        if linears:
            return self.workspace.packed_linears(name, self.kernels, linears)
        return self.workspace.packed_linear(name, self.kernels, sources, build)

    def reorder_(self, new_order: Tensor) -> None:
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
        resized = False
        for layer in self.layers:
            cross = layer["cross"]
            for name, value in cross.items():
                if isinstance(value, Tensor):
                    moved = value.index_select(0, kept)
                    if moved.shape == value.shape:
                        value.copy_(moved)  # in place: the captured graphs read K/V at their addresses
                    else:
                        cross[name], resized = moved, True
        if resized and self.graphs is not None:
            self.graphs.clear()
        self.sentences = kept.numel()
        self.sentence_of_row = torch.arange(self.sentences, device=self.device).repeat_interleave(self.beam)

    def keep_sentences(self, kept: Tensor, row_sources: Tensor) -> None:
        """The static beam search's halving, in place: only the sentences `kept` (N',) stay, as the first N'
        sentences of every buffer (same addresses: the CUDA graphs of the smaller shape read them there). Causal
        row i' takes the state that the pending beam order gives it, row_sources[i'] of the current state buffer
        (the order is applied here: it is none afterwards); per-sentence tensors keep their kept sentences."""
        rows = row_sources.numel()
        for layer in self.layers:
            states = layer["self"].get("states")
            if states is not None:
                states[0][:rows].copy_(states[0].index_select(0, row_sources))  # index_select copies first
            cross = layer["cross"]
            for name, value in cross.items():
                if isinstance(value, Tensor):
                    moved = value.index_select(0, kept)
                    cross[name] = value.view(-1)[: moved.numel()].view(moved.shape).copy_(moved)  # a prefix view
        self.rows, self.sentences, self.order = rows, kept.numel(), None
        self.sentence_of_row = torch.arange(self.sentences, device=self.device).repeat_interleave(self.beam)

    def attention_tensors(self) -> List[Tensor]:
        """The attention state proper: every causal layer's state buffers (the batch's rows) and the
        cross-attention's per-sentence tensors."""
        causal = [t[: self.rows] for layer in self.layers for t in layer["self"]["states"]]
        return causal + [t for layer in self.layers for t in layer["cross"].values() if isinstance(t, Tensor)]

    def tensors(self) -> List[Tensor]:
        """Every tensor the batch keeps between steps: K/V and the workspace (the causal states are in it)."""
        cross = [t for layer in self.layers for t in layer["cross"].values() if isinstance(t, Tensor)]
        return cross + self.workspace.tensors()

    def log_probs(self, logits: Tensor) -> Tensor:
        """log_softmax of this step's logits into the workspace (fairseq's get_normalized_probs), fp32."""
        out = self.buffer("log_probs", *logits.shape, dtype=torch.float32, returned=True)
        return torch.log_softmax(logits.float(), dim=-1, out=out)


# tests and benchmarks only: set to 1 for the uncaptured step on CUDA (the reference the graphs are checked against)
EAGER_STEP_ENV = "RFA_FAIRSEQ_EAGER_STEP"


def step_graphs_for(device) -> Optional["StepGraphs"]:
    """CUDA graphs for a batch's steps on `device`: on CUDA unless RFA_FAIRSEQ_EAGER_STEP=1, else None."""
    if torch.device(device).type != "cuda" or os.environ.get(EAGER_STEP_ENV) == "1":
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
