"""Beam search over fixed-shape buffers for one `rfa_transformer`: fairseq's SequenceGenerator with
BeamSearch, step for step, with the batch's shape changing at most log2(N) times, and on CUDA the whole
step (decoder layers, log-softmax, masks, candidates, finalization, beam reorder) one CUDA graph.

An RFA decoder's state has a fixed size, so nothing in a step needs to change shape when sentences
finish: finished sentences stay in the batch, masked (they finalize nothing more), and every buffer of
the search (tokens, cumulative scores, candidates, the finalized hypotheses) keeps its shape from step to
step. With the torch and CUDA steps, which decode every row of the batch, the batch halves when half its sentences
have finished (their rows would otherwise cost every later step: one long sentence keeps a batch going), in place:
the kept sentences move to the front of the same buffers. On CUDA the batch halves to the sizes ceil(N / 2^j) of the largest
batch's N, finished sentences filling the places the unfinished ones leave, so that every batch runs the same few
shapes and replays the graphs the first batches captured (uncaptured steps run the same shapes: the same
arithmetic). A step reads the step number from a device tensor and writes the
finalized hypotheses into device buffers (`_Search`), so it reads nothing back to the host: on CUDA it is
captured once per (rows, source-length bucket, buffer parity) and replayed at every later step of every
batch of that shape (the buffers are the generator's, kept across batches). The host learns which
sentences finished one step late (a copy into pinned memory that the next step overlaps), which is all
it needs to stop or halve; on the CPU it reads them at once.

On the CPU the whole step is native (the decoding runtime's program, cpu/csrc/native_search.cpp: the decoder's
layers, the log-softmax fused with the choice of the candidates, finalization and the reorder), and one call runs
a batch's every step, without Python (or the GIL) between them; each step decodes only the places still
translating (their rows packed for the products, their states kept at their places' rows), so a finished sentence
costs nothing more and the batch never halves (halving in Python cost about 3 % of a batch's time). At N
threads the CLIs' batches come N at a time (batch_groups.py: CTranslate2's inter_threads) and each is decoded, encoder
and search, on its own thread, as one thread decodes it alone; a batch of its own is split into N parts where each
part keeps enough sentences (`parts_for`; --rfa-decode-parts overrides both). Each part is the same search on fewer
sentences.

The arithmetic follows SequenceGenerator._generate and search.BeamSearch.step operation by operation
(same masks, same fp32 additions, same top-k over 2 * beam candidates, same finalization and length
normalization), so hypotheses and scores agree with fairseq's. Shapes: N places (sentences still in the
batch), K beams, R = N * K rows, V the vocabulary, L the token buffer's length (max_len + 2).
"""
import ctypes
import logging
import math
import queue
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn
from fairseq.ngram_repeat_block import NGramRepeatBlock

from ..modules.decoding import BatchRows, CUDAGraphBackend, DecodingState, StepGraphs
from .joined_sample import user_batches

logger = logging.getLogger(__name__)

SOURCE_BUCKET = 16  # CUDA: cross-attention K/V padded to a multiple of this length (batches share graphs)
OUTPUT_BUCKET = 64  # CUDA, with --rfa-shortlist: a batch's output columns padded to a multiple of this (likewise)
MAX_VIEW_SETS = 256  # a lane keeps its search's views for this many (places, length) shapes at most
MIN_PART_SENTENCES = 32  # auto: parts of at least this many sentences (smaller ones lose to intra-op threads: docs/benchmarks.md)


def parts_at_once(requested: int) -> int:
    """How many parts (joined user batches, or parts of one batch) are decoded at once, one thread each:
    --rfa-decode-parts when set (> 0), else torch's threads."""
    return requested or torch.get_num_threads()


def parts_for(sentences: int, threads: int, requested: int) -> int:
    """How many parts of a batch of `sentences` are decoded at once, one thread each: `requested` when > 0
    (--rfa-decode-parts), else one per thread while each part keeps MIN_PART_SENTENCES sentences."""
    if requested > 0:
        return max(1, min(requested, sentences))
    return max(1, min(threads, sentences // MIN_PART_SENTENCES))


def return_freed_memory() -> None:
    """Give the C library's freed heap back to the system (glibc's malloc_trim; nothing where the library has none).
    After a model is loaded and its weights packed, the heap holds tens of MB freed on the way (the checkpoint's
    state dict, the model's initial weights, packing's temporaries) that glibc keeps for later allocations and
    decoding never reuses whole: resident memory stays that much higher for the process's life (docs/benchmarks.md).
    Once, not per batch: the pages decoding frees and takes again would fault back in at every batch."""
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is not None:
        trim(0)


class PartThreads:
    """The threads that decode the parts of a batch at once: `size` of them, each set up once as it starts: no autograd
    (grad mode is per thread in torch) and OpenMP and MKL teams of one thread (`limit_thread`, the C++ module's
    limit_this_thread), for the native steps and for the torch operations of its search alike; teams of the process's
    threads in each part would spin on the other part's core. Shut down by close(), or when its owner drops it."""

    def __init__(self, size: int, limit_thread):
        self.size = size
        self._executor = ThreadPoolExecutor(max_workers=size, thread_name_prefix="rfa-decode-part",
                                            initializer=self._start_thread, initargs=(limit_thread,))
        self._finalizer = weakref.finalize(self, self._executor.shutdown, wait=False)

    @staticmethod
    def _start_thread(limit_thread) -> None:
        torch.set_grad_enabled(False)
        limit_thread(1)

    def map(self, fn, items):
        return self._executor.map(fn, items)

    def close(self) -> None:
        self._finalizer()


class SearchBuffers:
    """The search's named buffers, grown on demand and kept across batches (a batch of a shape seen before runs on
    the same addresses: its CUDA graphs replay); `generation` is bumped whenever one is (re)allocated."""

    def __init__(self):
        self.buffers: Dict[str, Tensor] = {}
        self.generation = 0

    def take(self, name: str, shape: Tuple[int, ...], dtype: torch.dtype, device) -> Tensor:
        numel = math.prod(shape)
        buf = self.buffers.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype or buf.device != device:
            buf = self.buffers[name] = torch.empty(max(numel, 1), dtype=dtype, device=device)
            self.generation += 1
        return buf[:numel].view(shape)


class Lane:
    """What one part of a batch decodes on, kept across batches: its decoding state and the search's buffers (the
    host's pinned copies of the finished flags on CUDA)."""

    def __init__(self):
        self.state = DecodingState()
        self.buffers = SearchBuffers()
        self.host_flags: List[Tensor] = []  # CUDA: two pinned (>= N,) bool buffers the steps copy `finished` into
        self.views: Dict[tuple, Dict[str, Tensor]] = {}  # _Search's views of the buffers, per (N, L, V, native, generation)


class StaticBeamSearchGenerator(nn.Module):
    """SequenceGenerator's beam search for a single RFATransformerModel (`generate` returns what
    SequenceGenerator.generate returns). Built by `generation.build_generator` only for options it
    serves: plain beam search, lenpen, min/max length, unkpen, no-repeat n-grams, prefix tokens.
    cuda_graphs=False runs every CUDA step uncaptured (--no-rfa-cuda-graphs: the graphs' reference). parts: the
    parts a CPU batch is split into, one thread each (--rfa-decode-parts; 0: parts_for decides)."""

    # device types where reading the finished flags back would wait for the device: the host reads each step's one
    # step later; and where K/V are padded to SOURCE_BUCKET and a halving batch keeps the sizes of _halved_size
    # (graphs shared by nearby source lengths and by every batch; the uncaptured steps run the same shapes)
    LAGGED_READS_ON = ("cuda",)
    BUCKETED_ON = ("cuda",)
    GRAPHS_ON = ("cuda",)  # device types whose steps are captured as graphs (cuda_graphs=True)

    def __init__(self, model, tgt_dict, beam_size=1, max_len_a=0, max_len_b=200, max_len=0, min_len=1,
                 normalize_scores=True, len_penalty=1.0, unk_penalty=0.0, no_repeat_ngram_size=0,
                 symbols_to_strip_from_output=None, cuda_graphs: bool = True, parts: int = 0):
        super().__init__()
        self.model = model
        self.tgt_dict = tgt_dict
        self.pad, self.unk, self.eos = tgt_dict.pad(), tgt_dict.unk(), tgt_dict.eos()
        self.symbols_to_strip_from_output = set(symbols_to_strip_from_output or ()) | {self.eos}
        self.vocab_size = len(tgt_dict)
        self.beam_size = min(beam_size, self.vocab_size - 1)  # pad is never chosen (as SequenceGenerator)
        self.max_len_a, self.max_len_b, self.min_len = max_len_a, max_len_b, min_len
        self.max_len = max_len or model.max_decoder_positions()
        self.normalize_scores, self.len_penalty, self.unk_penalty = normalize_scores, len_penalty, unk_penalty
        self.repeat_ngram_blocker = NGramRepeatBlock(no_repeat_ngram_size) if no_repeat_ngram_size > 0 else None
        self.cuda_graphs = cuda_graphs
        self.parts = int(parts)
        self.model.eval()
        # kept across batches: a batch of a shape seen before runs on the same addresses (and graphs)
        self.lanes: List[Lane] = [Lane()]  # lane 0 decodes an unsplit batch; lanes 1.. the parts of a split one
        self.part_lanes: List[Lane] = []
        self._pool: Optional[PartThreads] = None  # the parts' threads, owned (and shut down) by this generator
        self._logged_parts: set = set()
        self.graphs: Optional[StepGraphs] = None
        self._graph_generations = None  # the buffers' generations the graphs were captured at
        self._largest_batch = 1  # the sentences of the largest batch so far: the sizes a batch halves to derive from it
        self._positions: Optional[Tuple[object, Optional[Tensor]]] = None  # (runtime, its step positions so far)
        self._prepare_weights()

    def close(self) -> None:
        """Shut the parts' threads down (also when the generator is collected); a later batch starts them again."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    @torch.no_grad()
    def _prepare_weights(self) -> None:
        """One batch of one one-token sentence, one step: the layers pack their weights for the kernels now, as
        the generator is built (CTranslate2 prepares its weights when it loads a model), not inside the first
        batch's translation; skipped where an earlier generator of the model did it for the same weights (hub.translate
        builds one per call)."""
        if not self.model.decoder.has_decoding_runtime():
            device = self.model.decoder.embed_tokens.weight.device
            src_tokens = torch.full((1, 1), self.eos, dtype=torch.long, device=device)
            sample = {"net_input": {"src_tokens": src_tokens,
                                    "src_lengths": torch.ones(1, dtype=torch.long, device=device)}}
            self.generate([self.model], sample, max_steps=1)
            return_freed_memory()
        if self.parts > 0 and self.model.decoder.decoding_runtime().program is None:
            logger.info(f"rfa_fairseq: --rfa-decode-parts {self.parts} has no effect here: batches are split into "
                        f"parts by the native step only (the CPU in fp32), not by the torch step that runs here")

    def step_positions(self, runtime, length: int) -> Optional[Tensor]:
        """(length, C) the decoder's step_positions, computed once per runtime for the longest length so far (a
        batch's are a prefix of them: position embeddings depend on the position only), or None."""
        cached = self._positions
        if cached is None or cached[0] is not runtime or (cached[1] is not None and cached[1].size(0) < length):
            self._positions = cached = (runtime, self.model.decoder.step_positions(max(length, min(128, self.max_len))))
        return None if cached[1] is None else cached[1][:length]

    def _graphs_for(self, lane: Lane, device) -> Optional[StepGraphs]:
        """The CUDA graphs of the steps on `device` (None: every step as it is), dropped when a buffer they read
        moved (a larger batch, another runtime): a graph replays the addresses it captured."""
        if device.type not in self.GRAPHS_ON or not self.cuda_graphs:
            return None
        generations = (id(lane.state.runtime), lane.state.generation, lane.buffers.generation)
        if self.graphs is None:
            self.graphs = StepGraphs(CUDAGraphBackend(device))
        elif generations != self._graph_generations:
            self.graphs.clear()
        self._graph_generations = generations
        return self.graphs

    def _halved_size(self, unfinished: int) -> int:
        """The places a batch keeps when it halves on a BUCKETED_ON device (CUDA): the smallest of ceil(largest batch / 2^j) that holds
        its `unfinished` sentences, the rest filled with finished ones (masked rows: they finalize nothing). The
        sizes are then the same in every batch, so their graphs are captured once and replayed in every batch after;
        keeping only the unfinished would make new shapes, and new captures, in almost every batch (a capture costs
        about two uncaptured steps)."""
        size = self._largest_batch
        while size > 1 and (size + 1) // 2 >= unfinished:
            size = (size + 1) // 2
        return size

    @staticmethod
    def host_flags(lane: Lane, N: int) -> List[Tensor]:
        """Two pinned host buffers of (N,) bools, the same ones for every batch (a graph copies into them)."""
        if not lane.host_flags or lane.host_flags[0].numel() < N:
            pinned = torch.cuda.is_available()  # the device's copies into them then overlap the next step
            lane.host_flags = [torch.empty(N, dtype=torch.bool, pin_memory=pinned) for _ in range(2)]
            lane.buffers.generation += 1  # graphs that copy into the old ones are stale
        return [flags[:N] for flags in lane.host_flags]

    @torch.no_grad()
    def generate(self, models, sample: Dict[str, Dict[str, Tensor]], prefix_tokens: Optional[Tensor] = None,
                 constraints: Optional[Tensor] = None, bos_token: Optional[int] = None,
                 max_steps: Optional[int] = None) -> List[List[Dict[str, Tensor]]]:
        """SequenceGenerator.generate's signature and result (`models` is ignored: the model is fixed).
        max_steps stops the search early (warming the kernels only)."""
        if constraints is not None:
            raise NotImplementedError("the static beam search takes no constraints (build_generator falls back)")
        net_input = sample["net_input"]
        runtime = self.model.decoder.decoding_runtime()
        shortlist = self.model.decoder.shortlist()  # --rfa-shortlist: each batch decodes over its union's columns
        bos = self.eos if bos_token is None else bos_token
        parts = self._parts(sample, runtime, max_steps)

        def union(src_tokens, prefix):  # a batch's output vocabulary: its sources' candidates, its prefix tokens
            return None if shortlist is None else shortlist.union(src_tokens, prefix)

        if parts is None:
            return self._decode(self.lanes[0], runtime, net_input, prefix_tokens, bos, max_steps,
                                union(net_input["src_tokens"], prefix_tokens))
        # the user's batch is what a union is made of: each of a joined batch's own, and one batch split into parts
        # decodes every part over the whole batch's union (its hypotheses then those of one thread)
        whole = None if shortlist is None or user_batches(sample) is not None else union(net_input["src_tokens"],
                                                                                          prefix_tokens)
        threads = min(len(parts), parts_at_once(self.parts))
        while len(self.part_lanes) < threads:
            self.part_lanes.append(Lane())
        if self._pool is None or self._pool.size != threads:
            if self._pool is not None:
                self._pool.close()
            self._pool = PartThreads(threads, runtime.kernels.ext.limit_this_thread)
        free_lanes: "queue.SimpleQueue[Lane]" = queue.SimpleQueue()  # a lane serves one part at a time
        for lane in self.part_lanes[:threads]:
            free_lanes.put(lane)
        N, S = net_input["src_tokens"].shape[:2]
        sentences = list(range(N))
        # each part's sentences, by their place in the batch
        members = [sentences[rows] if isinstance(rows, slice) else rows.tolist() for rows, _ in parts]

        def decode_part(i: int):  # on a part thread: its encoder pass too
            rows, columns = parts[i]
            part_input = {name: (value[rows][:, columns] if name == "src_tokens" else value[rows]).contiguous()
                          for name, value in net_input.items() if name != "prev_output_tokens" and value is not None}
            part_prefix = prefix_tokens[rows].contiguous() if prefix_tokens is not None else None
            vocabulary = whole if whole is not None else union(part_input["src_tokens"], part_prefix)
            lane = free_lanes.get()
            try:
                return self._decode(lane, runtime, part_input, part_prefix, bos, None, vocabulary)
            finally:
                free_lanes.put(lane)

        def size(i: int) -> int:  # a part's work, about: its sentences times their width
            return len(members[i]) * len(range(S)[parts[i][1]])

        # the threads take the parts in turn, largest first, so that they finish about together
        order = sorted(range(len(parts)), key=size, reverse=True)
        finalized: List[List[Dict[str, Tensor]]] = [[] for _ in range(N)]
        for i, hypos in zip(order, self._pool.map(decode_part, order)):
            for n, sentence in zip(members[i], hypos):
                finalized[n] = sentence
        return finalized

    def _parts(self, sample: Dict[str, Dict[str, Tensor]], runtime,
               max_steps: Optional[int]) -> Optional[List[Tuple[object, slice]]]:
        """The parts of a batch decoded at once, one thread each, as (rows, columns) of its source tokens: the user's
        batches of a joined batch (joined_sample.user_batches), else its sentences dealt out in turn to parts_for
        parts (a batch is sorted by length: each part gets its share of long and short ones). None: the batch in
        one piece, on the process's threads (the torch step, or a warm-up)."""
        if runtime.program is None or max_steps is not None:
            return None
        joined = user_batches(sample)
        if joined is not None:
            return joined
        src_tokens = sample["net_input"]["src_tokens"]
        N = src_tokens.size(0)
        parts = parts_for(N, torch.get_num_threads(), self.parts)
        if parts == 1:
            return None
        if parts not in self._logged_parts:  # once per part count: what the split does is visible in the log
            self._logged_parts.add(parts)
            logger.info(f"rfa_fairseq: a batch of {N} sentences decoded in {parts} parts at once, one thread each")
        return [(torch.arange(i, N, parts, device=src_tokens.device), slice(None)) for i in range(parts)]

    def _decode(self, lane: Lane, runtime, net_input: Dict[str, Tensor], prefix_tokens: Optional[Tensor], bos: int,
                max_steps: Optional[int], vocabulary: Optional[Tensor] = None) -> List[List[Dict[str, Tensor]]]:
        """The encoder pass and the beam search of the batch `net_input` on `lane` (over the target ids `vocabulary`,
        a shortlist's union, or every token: None)."""
        N, src_len = net_input["src_tokens"].shape[:2]
        max_len = min(int(self.max_len_a * src_len + self.max_len_b), self.max_len - 1)
        assert self.min_len <= max_len, "min_len cannot be larger than max_len, please adjust these!"
        encoder_out = self.model.encoder.forward_torchscript(net_input)
        key, pad = self.model.decoder.encoder_keys(encoder_out)  # once per sentence: no copies for the beams
        return self._search(lane, runtime, key, pad, N, src_len, max_len, bos, prefix_tokens, vocabulary, max_steps)

    def _search(self, lane: Lane, runtime, key: Optional[Tensor], pad: Optional[Tensor], N: int, src_len: int,
                max_len: int, bos: int, prefix_tokens: Optional[Tensor], vocabulary: Optional[Tensor],
                max_steps: Optional[int]):
        """The beam search of N sentences on `lane`: key (S, N, C) their encoder output (or None), pad (N, S) or None;
        vocabulary: the sorted target ids (U,) its steps score (the batch's output projection their rows, its
        candidates mapped back to ids), None: every token. -> their finalized hypotheses, best first. Where the runtime has the native program (the CPU) the search is
        native, every step of the batch in one call and every option with it (prefix tokens, n-gram blocking): each
        step decodes only the places still translating, so the batch never shrinks. Elsewhere the torch search runs
        (CUDA, captured as graphs; the torch step): every row is decoded, so the batch halves as sentences finish.
        This is the one place that decides how finished sentences leave a batch."""
        K, device = self.beam_size, runtime.device
        self._largest_batch = max(self._largest_batch, N)
        bucketed = device.type in self.BUCKETED_ON  # on the CPU K/V keep their length (no padded positions to compute)
        source_len = -(-src_len // SOURCE_BUCKET) * SOURCE_BUCKET if bucketed else src_len
        buffer_len = max_len
        if bucketed:  # the longest max_len of the bucket's source lengths: one token buffer length per bucket
            buffer_len = max(buffer_len, min(int(self.max_len_a * source_len + self.max_len_b), self.max_len - 1))

        # the native search's rows read their own place's states only: one buffer, updated in place
        state = lane.state.start(runtime, N * K, K, key, pad, source_len=source_len if key is not None else None,
                                 state_buffers=1 if runtime.program is not None else 2)
        state.restrict_output(vocabulary, bucket=OUTPUT_BUCKET if bucketed else 1)
        rows = state.batch  # the batch's one account of its rows, the decoding state's and the search's
        search = _Search(self, lane, state, buffer_len, bos, device, lagged=device.type in self.LAGGED_READS_ON,
                         prefix_tokens=prefix_tokens)
        finalized: List[List[Dict[str, Tensor]]] = [[] for _ in range(N)]
        last_step = max_len if max_steps is None else min(max_len, max_steps - 1)
        if runtime.program is not None:
            run = runtime.program.search_steps(state.native_batch(), search.native, 0, rows.parity, rows.first,
                                               last_step, max_len)
            rows.steps_ran(run.steps)
            if run.last_step < last_step and run.finished < N:
                raise RuntimeError(f"the native search stopped at step {run.last_step} of {last_step} with "
                                   f"{run.finished} of {N} places finished")
            search.collect(finalized, list(range(N)), places=range(N))
        else:
            self._search_torch(lane, search, state, source_len, buffer_len, max_len, last_step, prefix_tokens,
                               finalized)
        for n, hypos in enumerate(finalized):  # best first, as SequenceGenerator sorts them
            scores = torch.tensor([float(h["score"].item()) for h in hypos])
            _, best_first = torch.sort(scores, descending=True)
            finalized[n] = [hypos[i] for i in best_first]
        return finalized

    def _search_torch(self, lane: Lane, search: "_Search", state: DecodingState, source_len: int, buffer_len: int,
                      max_len: int, last_step: int, prefix_tokens: Optional[Tensor],
                      finalized: List[List[Dict[str, Tensor]]]) -> None:
        """The torch search: one step at a time (on CUDA the plain steps replayed as graphs), the batch halving when
        half its places have finished."""
        device, rows = search.device, state.batch
        graphs = self._graphs_for(lane, device)
        bucketed = device.type in self.BUCKETED_ON
        sentence_ids = list(range(rows.sentences))  # the batch's sentence at each place of the search (places only halve)
        decided_at = -1  # flags of steps launched before the last halving describe other places: not read
        if prefix_tokens is not None:
            prefix_tokens = search.columns_of(prefix_tokens)  # the forced tokens' columns of the logits
        step = -1
        while step < last_step:  # steps 0 .. max_len: one extra step for EOS
            step += 1
            prefix = prefix_tokens is not None and step < prefix_tokens.size(1) and step < max_len
            first, last = step == 0, step >= max_len
            plain = not (first or last or prefix or self.repeat_ngram_blocker is not None)
            if graphs is not None and plain:
                graphs = self._graphs_for(lane, device)  # a step that allocated (a new shape) makes the graphs stale
                shape = (rows.sentences, source_len, buffer_len, search.V, search.mask_columns)
                graphs.run(shape + (rows.parity,), shape, lambda: self._step(search, state, step, False, False, None))
            else:
                self._step(search, state, step, first=first, last=last, prefix_tokens=prefix_tokens if prefix else None)
            search.after_step(state, step)
            if step >= last_step:
                break
            flags = search.finished_at(step - 1 if search.lagged else step, decided_at)
            if flags is None:
                continue
            unfinished = (~flags).nonzero().squeeze(1)  # (N',) places still translating
            if unfinished.numel() == 0:
                break
            if 2 * unfinished.numel() <= rows.sentences:
                # half the places finished: halve the batch. Finished sentences otherwise cost every later
                # step all their rows (fairseq-generate was 17-35 % slower than SequenceGenerator on Multi30k
                # without this); halving keeps the shapes to log2(N) + 1 sizes
                finished_places = flags.nonzero().squeeze(1)
                search.collect(finalized, sentence_ids, places=finished_places.tolist())  # dropped or kept as fillers
                fillers = finished_places[: self._halved_size(unfinished.numel()) - unfinished.numel()] if bucketed else None
                kept = torch.cat([unfinished, fillers]) if fillers is not None else unfinished
                sentence_ids = [sentence_ids[n] for n in unfinished.tolist()] + [None] * (kept.numel() - unfinished.numel())
                kept = kept.to(device)
                search.keep_sentences(state, kept)
                if prefix_tokens is not None:
                    prefix_tokens = prefix_tokens.index_select(0, kept)
                decided_at = step
        search.collect(finalized, sentence_ids, places=range(rows.sentences))

    def _step(self, search: "_Search", state: DecodingState, step: int, first: bool, last: bool,
              prefix_tokens: Optional[Tensor]):
        """One step of the torch search on the device, reading the step number from the search's step tensor (a CUDA
        graph captures it whole when first, last and prefix_tokens are off: they are the host's only say). -> no
        outputs: every result is in the search's buffers."""
        v, N, K = search.views, state.batch.sentences, self.beam_size
        R, t = N * K, v.step  # t: (1,) the step number on the device
        tokens = torch.index_select(search.tokens, 1, t).view(R)  # (R,) the last tokens
        positions = torch.index_select(search.positions, 0, t) if search.positions is not None else None  # (1, C)
        # pad is never chosen (its log-probability is -inf), so no input is padding
        logits, _ = state.compute(tokens, positions, need_weights=False, padded_inputs=False)  # (R, V)
        # fairseq's EnsembleModel.forward_decoder for one model at temperature 1: log-softmax in fp32 (over the
        # batch's vocabulary's columns with a shortlist: the masks below name their tokens' columns)
        lprobs = torch.log_softmax(logits.float(), dim=-1, out=v.lprobs)
        eos, pad, unk = search.mask_columns
        lprobs[:, pad] = -math.inf  # NaN: -inf in the candidates kernel
        lprobs[:, unk] -= self.unk_penalty
        if last:  # only EOS is left
            lprobs[:, : eos] = -math.inf
            lprobs[:, eos + 1:] = -math.inf
        elif prefix_tokens is not None:
            self._force_prefix(lprobs, step, prefix_tokens, search)
        else:
            lprobs[:, eos] += search.eos_bias.index_select(0, t)  # -inf before the minimum length
        if self.repeat_ngram_blocker is not None:
            # the tokens so far (fairseq's CUDA kernel reads them so; its CPU fallback, handed the whole buffer,
            # compares the buffer's padding and blocks nothing)
            lprobs = search.on_token_ids(
                lprobs, lambda full: self.repeat_ngram_blocker(search.tokens[:, : step + 1], full, N, K, step))

        cand_scores, cand_tokens, cand_rows = search.candidates(lprobs, first, state.kernels)  # (N, 2K) each
        eos_mask = cand_tokens.eq(self.eos) & cand_scores.ne(-math.inf)  # (N, 2K)
        eos_mask[:, :K] &= ~v.cands_to_ignore
        eos_mask &= ~v.finished.unsqueeze(1)  # finished sentences stay in the batch, finalizing nothing
        search.finalize(eos_mask[:, :K], cand_rows[:, :K], cand_scores[:, :K], last)
        search.advance(eos_mask, cand_scores, cand_tokens, cand_rows)
        return ()

    def _force_prefix(self, lprobs: Tensor, step: int, prefix_tokens: Tensor, search: "_Search") -> None:
        """SequenceGenerator._prefix_tokens over the whole batch: a row whose prefix has a token at `step`
        may only choose it; a sentence whose prefix ends (EOS) gets its first beam copied to every beam.
        prefix_tokens: the prefix's columns of the logits (search.columns_of)."""
        K = self.beam_size
        eos, pad, _ = search.mask_columns
        forced = prefix_tokens[:, step].repeat_interleave(K).unsqueeze(1)  # (R, 1)
        forced_lprobs = lprobs.gather(1, forced)
        lprobs.masked_fill_(forced.ne(pad), -math.inf)
        lprobs.scatter_(1, forced, forced_lprobs)  # rows without a prefix token scatter pad's -inf onto itself
        ends = forced.view(-1, K)[:, 0].eq(eos)  # (N,)
        if bool(ends.any()):
            for tensor in (search.tokens, search.scores, lprobs):
                beams = tensor.view(-1, K, tensor.size(-1))
                beams[ends] = beams[ends][:, :1, :]


@dataclass
class SearchViews:
    """One batch's search buffers for N places of K beams (R = N * K rows, L tokens a row): prefixes of its lane's
    workspace (SearchBuffers), made once per (N, L, V, the workspace's generation). The native search gets them in its
    record (NativeSearchRecord)."""

    token_pair: List[Tensor]  # two (R, L) int64, used in turn: BatchRows.parity names the one the next step reads
    score_pair: List[Tensor]  # two (R, L - 1) fp32 cumulative scores, likewise
    lprobs: Optional[Tensor]  # (R, V) fp32: the torch step's log-probabilities (V: the logits' columns); None for the
    # native search (its log-softmax is fused into the choice of the candidates: a batch of 32 at 32k entries saves 16 MB)
    cand_scores: Tensor  # (N * 2K,) fp32: the candidates (the best 2K per place)
    cand_indices: Tensor  # (N * 2K,) int64: beam * V + token
    row_offsets: Tensor  # (N, 1) int64: n * K
    cands_to_ignore: Tensor  # (N, K) bool: the beams continued with an EOS candidate (ignored at the next step)
    finished: Tensor  # (N,) bool
    fin_count: Tensor  # (N,) int64: each place's finalized hypotheses
    fin_tokens: Tensor  # (R + 1, L) int64: the finalized hypotheses (K slots a place, and the trash slot after them)
    fin_scores: Tensor  # (R + 1, L - 1) fp32 cumulative, EOS's at its step
    fin_steps: Tensor  # (R + 1,) int64: the step of each one's EOS
    step: Tensor  # (1,) int64: the step number on the device
    order: Tensor  # (R,) int64: the rows' order buffer (BatchRows.order: the state row each row continues)
    step_rows: Tensor  # (L,) int64: the rows each native step decoded (the places still translating x K; profiles)


@dataclass(frozen=True)
class NativeSearchRecord:
    """What the native search reads of one batch's search, declared once: cpu/csrc/native_search.cpp's NativeSearch
    is made from exactly these fields (`NativeSearch.fields()`) as the search is created, and refuses a record with a
    field missing or one it does not declare, naming it. The buffers are the search's views (SearchViews)."""

    token_pair: List[Tensor]
    score_pair: List[Tensor]
    cand_scores: Tensor
    cand_indices: Tensor
    cands_to_ignore: Tensor
    finished: Tensor
    fin_count: Tensor
    fin_tokens: Tensor
    fin_scores: Tensor
    fin_steps: Tensor
    order: Tensor
    step: Tensor
    step_rows: Tensor
    eos_bias: Tensor  # (>= max_len + 1,) fp32: -inf on EOS before the minimum length
    positions: Optional[Tensor]  # (>= max_len + 1, C) the steps' position embeddings, or None
    prefix_tokens: Optional[Tensor]  # (N, P) int64 (pad: none at that step), or None
    vocabulary: Optional[Tensor]  # (U,) int64 sorted target ids, the logits' columns (--rfa-shortlist), or None: all
    no_repeat_ngram_size: int  # 0: off
    sentences: int  # N places
    beam: int  # K
    eos: int
    pad: int
    unk: int
    unk_penalty: float

    @classmethod
    def of(cls, search: "_Search") -> "NativeSearchRecord":
        buffers = {name: getattr(search.views, name) for name in cls.__dataclass_fields__
                   if name in SearchViews.__dataclass_fields__}
        return cls(**buffers, eos_bias=search.eos_bias, positions=search.positions, prefix_tokens=search.prefix_tokens,
                   vocabulary=None if search.output is None else search.output.ids,
                   no_repeat_ngram_size=search.no_repeat_ngram_size, sentences=search.rows.sentences, beam=search.K,
                   eos=search.eos, pad=search.pad, unk=search.unk, unk_penalty=search.unk_penalty)


class _Search:
    """One batch's search in the generator's workspace (the same buffers for every batch of the same shape): its
    buffers (`views`: tokens and cumulative scores, two of each used in turn, candidates, the finalized hypotheses
    per place, the step number, the beam order), the rows' account shared with the decoding state (`rows`, BatchRows:
    places, beam, parity), the per-batch constants (eos_bias, positions, prefix tokens, the n-gram size), the finished
    flags' copies for the host on CUDA, and where the runtime has the native program the native search made from its
    record (`native`, NativeSearchRecord), as the search is created."""

    def __init__(self, gen: StaticBeamSearchGenerator, lane: Lane, state: DecodingState, max_len: int, bos: int,
                 device, lagged: bool, prefix_tokens: Optional[Tensor] = None):
        self.gen, self.lane, self.state, self.ws, self.device = gen, lane, state, lane.buffers, device
        self.rows: BatchRows = state.batch
        # V: the logits' columns, the batch's output vocabulary's (--rfa-shortlist: state.output) or every token's
        self.output = state.output
        self.K, self.L = gen.beam_size, max_len + 2  # +2: BOS and EOS
        self.V = gen.vocab_size if self.output is None else self.output.columns
        self.eos, self.pad, self.unk, self.unk_penalty = gen.eos, gen.pad, gen.unk, float(gen.unk_penalty)
        # the columns of the tokens the torch step masks (EOS, pad, unk): their ids without a vocabulary
        self.mask_columns = (self.eos, self.pad, self.unk) if self.output is None else tuple(
            self.output.columns_of(torch.tensor([self.eos, self.pad, self.unk], device=device)).tolist())
        self.no_repeat_ngram_size = gen.repeat_ngram_blocker.no_repeat_ngram_size if gen.repeat_ngram_blocker else 0
        self.prefix_tokens = None if prefix_tokens is None else prefix_tokens.to(device=device, dtype=torch.long).contiguous()
        self.cand_size = 2 * self.K  # 2 x beam in case half are EOS (SequenceGenerator)
        self.lagged = lagged  # the host reads a step's flags one step later (CUDA: no wait for the device)
        self.events = [torch.cuda.Event() for _ in range(2)] if lagged and device.type == "cuda" else None
        self.finished_host: List[Tensor] = []
        self.views = self._views(self.rows.sentences)
        v = self.views
        for tokens in v.token_pair:
            tokens.fill_(gen.pad)
            tokens[:, 0] = bos
        for scores in v.score_pair:
            scores.zero_()
        v.cands_to_ignore.zero_()
        v.finished.zero_()
        v.fin_count.zero_()
        v.step.zero_()
        take = self.ws.take
        self.cand_offsets = torch.arange(self.cand_size, out=take("cand_offsets", (self.cand_size,), torch.long, device))
        # -inf on EOS before the minimum length
        self.eos_bias = take("eos_bias", (max_len + 1,), torch.float32, device).zero_()
        self.eos_bias[: gen.min_len] = -math.inf
        positions = gen.step_positions(state.runtime, max_len + 1)  # (max_len + 1, C)
        self.positions = positions
        if positions is not None and device.type in gen.GRAPHS_ON:  # a buffer of the workspace: graphs replay it
            self.positions = take("positions", tuple(positions.shape), positions.dtype, device).copy_(positions)
        self.rows.use_order_buffer(v.order)  # the causal layers read the pending beam order here
        self.native = self._native_search()

    def _views(self, N: int) -> SearchViews:
        """The buffers for N places (prefixes of the workspace's: halving keeps their addresses), made once per (N, L, V)
        and kept while the workspace's buffers stay (a batch of one sentence sets up its search in microseconds)."""
        native = self.state.runtime.program is not None  # the native search has no lprobs buffer
        key = (N, self.L, self.V, native, self.ws.generation)
        views = self.lane.views.get(key)
        if views is None:
            views = self._make_views(N)
            if len(self.lane.views) >= MAX_VIEW_SETS or any(key[-1] != self.ws.generation for key in self.lane.views):
                self.lane.views.clear()  # views of buffers since replaced, or too many shapes to keep
            self.lane.views[key] = views
        if self.lagged:
            self.finished_host = self.gen.host_flags(self.lane, N)
        return views

    def _make_views(self, N: int) -> SearchViews:
        K, L, device, take = self.K, self.L, self.device, self.ws.take
        R, slots = N * K, N * K + 1
        return SearchViews(
            token_pair=[take(f"tokens{i}", (R, L), torch.long, device) for i in range(2)],
            score_pair=[take(f"scores{i}", (R, L - 1), torch.float32, device) for i in range(2)],
            lprobs=None if self.state.runtime.program is not None else take("lprobs", (R, self.V), torch.float32, device),
            cand_scores=take("cand_scores", (N * self.cand_size,), torch.float32, device),
            cand_indices=take("cand_indices", (N * self.cand_size,), torch.long, device),
            row_offsets=torch.arange(N, out=take("row_offsets", (N,), torch.long, device)).mul_(K).unsqueeze(1),
            cands_to_ignore=take("cands_to_ignore", (N, K), torch.bool, device),
            finished=take("finished", (N,), torch.bool, device),
            fin_count=take("fin_count", (N,), torch.long, device),
            fin_tokens=take("fin_tokens", (slots, L), torch.long, device),
            fin_scores=take("fin_scores", (slots, L - 1), torch.float32, device),  # cumulative, EOS's at its step
            fin_steps=take("fin_steps", (slots,), torch.long, device),
            step=take("step", (1,), torch.long, device),
            order=take("order", (R,), torch.long, device),
            step_rows=take("step_rows", (L,), torch.long, device),
        )

    def columns_of(self, tokens: Tensor) -> Tensor:
        """Target ids as columns of the logits (the same ids without a vocabulary)."""
        return tokens if self.output is None else self.output.columns_of(tokens)

    def on_token_ids(self, lprobs: Tensor, mask) -> Tensor:
        """mask(lprobs over every token id) -> its result over the logits' columns: a mask that names token ids (fairseq's
        n-gram blocker) applied to a vocabulary's columns through a (R, full vocabulary) copy, -inf outside it."""
        if self.output is None:
            return mask(lprobs)
        out = self.output
        full = out.full_logits(lprobs, self.gen.vocab_size)
        masked = mask(full)
        return masked.index_select(1, out.ids).masked_fill_(
            torch.arange(out.columns, device=lprobs.device).ge(out.size), -math.inf)

    def _native_search(self):
        """The native program's NativeSearch of this search's record (NativeSearchRecord), or None where the runtime
        has no native program."""
        if self.state.runtime.program is None:
            return None
        return self.state.runtime.kernels.ext.NativeSearch(NativeSearchRecord.of(self))

    @property
    def trash(self) -> int:
        """The finalized slot after the places', which takes what is not kept."""
        return self.rows.sentences * self.K

    @property
    def tokens(self) -> Tensor:
        return self.views.token_pair[self.rows.parity]

    @property
    def scores(self) -> Tensor:
        return self.views.score_pair[self.rows.parity]

    def candidates(self, lprobs: Tensor, first: bool, kernels):
        """search.BeamSearch.step: the top 2K (cumulative score, token, row) per sentence, best first
        (kernels.beam_candidates). lprobs (R, V)."""
        v, N, K, V = self.views, self.rows.sentences, self.K, self.V
        k = min(self.cand_size, (V if first else K * V) - 1)  # -1: never pad (SequenceGenerator)
        cand_scores, flat = v.cand_scores[: N * k].view(N, k), v.cand_indices[: N * k].view(N, k)
        prev_scores = None if first else torch.index_select(self.scores, 1, v.step - 1).view(-1)  # (R,)
        kernels.beam_candidates(lprobs, prev_scores, K, cand_scores, flat)
        cand_beams = torch.div(flat, V, rounding_mode="trunc")
        cand_tokens = flat.fmod(V)  # columns: a vocabulary's ids at them
        if self.output is not None:
            cand_tokens = self.output.ids.index_select(0, cand_tokens.view(-1)).view(cand_tokens.shape)
        return cand_scores, cand_tokens, cand_beams + v.row_offsets

    def finalize(self, eos_mask: Tensor, eos_rows: Tensor, eos_scores: Tensor, last: bool) -> None:
        """SequenceGenerator.finalize_hypos on the device: the hypotheses ending in EOS among each sentence's top
        K candidates take the sentence's next free slots (at most K per sentence, in candidate order), with their
        tokens and cumulative scores; a sentence whose K slots are full (or any at the last step) is finished.
        eos_mask, eos_rows, eos_scores: (N, K)."""
        v, N, K, t = self.views, self.rows.sentences, self.K, self.views.step
        if not self.lagged and not bool(eos_mask.any()):
            return  # the host can look (the CPU): nothing ends at this step
        slot = eos_mask.long().cumsum(1) - 1 + v.fin_count.unsqueeze(1)  # (N, K) within the sentence
        accepted = eos_mask & slot.lt(K)
        slots = torch.where(accepted, v.row_offsets + slot, self.trash).view(-1)  # (N * K,)
        rows = eos_rows.reshape(-1)
        tokens = self.tokens.index_select(0, rows)  # (N * K, L)
        tokens.index_fill_(1, t + 1, self.gen.eos)
        v.fin_tokens.index_copy_(0, slots, tokens)
        scores = self.scores.index_select(0, rows)  # (N * K, L - 1) cumulative
        scores.index_copy_(1, t, eos_scores.reshape(-1, 1))
        v.fin_scores.index_copy_(0, slots, scores)
        v.fin_steps.index_copy_(0, slots, t.expand(N * K))
        v.fin_count.add_(accepted.sum(1))
        done = v.fin_count.eq(K)  # SequenceGenerator.is_finished
        if last:
            done |= eos_mask.any(1)
        v.finished.logical_or_(done)

    def advance(self, eos_mask: Tensor, cand_scores: Tensor, cand_tokens: Tensor, cand_rows: Tensor) -> None:
        """Continue each sentence with its K best candidates that do not end in EOS (SequenceGenerator's
        active hypotheses): tokens and scores follow their rows into the other buffer of each pair, and the
        rows' new order is what the decoder's next step reads."""
        v, K, cand, t = self.views, self.K, eos_mask.size(1), self.views.step
        eos_mask[:, :K] |= v.cands_to_ignore
        # EOS candidates sort after every other: the K smallest are the best non-EOS ones
        active_key = eos_mask.long() * self.cand_size + self.cand_offsets[:cand]  # (N, 2K)
        ignored_key, active = torch.topk(active_key, k=K, dim=1, largest=False)  # (N, K)
        torch.ge(ignored_key, self.cand_size, out=v.cands_to_ignore)
        self.rows.continue_rows(cand_rows, active)  # into the order buffer, v.order
        tokens, scores = v.token_pair[1 - self.rows.parity], v.score_pair[1 - self.rows.parity]
        torch.index_select(self.tokens, 0, v.order, out=tokens)
        torch.index_select(self.scores, 0, v.order, out=scores)
        tokens.index_copy_(1, t + 1, torch.gather(cand_tokens, 1, active).view(-1, 1))
        scores.index_copy_(1, t, torch.gather(cand_scores, 1, active).view(-1, 1))
        t.add_(1)

    def after_step(self, state: DecodingState, step: int) -> None:
        """What a step changes on the host side (a replayed graph runs no Python): the buffer pairs turn (the rows'
        parity, the decoding state's and the search's alike); the finished flags start on their way to the host,
        which reads them one step later (lagged)."""
        state.step_done()
        if self.lagged:  # outside the graph: a copy into pinned memory is queued after it, waited for later
            self.finished_host[self.rows.parity].copy_(self.views.finished, non_blocking=True)
        if self.events is not None:
            self.events[step % 2].record()

    def finished_at(self, step: int, decided_at: int) -> Optional[Tensor]:
        """(N,) bool on the host: which places had finished after `step`; None when that step's flags are not
        to be read (before the first step, or launched before the last halving)."""
        if step < 0 or step <= decided_at:
            return None
        if not self.lagged:
            return self.views.finished
        if self.events is not None:
            self.events[step % 2].synchronize()  # the step before the one just launched: the device is past it
        # step s copied into the buffer that the parity names after it; one step later that is the other one
        return self.finished_host[1 - self.rows.parity]

    def keep_sentences(self, state: DecodingState, kept: Tensor) -> None:
        """Halve in place: the places `kept` (N',) become the first N' of every buffer; the decoder's state follows
        (its causal rows through the pending order, which keeps naming their sources)."""
        v, K = self.views, self.K
        kept_rows = (kept.unsqueeze(1) * K + torch.arange(K, device=kept.device)).view(-1)  # (N'K,)
        moved = {"tokens": self.tokens.index_select(0, kept_rows), "scores": self.scores.index_select(0, kept_rows),
                 "cands_to_ignore": v.cands_to_ignore.index_select(0, kept), "finished": v.finished.index_select(0, kept),
                 "fin_count": v.fin_count.index_select(0, kept)}
        fin_moved = [value.index_select(0, kept_rows) for value in (v.fin_tokens, v.fin_scores, v.fin_steps)]
        self.views = v = self._views(kept.numel())
        state.keep_sentences(kept, v.order)  # the caches, and the rows' account: N' places, its order in v.order
        self.tokens[:] = moved["tokens"]
        self.scores[:] = moved["scores"]
        v.cands_to_ignore[:] = moved["cands_to_ignore"]
        v.finished[:] = moved["finished"]
        v.fin_count[:] = moved["fin_count"]
        for value, new in zip((v.fin_tokens, v.fin_scores, v.fin_steps), fin_moved):
            value[: new.size(0)] = new
        if self.native is not None:
            self.native = self._native_search()  # its record's views changed

    def collect(self, finalized: List[List[Dict[str, Tensor]]], sentence_ids: List[int], places) -> None:
        """Append the finalized hypotheses of `places` that `finalized` does not hold yet (read from the device
        once), as SequenceGenerator.finalize_hypos makes them: tokens without the BOS, per-position scores,
        the score normalized by length ** lenpen."""
        gen, K, v = self.gen, self.K, self.views
        places = [n for n in places if sentence_ids[n] is not None]  # None: a finished place kept as a filler
        counts = v.fin_count.tolist()
        slots = [slot for n in places for slot in range(n * K, n * K + counts[n])]
        if not slots:
            return
        # read once, and a copy of their own: the buffers serve the next batch (views of them would change)
        if slots == list(range(slots[0], slots[0] + len(slots))):  # every place's K slots (a whole batch): a slice
            first, count = slots[0], len(slots)
            tokens, scores = (t.narrow(0, first, count).to("cpu", copy=True) for t in (v.fin_tokens, v.fin_scores))
            steps = v.fin_steps.narrow(0, first, count).tolist()
        else:
            rows = torch.tensor(slots, device=self.device)
            tokens = v.fin_tokens.index_select(0, rows).cpu()
            scores = v.fin_scores.index_select(0, rows).cpu()  # cumulative
            steps = v.fin_steps.index_select(0, rows).tolist()
        positional = scores.clone()
        positional[:, 1:] -= scores[:, :-1]  # cumulative -> per position (the ones past a hypothesis' end unread)
        final = scores.gather(1, torch.tensor(steps).unsqueeze(1)).squeeze(1)  # the score at each hypothesis' EOS
        if gen.normalize_scores:
            final = final / torch.tensor([(step + 1) ** gen.len_penalty for step in steps], dtype=final.dtype)
        empty = torch.empty(0)  # a finalized hypothesis' attention and alignment (fairseq's empty tensors, one shared)
        i = 0
        for n in places:
            hypos = finalized[sentence_ids[n]]
            for _ in range(counts[n]):
                step = steps[i]
                hypos.append({"tokens": tokens[i, 1: step + 2], "score": final[i], "attention": empty,
                              "alignment": empty, "positional_scores": positional[i, : step + 1]})
                i += 1
