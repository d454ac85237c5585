"""Incremental decoding: the runtime built once per weights, and one batch's state.

Every tensor of an RFA decoding step keeps its shape for the whole batch: the causal state never grows and the
cross-attention reads a source K/V (or an RFA state) fixed per sentence. So decoding is two objects:

- `DecodingRuntime`, built once per (weights, kernels, device, dtype) by RFATransformerDecoder.decoding_runtime():
  the kernel set (kernel_choice.step_kernels) and one record per decoder layer (`DecoderLayerRecord`: its linear
  layers packed for the kernels, its norms, its attentions' records), with the embedding and output records. On the
  CPU in fp32 (and int8) it also holds the native program: the same step compiled ahead of time in C++
  (cpu/csrc/decode_program.cpp), built from the same records.
- `DecodingState`, one batch's decoding (start, step, reorder), the one object a beam search drives, with the one
  account of its rows (`BatchRows`: which source sentence each row reads, the beam layout, the pending beam order, the
  state buffer the next step reads; changed only through its methods) and one cache per layer that owns its buffers
  (`LayerCache`: the causal attention's `CausalCache`, state buffers (rows, H, F, d + 1): two used in turn, or one
  updated in place where the native search drives the batch; the cross-attention's `SentenceCache`, K and V or the RFA
  state once per source sentence). Everything else derives from them when they change: the native program's view of
  the caches (`NativeBatch`, tensors only), the caches' reorders. A state kept across batches (the static beam search)
  reuses its buffers, so a batch of a shape seen before runs on the same addresses (and CUDA graphs); fairseq's
  generator starts a state per batch on the buffers the last batch left (`DecodingCache`).

The step is one function in two implementations: the records' `step` methods in torch (the reference, CUDA, bf16)
and the native program (the CPU), chosen once by the kernel set. On CUDA the step is captured as a CUDA graph and
replayed (`StepGraphs`).

fairseq's incremental_state holds one reference to the batch's DecodingState and nothing else.
"""
import math
import weakref
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from fairseq.modules.gelu import gelu as fairseq_gelu

from .. import torch_internals

# FFN activations the native program has, by name (DecoderLayerRecord.activation)
FFN_ACTIVATIONS = {F.relu: "relu", fairseq_gelu: "gelu", F.gelu: "gelu"}


# ---------------------------------------------------------------- the batch's rows


class BatchRows:
    """The one account of a batch's rows, changed only through its methods (its fields are read-only): `sentences`
    places of `beam` rows each, row n * beam + b being place n's beam b, which reads source sentence n (the caches keep
    K/V or an RFA state once per sentence: `sentence_of_rows`); the beam order the next step applies to the causal
    states (`order`: row i continues row order[i] of the state buffer read next, whose row n * beam + b holds the state
    of place n's beam b as the step that wrote it numbered the places; None: row i continues row i); the buffer of each
    pair the next step reads (`parity`: the causal states', and the static beam search's tokens and scores); and
    whether that step is the batch's first (no state to read).

    fairseq's generator composes its reorders into the order (`reorder`). The static beam search lends the account an
    order buffer (`use_order_buffer`), rewritten at each step by the search that decides the beams: its torch step
    through `continue_rows`, its native step in C++ (cpu/csrc/native_search.h, the same meaning); the native search
    returns how many steps it ran and the account turns (`steps_ran`)."""

    def __init__(self, sentences: int, beam: int):
        self._sentences, self._beam = sentences, beam
        self._order: Optional[Tensor] = None
        self._order_buffer: Optional[Tensor] = None
        self._parity, self._first = 0, True
        self._sentence_of_rows: Optional[Tensor] = None  # made once per layout (and device) on demand

    sentences = property(lambda self: self._sentences)
    beam = property(lambda self: self._beam)
    order = property(lambda self: self._order)
    parity = property(lambda self: self._parity)
    first = property(lambda self: self._first)

    @property
    def rows(self) -> int:
        return self._sentences * self._beam

    def sentence_of_rows(self, device) -> Tensor:
        """(rows,) the source sentence each row reads: n for rows n * beam .. n * beam + beam - 1."""
        held = self._sentence_of_rows
        if held is None or held.device != torch.device(device):
            held = self._sentence_of_rows = torch.arange(self._sentences, device=device).repeat_interleave(self._beam)
        return held

    def _set_layout(self, sentences: int, beam: int) -> None:
        self._sentences, self._beam, self._sentence_of_rows = sentences, beam, None

    # ------------------------------------------------------------ steps

    def steps_ran(self, count: int = 1) -> None:
        """`count` steps ran: the buffer pairs turned once each, and the order is the buffer's again (or none)."""
        if count > 0:
            self._parity ^= count & 1
            self._order, self._first = self._order_buffer, False

    def stage_order(self, buffer: Tensor) -> Tensor:
        """The pending order copied into `buffer` (rows,) (identity where none), which holds it from now on: a CUDA
        graph reads it at that fixed address. -> buffer"""
        if self._order is not None:
            buffer.copy_(self._order)
        else:
            torch.arange(buffer.numel(), out=buffer)
        self._order = buffer
        return buffer

    # ------------------------------------------------------------ the static beam search

    def use_order_buffer(self, buffer: Tensor) -> None:
        """Every step reads the pending order from `buffer` (>= rows,), which the search's steps rewrite."""
        self._order = self._order_buffer = buffer

    def continue_rows(self, candidate_rows: Tensor, chosen: Tensor) -> None:
        """The torch search's reorder: place n's beam b continues row candidate_rows[n, chosen[n, b]] (rows numbered
        as the step that ends now numbers them), written into the order buffer (inside a CUDA graph: device work
        only). candidate_rows (sentences, c), chosen (sentences, beam) int64."""
        torch.gather(candidate_rows, 1, chosen, out=self._order_buffer.view(self._sentences, self._beam))

    def keep_places(self, kept: Tensor, order_buffer: Tensor) -> None:
        """The torch search's halving: only the places `kept` (N',) stay, as the first N' places; the pending order
        keeps naming each kept row's source row in the state buffer read next (the state is not moved: the next step
        reads it through the order and writes the new rows), from now on in `order_buffer` (the search's buffer for
        N' places, which may share the old one's storage)."""
        kept_rows = (kept.unsqueeze(1) * self._beam + torch.arange(self._beam, device=kept.device)).view(-1)
        sources = self._order.index_select(0, kept_rows)
        self._set_layout(kept.numel(), self._beam)
        self.use_order_buffer(order_buffer)
        order_buffer.copy_(sources)

    # ------------------------------------------------------------ fairseq's generator

    def reorder(self, new_order: Tensor, read_back: bool) -> Optional[Tensor]:
        """fairseq's beam search: row i continues row new_order[i] (rows may leave: sentences finished). The order
        composes (the causal states apply it at the next step). -> the sentences the new rows read, in the order the
        caches' per-sentence tensors take them (the caches select these), or None where every row reads the sentence
        it read. The layout after: rows n * beam .. read sentence n, or beam 1 (one row a sentence copy) where the
        reorder parted a sentence's beams (or beam was 1).

        read_back=False (CUDA: a look at the values would wait for the device): the account follows fairseq's beam
        search, whose reorders keep a sentence's beams together and whose sentences only leave, so the rows' sentences
        are read off the account's layout for the rows kept, without a look at them: an order that keeps the rows
        moves no sentence; one that drops rows keeps each group's sentence (beam 1 follows every order)."""
        self._order = new_order if self._order is None else self._order.index_select(0, new_order)
        beam = self._beam
        if not read_back and new_order.numel() == self.rows and beam > 1:
            return None
        read = self.sentence_of_rows(new_order.device).index_select(0, new_order)  # the sentence each new row reads
        if not read_back:
            if new_order.numel() % beam:
                raise RuntimeError(f"RFA decoding: a reorder to {new_order.numel()} rows breaks the batch's beams of "
                                   f"{beam}")
            kept = read.view(-1, beam)[:, 0]
        else:
            if read.numel() == self.rows and torch.equal(read, self.sentence_of_rows(new_order.device)):
                return None  # every row reads the sentence it read: nothing moves
            kept = _beam_groups(read, beam)
            if kept is None:  # a sentence's rows went apart (or beam 1): K/V once per row from now on
                kept, beam = read, 1
        self._set_layout(kept.numel(), beam)
        return kept


def _beam_groups(sentence_of_rows: Tensor, beam: int) -> Optional[Tensor]:
    """The sentences (n,) when rows n * beam .. n * beam + beam - 1 all read one sentence (beam > 1), else None."""
    rows = sentence_of_rows.numel()
    if beam <= 1 or rows % beam:
        return None
    groups = sentence_of_rows.view(-1, beam)
    return groups[:, 0] if bool((groups == groups[:, :1]).all()) else None


def beam_layout(key: Tensor, key_padding_mask: Optional[Tensor], beam: int) -> bool:
    """Whether the encoder output key (S, rows, C) and its padding (rows, S) hold each sentence `beam` times in a row
    (fairseq's beam search expands them so), checked on the values: then K/V are kept once per sentence."""
    S, rows, C = key.shape
    if beam < 1 or rows % beam:
        return False
    grouped = key.view(S, rows // beam, beam, C)
    if not torch.equal(grouped, grouped[:, :, :1].expand_as(grouped)):
        return False
    if key_padding_mask is None:
        return True
    pad = key_padding_mask.view(rows // beam, beam, -1)
    return torch.equal(pad, pad[:, :1].expand_as(pad))


# ---------------------------------------------------------------- linear layers packed once


class WeightsWatch:
    """What a runtime built from a module's parameters and buffers depends on, checked at every batch: each tensor's
    identity, storage and version (an in-place update bumps it; `.data` updates do not: the decoder drops its runtime
    in `train()`). Listing the tensors walks the module tree (about 60 us for a decoder, each batch's cost at one
    sentence a batch), so they are listed once and again only after a parameter, buffer or submodule was registered
    anywhere (torch's global registration hooks count them: an assignment that replaces a weight)."""

    registrations = 0  # parameters, buffers and submodules registered in this process so far

    def __init__(self):
        self._tensors: Optional[List[Tensor]] = None
        self._listed_at = -1

    def key(self, module: torch.nn.Module) -> tuple:
        if self._tensors is None or self._listed_at != WeightsWatch.registrations:
            self._tensors = list(module.parameters()) + list(module.buffers())
            self._listed_at = WeightsWatch.registrations
        return torch_internals.tensor_states(self._tensors)


def _count_registration(*_args) -> None:
    WeightsWatch.registrations += 1


for _register in (torch.nn.modules.module.register_module_parameter_registration_hook,
                  torch.nn.modules.module.register_module_buffer_registration_hook,
                  torch.nn.modules.module.register_module_module_registration_hook):
    _register(_count_registration)


@dataclass
class NormRecord:
    """A LayerNorm's parameters: the step applies it with kernels.add_layer_norm."""

    weight: Tensor
    bias: Tensor
    eps: float

    @classmethod
    def of(cls, norm) -> Optional["NormRecord"]:
        # copies, a few hundred values: read at every step, a parameter in a checkpoint's mapping would map the pages
        # around it again (the weights packed beside it in the file among them)
        return None if norm is None else cls(norm.weight.detach().clone(), norm.bias.detach().clone(), float(norm.eps))

    def __call__(self, kernels, x: Tensor, residual: Optional[Tensor] = None) -> Tensor:
        return kernels.add_layer_norm(x, residual, self.weight, self.bias, self.eps)


# ---------------------------------------------------------------- the caches, each owning its buffers


def reuse_or_allocate(buffer: Optional[Tensor], shape: Tuple[int, ...], dtype, device) -> Tuple[Tensor, bool]:
    """A contiguous (shape) tensor at the start of `buffer`'s storage when that is large enough and of this dtype and
    device (a batch of a shape seen before gets the same addresses), else a new tensor.
    -> (the tensor, whether a new one was allocated)."""
    numel = math.prod(shape)
    if buffer is not None and buffer.dtype == dtype and buffer.device == device:
        if buffer.shape == shape and buffer.storage_offset() == 0 and buffer.is_contiguous():
            return buffer, False  # the last batch's shape (one sentence a batch: every layer's states)
        storage = buffer.untyped_storage()
        if storage.nbytes() >= max(numel, 1) * buffer.element_size():
            return torch.empty(0, dtype=dtype, device=device).set_(storage, 0, shape), False
    return torch.empty(max(numel, 1), dtype=dtype, device=device)[:numel].view(shape), True


class CausalCache:
    """A causal RFA layer's cache: its state buffers (>= rows, H, F, d + 1), fp32, or fp16 where the kernels keep it so
    (the native step's default). `states[parity]` is the buffer a step reads, `states[1 - parity]` the one it writes:
    two buffers used in turn, or one for both where the native search drives the batch (its places read only their own
    rows, and the native step updates them in place: half the memory, the same traffic)."""

    def __init__(self):
        self.buffers: List[Tensor] = []  # the distinct buffers
        self.states: List[Tensor] = []  # by parity

    def allocate(self, rows: int, heads: int, features: int, head_dim: int, device, dtype=torch.float32,
                 count: int = 2) -> bool:
        """`count` (1 or 2) state buffers for `rows` rows, reusing the last batch's when large enough. -> whether any
        buffer is new."""
        if count not in (1, 2):
            raise ValueError(f"a causal cache keeps 1 or 2 state buffers, not {count}")
        shape, new = (rows, heads, features, head_dim + 1), False
        buffers = []
        for j in range(count):
            state, allocated = reuse_or_allocate(self.buffers[j] if len(self.buffers) > j else None, shape, dtype,
                                                 device)
            buffers.append(state)
            new |= allocated
        self.buffers = buffers
        self.states = buffers if count == 2 else buffers * 2
        return new

    def tensors(self, rows: int) -> List[Tensor]:
        return [t[:rows] for t in self.buffers]


class SentenceCache:
    """A cross-attention's cache: tensors kept once per source sentence (the fields named in SENTENCE_TENSORS,
    shared by the sentence's beams)."""

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


@dataclass
class LayerCache:
    """A decoder layer's cache: its causal attention's and its cross-attention's (None without a source)."""

    self_attn: CausalCache
    cross: Optional[SentenceCache]


# ---------------------------------------------------------------- the runtime


class DecodingRuntime:
    """What every batch's decoding reads, built once per (weights, kernels, device, dtype): the kernel set, the
    embedding and output records, one record per decoder layer, and on the CPU the native program built from them
    (None where the kernel set runs the torch step)."""

    def __init__(self, decoder, kernels):
        weight = decoder.embed_tokens.weight
        self.kernels = kernels
        self.device, self.dtype = weight.device, weight.dtype
        self.embed = weight.detach()
        self.embed_scale = float(decoder.embed_scale)
        self.embed_norm = NormRecord.of(decoder.layernorm_embedding)
        self.padding_idx = decoder.padding_idx
        self.layers = [layer.decoding_record(kernels) for layer in decoder.layers]
        self.final_norm = NormRecord.of(decoder.layer_norm)
        out = decoder.output_projection
        self.vocab_size = out.weight.size(0)
        self.output = kernels.pack_linear(out.weight.detach(), None if out.bias is None else out.bias.detach())
        kernels.release_packed_sources()
        self.program = kernels.new_program(self) if kernels.native else None

    def embed_step(self, tokens: Tensor, positions: Optional[Tensor]) -> Tensor:
        """(R,) tokens and (R, C) / (1, C) position embeddings or None -> the first layer's input (R, C)."""
        x = torch.index_select(self.embed, 0, tokens)
        if self.embed_scale != 1.0:
            x.mul_(self.embed_scale)
        if positions is not None:
            x.add_(positions)
        return x if self.embed_norm is None else self.embed_norm(self.kernels, x)


class StateBuffers:
    """What a batch's DecodingState decodes on: its layers' caches and the CUDA graphs' input buffers."""

    def __init__(self):
        self.layers: List[LayerCache] = []
        self.inputs: Dict[str, Tensor] = {}


class RuntimeCache:
    """A runtime a module builds from its weights (the decoder's DecodingRuntime, the encoder's EncodingRuntime), with
    the key it was built for: `get(module, options, build)` returns it while the options and the module's tensors
    (WeightsWatch) stay the same, and builds it again otherwise. A cache: copies and pickles of a model start with an
    empty one (the packed weights and the native programs cannot be copied)."""

    def __init__(self):
        self.key, self.runtime = None, None
        self.weights = WeightsWatch()  # what the runtime's key reads of the module's tensors

    def __deepcopy__(self, memo):
        return type(self)()

    def __reduce__(self):
        return (type(self), ())

    def clear(self) -> None:
        self.key, self.runtime = None, None

    def current_key(self, module: torch.nn.Module, options: tuple) -> tuple:
        return options, self.weights.key(module)

    def has_runtime(self, module: torch.nn.Module, options: tuple) -> bool:
        """Whether the runtime is built for the module's current tensors and these options."""
        return self.runtime is not None and self.key == self.current_key(module, options)

    def get(self, module: torch.nn.Module, options: tuple, build: Callable[[], object]):
        key = self.current_key(module, options)
        if self.runtime is None or self.key != key:
            self.set_runtime(key, build())
        return self.runtime

    def set_runtime(self, key, runtime) -> None:
        self.key, self.runtime = key, runtime


class DecodingCache(RuntimeCache):
    """What a decoder keeps between batches: its runtime (RuntimeCache) and the buffers of the last batch it started,
    which the next batch decodes on once that batch's state is gone (one set at most: a batch that starts while the
    last one is still decoding gets buffers of its own)."""

    def __init__(self):
        super().__init__()
        self._buffers: Optional[StateBuffers] = None
        self._owner: Optional[weakref.ref] = None  # the DecodingState decoding on _buffers

    def clear(self) -> None:
        super().clear()
        self._buffers, self._owner = None, None

    def set_runtime(self, key, runtime: "DecodingRuntime") -> None:
        super().set_runtime(key, runtime)
        self._buffers, self._owner = None, None

    def buffers_for(self, state: "DecodingState") -> StateBuffers:
        """Buffers for `state`'s batch: the last batch's when its state is gone, else new ones (kept for the next)."""
        last = self._owner() if self._owner is not None else None
        if self._buffers is None or last is not None:
            self._buffers = StateBuffers()
        self._owner = weakref.ref(state)
        return self._buffers


# ---------------------------------------------------------------- a batch's output vocabulary


@dataclass
class OutputColumns:
    """A batch's output vocabulary (--rfa-shortlist: the union of its sentences' candidate target tokens,
    shortlist.Shortlist.union): the step's output projection is the runtime's rows of these ids (`projection`, made
    once per batch by the kernel set's select_outputs) and its logits are their columns, column c scoring target id
    ids[c]; a search maps its candidates' columns back to ids. Columns from `size` on pad the projection to a bucket
    (CUDA: the graphs of nearby sizes are shared) and score -inf; their id is the padding token's."""

    ids: Tensor  # (columns,) int64: the first `size` sorted distinct target ids, then padding
    size: int
    projection: object  # PackedLinear: (columns,) output rows of the runtime's output projection

    @property
    def columns(self) -> int:
        return self.ids.numel()

    def columns_of(self, tokens: Tensor) -> Tensor:
        """The columns of target ids `tokens` (any shape); a ValueError where one is not in the vocabulary (the union
        holds every token a caller forces: a prefix's are added, never dropped)."""
        held = self.ids[: self.size]
        columns = torch.searchsorted(held, tokens.reshape(-1)).clamp_(max=self.size - 1)
        if not torch.equal(held.index_select(0, columns), tokens.reshape(-1)):
            missing = tokens.reshape(-1)[held.index_select(0, columns) != tokens.reshape(-1)]
            raise ValueError(f"RFA decoding: target ids {missing[:5].tolist()} are not in the batch's shortlist "
                             "vocabulary (its union must add every forced token)")
        return columns.view(tokens.shape)

    def full_logits(self, logits: Tensor, vocab_size: int) -> Tensor:
        """(R, columns) logits as (R, vocab_size), -inf outside the vocabulary: fairseq's generator then computes the
        same log-softmax over the full vocabulary (exp(-inf) adds nothing)."""
        full = logits.new_full((logits.size(0), vocab_size), -math.inf)
        return full.index_copy_(1, self.ids[: self.size], logits[:, : self.size])


# ---------------------------------------------------------------- one batch


class DecodingState:
    """One batch's incremental decoding on a runtime: `start` makes (or reuses) the layers' caches from the encoder
    output, `step` decodes one token per row, `reorder` follows beam search. `compute` and `step_done` are a step's
    two halves for a caller that runs the step itself (the static beam search: captured in its graph, or its native
    whole step): the device work, and what the host does after it.

    `batch` (BatchRows) is the one account of its rows: rows n * beam .. n * beam + beam - 1 read source sentence n
    (beam 1 once a reorder breaks that layout), the pending beam order, the causal state buffer the next step reads;
    `start` makes it, and the static beam search shares it. A native step runs on the calling thread's OpenMP and MKL
    teams (a thread that decodes its own part of a batch limits its own: PartThreads).
    """

    KEY = "rfa_decoding_state"  # its entry in fairseq's incremental_state
    NO_HOST_READS_ON = ("cuda",)  # device types whose reorders read nothing back (a read waits for the device)

    def __init__(self, graphs: Optional["StepGraphs"] = None):
        self.graphs = graphs  # CUDA graphs of the steps (None: every step runs as it is)
        self.runtime: Optional[DecodingRuntime] = None
        self.buffers = StateBuffers()
        self.batch = BatchRows(0, 1)
        self.generation = 0  # bumped whenever a buffer is (re)allocated: a captured graph is stale then
        self._native = None  # the native program's view of this batch's caches (NativeBatch), made when they change
        self.output: Optional[OutputColumns] = None  # the batch's output vocabulary (restrict_output), None: all

    @property
    def layers(self) -> List[LayerCache]:
        return self.buffers.layers

    # the batch's rows, read from its one account (BatchRows)
    rows = property(lambda self: self.batch.rows)
    beam = property(lambda self: self.batch.beam)
    sentences = property(lambda self: self.batch.sentences)
    order = property(lambda self: self.batch.order)
    parity = property(lambda self: self.batch.parity)
    first = property(lambda self: self.batch.first)

    @property
    def kernels(self):
        return self.runtime.kernels

    def start(self, runtime: DecodingRuntime, rows: int, beam: int, key: Optional[Tensor],
              key_padding_mask: Optional[Tensor], source_len: Optional[int] = None,
              buffers: Optional[StateBuffers] = None, state_buffers: int = 2) -> "DecodingState":
        """A batch of `rows` rows, `beam` per sentence, on `runtime`: key (S, sentences, C) the encoder output once
        per sentence (or None), its padding (sentences, S) or None. source_len >= S pads the cross-attention's K/V
        to that length (masked), so that batches of nearby source lengths share shapes. buffers: decode on these
        (the last batch's, DecodingCache.buffers_for) instead of this state's own. state_buffers: the causal states'
        buffers, 2 (used in turn: any reorder) or 1 (the native search, whose rows read their own place's only). The
        batch's rows get a new account (`batch`). -> self"""
        if buffers is not None and buffers is not self.buffers:
            self.buffers = buffers
            self.generation += 1
        if self.runtime is not runtime:
            self.runtime = runtime
            self.generation += 1
        if beam < 1 or rows % beam:
            raise ValueError(f"RFA decoding: a batch of {rows} rows cannot hold {beam} rows per sentence")
        self.batch = BatchRows(rows // beam, beam)
        caches = []
        for i, record in enumerate(runtime.layers):
            previous = self.layers[i] if i < len(self.layers) else None
            cache, allocated = record.start(previous, rows, key, key_padding_mask, source_len, runtime, state_buffers)
            caches.append(cache)
            self.generation += int(allocated)
        self.layers[:] = caches
        self._native = None
        self.output = None  # the full vocabulary until restrict_output says otherwise
        if runtime.program is not None and key is not None:  # the softmax cross-attention's K, V: one native call
            runtime.program.start_sources(self.native_batch(), key, key_padding_mask)
        return self

    def restrict_output(self, vocabulary: Optional[Tensor], bucket: int = 1) -> None:
        """This batch's output vocabulary, after `start`: the sorted distinct target ids (U,) its steps score (a
        shortlist's union), its output projection their rows (`output`); None: the full vocabulary. bucket: the
        columns padded to a multiple of it (CUDA: the projection's buffers keep their addresses and shapes across
        batches of nearby U, so their graphs replay), the padding scoring -inf."""
        self.output = None
        self._native = None
        if vocabulary is None:
            return
        size = vocabulary.numel()
        columns = -(-size // bucket) * bucket
        ids = self._input("output_ids", (columns,), torch.long)
        ids[:size].copy_(vocabulary)
        ids[size:].fill_(self.runtime.padding_idx)
        projection = self.runtime.kernels.select_outputs(self.runtime.output, ids, size, take=self._input)
        self.output = OutputColumns(ids, size, projection)

    # ------------------------------------------------------------ a step

    def step(self, tokens: Tensor, positions: Optional[Tensor]):
        """One step of every row: tokens (R,) the last tokens, positions (R, C) or None -> logits (R, V) that no
        later step overwrites (V: the batch's output columns where restrict_output gave it a vocabulary), the last layer's head-averaged cross-attention weights (R, S) or None."""
        R = tokens.size(0)
        if R != self.rows:
            raise RuntimeError(f"RFA decoding: {R} rows for a state of {self.rows} (reorder missing?)")
        if self.graphs is None or self.first:  # the first step fills the buffers that a graph would read
            logits, attn = self.compute(tokens, positions)
        else:
            # a graph reads its inputs from fixed buffers, the beam order included (identity when none is pending)
            tokens = self._input("tokens", tokens.shape, torch.long).copy_(tokens)
            if positions is not None:
                positions = self._input("positions", positions.shape, positions.dtype).copy_(positions)
            self.batch.stage_order(self._input("order", (R,), torch.long))
            shape = (self.rows, self.beam, self.sentences)
            replayed, attn = self.graphs.run(shape + (self.generation, self.parity), shape,
                                             lambda: self.compute(tokens, positions))
            logits = replayed.clone()  # a graph writes the same buffer at every replay; a caller may hold this one
        self.step_done()
        return logits, attn

    def compute(self, tokens: Tensor, positions: Optional[Tensor], need_weights: bool = True,
                padded_inputs: bool = True):
        """The step's device work -> logits (R, V), the last layer's head-averaged cross-attention weights (R, S)
        (need_weights, softmax cross-attention) or None. padded_inputs=False: no token is padding (a beam search
        never feeds pad), so no key is masked. Reads and writes only this batch's buffers and reads nothing back to
        the host: a CUDA graph can capture it."""
        runtime = self.runtime
        if runtime.program is not None:
            return self._compute_native(tokens, positions, need_weights, padded_inputs)
        kernels = runtime.kernels
        x = runtime.embed_step(tokens, positions)
        key_pad = torch.eq(tokens, runtime.padding_idx) if padded_inputs else None
        order = None if self.first else self.order
        attn = None
        for i, (record, cache) in enumerate(zip(runtime.layers, self.layers)):
            last = i == len(self.layers) - 1
            x, weights = record.step(kernels, x, cache, self, order, key_pad, need_weights and last)
            attn = weights if weights is not None else attn
        if runtime.final_norm is not None:
            x = runtime.final_norm(kernels, x)
        return kernels.linear(x, runtime.output if self.output is None else self.output.projection), attn

    def _compute_native(self, tokens, positions, need_weights, padded_inputs):
        weights = None
        last = self.runtime.layers[-1] if self.runtime.layers else None
        if need_weights and last is not None and self.layers[-1].cross is not None and last.cross.has_weights:
            weights = torch.empty(tokens.size(0), self.layers[-1].cross.key.size(2), device=tokens.device)
        logits = self.runtime.program.decode(
            self.native_batch(), tokens, positions, None if self.first else self.order, self.parity, self.first,
            padded_inputs, weights, self.beam)
        return logits, weights

    def native_batch(self):
        """The native program's view of this batch's caches (their own tensors, read by name), made again whenever a
        cache's tensors change."""
        if self._native is None:
            self._native = self.runtime.kernels.ext.NativeBatch(
                self.layers, None if self.output is None else self.output.projection)
        return self._native

    def step_done(self) -> None:
        """What the host does after a step (a replayed graph runs no Python): the causal states turn."""
        self.batch.steps_ran(1)

    def _input(self, name: str, shape, dtype) -> Tensor:
        buffer, allocated = reuse_or_allocate(self.buffers.inputs.get(name), tuple(shape), dtype, self.runtime.device)
        if allocated:
            self.buffers.inputs[name] = buffer
            self.generation += 1
        return buffer

    # ------------------------------------------------------------ beam search

    def reorder(self, new_order: Tensor) -> None:
        """Beam search: row i continues row new_order[i] (new_order may drop finished sentences).
        The causal states apply it in the next step (the rows' account composes it); K/V move only when rows read
        another sentence (the sentences the account says they read)."""
        new_order = new_order.to(self.runtime.device)
        if new_order.numel() != self.rows and self.graphs is not None:
            self.graphs.clear()  # captured for the old shape and the old K/V
        kept = self.batch.reorder(new_order, read_back=new_order.device.type not in self.NO_HOST_READS_ON)
        if kept is None:
            return
        resized = any([layer.cross.select_sentences(kept) for layer in self.layers if layer.cross is not None])
        if resized:
            self._native = None
            if self.graphs is not None:
                self.graphs.clear()

    def keep_sentences(self, kept: Tensor, order_buffer: Tensor) -> None:
        """The static beam search's halving, in place: only the sentences `kept` (N',) stay, as the first N'
        sentences of every per-sentence tensor (same addresses: the CUDA graphs of the smaller shape read them
        there), in N' x beam rows. The causal states stay where they are: the rows' pending order, from now on in
        `order_buffer` (the search's for N' places), names each new row's source row in the state buffer read next,
        and the next step writes the new rows from the first on (no state is copied here)."""
        for layer in self.layers:
            if layer.cross is not None:
                layer.cross.keep_sentences(kept)
        self.batch.keep_places(kept, order_buffer)
        self._native = None

    def attention_tensors(self) -> List[Tensor]:
        """The attention state proper: every causal layer's state buffers (the batch's rows) and the
        cross-attention's per-sentence tensors."""
        causal = [t for layer in self.layers for t in layer.self_attn.tensors(self.rows)]
        return causal + [t for layer in self.layers if layer.cross is not None for t in layer.cross.tensors()]


# ---------------------------------------------------------------- CUDA graphs


def step_graphs_for(device, enabled: bool) -> Optional["StepGraphs"]:
    """CUDA graphs for a batch's steps on `device`: on CUDA when enabled (--rfa-cuda-graphs), else None."""
    if torch.device(device).type != "cuda" or not enabled:
        return None
    return StepGraphs(CUDAGraphBackend(torch.device(device)))


class CUDAGraphBackend:
    """Captures a step as a CUDA graph (`capture(step) -> (graph, outputs)`) and replays it (`replay(graph)`)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.pool = None  # one memory pool for a batch's graphs
        self.stream = None  # the side stream captures run on

    def reset(self) -> None:
        self.pool = None  # a pool whose graphs are all gone cannot take another capture (torch asserts): a new one

    def capture(self, step: Callable[[], object]):
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

    def replay(self, graph, outputs) -> None:
        graph.replay()


class StepGraphs:
    """The decoding step captured as graphs and replayed (a `CUDAGraphBackend` on CUDA).

    A step launches some 15 kernels per layer, each a few microseconds of work at decoding's batch sizes: on a
    GPU the launches, not the arithmetic, set the step's time. Captured once, a step is one graph launch.
    A graph fixes every address it reads and writes, so one is kept per key (the rows and the state buffer read,
    the buffers' generation): the causal states alternate between two buffers, hence two graphs per batch shape,
    replayed in turn. The inputs that change each step go through fixed buffers; the step reads no value back to
    the host, so it captures whole. A shape's first step runs as it is (it warms the kernels for that shape and is
    all a shape seen once needs), its next steps are captured and replayed. `clear` drops the graphs when the rows
    change (sentences left: new shapes, compacted K/V).
    """

    def __init__(self, backend):
        self.backend = backend
        self.graphs: Dict[tuple, Tuple[object, object]] = {}  # key -> (graph, the step's outputs)
        self.seen: set = set()  # shapes that ran once without a graph

    def clear(self) -> None:
        self.graphs.clear()
        self.backend.reset()

    def run(self, key: tuple, shape: tuple, step: Callable[[], object]):
        """The step's outputs: step() itself at a shape's first step, else its graph's replay (captured now if
        missing). key: what the graph's addresses depend on; step: reads only fixed buffers and writes into them."""
        entry = self.graphs.get(key)
        if entry is None:
            if shape not in self.seen:
                self.seen.add(shape)
                return step()
            entry = self.graphs[key] = self.backend.capture(step)
        graph, outputs = entry
        self.backend.replay(graph, outputs)  # a capture records without running: its first replay computes the step
        return outputs


# ---------------------------------------------------------------- the step's pieces shared by the records


def feed_forward(kernels, h: Tensor, fc1, fc2, activation_fn, residual: Tensor) -> Tensor:
    """The FFN sublayer on packed weights: fc2(activation(fc1(h))) + residual; ReLU fused into fc1."""
    relu = activation_fn is F.relu
    hidden = kernels.linear(h, fc1, activation="relu" if relu else None)
    if not relu:
        hidden = activation_fn(hidden)
    return kernels.linear(hidden, fc2, residual=residual)
