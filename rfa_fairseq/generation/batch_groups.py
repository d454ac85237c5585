"""N of the user's batches decoded at once at N threads, one thread each (CTranslate2's inter_threads with its
max_batch_size), in fairseq-generate, fairseq-interactive and hub.translate.

The three hand their generator one batch at a time, from `task.get_batch_iterator`, and they all prepare their
models for inference (`prepare_for_inference_`) before they ask for it. `wrap_get_batch_iterator` asks
`batches_at_once` how many batches the task's model decodes at once (one: the iterator is fairseq's own); for N > 1
its iterator joins every N * BATCHES_PER_THREAD consecutive batches into one, each collated as fairseq collates it
alone and then padded to the longest on the side the dataset pads, and records which rows and columns of the joined
source hold each batch (`user_batches`). The static beam search decodes N of them at a time, each on a thread, its
encoder included, exactly as one thread decodes that batch alone: the same tokens and padding, so the same
hypotheses and scores. The CLIs read a joined batch as any other (ids, sources, targets, row by row), and every
generator decodes it correctly.

The record is keyed by the joined source tensor itself (weakly): fairseq-interactive rebuilds each batch's dict from
its tensors, so a key inside the dict would not reach the generator; the batches are joined in the process that
decodes them (after the data loader's workers), and on the CPU, where the native step runs, no CLI copies them.
"""
import functools
import logging
import math
import weakref
from typing import Dict, Iterator, List, Optional, Tuple

import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary
from fairseq.data import LanguagePairDataset, iterators

logger = logging.getLogger(__name__)

# a joined batch's source tokens -> for each user batch in it, its (rows, columns) of them
_USER_BATCHES = WeakIdKeyDictionary()

# the keys of a LanguagePairDataset batch that join_batches joins along the sentences (it refuses others; `joinable`
# leaves the datasets whose batches have others, alignments and constraints, to fairseq's iterator)
TOKEN_KEYS = {"src_tokens": "source", "prev_output_tokens": "target", "target": "target"}  # -> whose padding side
ROW_KEYS = ("id", "src_lengths", "src_lang_id", "tgt_lang_id")
COUNT_KEYS = ("nsentences", "ntokens")

# a joined batch holds this many of the user's batches per thread: the threads take them in turn, largest first, and
# finish about together; each joined batch ends with one thread waiting for the other's last batch, so fewer, larger
# joins lose less (int8 at 2 threads on Multi30k's test set, fairseq-generate: batch 32 658 -> 692 -> 704 sentences/s
# at 4 / 8 / 16 per thread; docs/benchmarks.md). Only the printing waits for a joined batch: it is decoded a batch at
# a time per thread.
BATCHES_PER_THREAD = 16


def parts_at_once(requested: int) -> int:
    """How many parts (joined user batches, or parts of one batch) are decoded at once, one thread each:
    --rfa-decode-parts when set (> 0), else torch's threads."""
    return requested or torch.get_num_threads()


def user_batches(src_tokens: Tensor) -> Optional[List[Tuple[slice, slice]]]:
    """For a joined batch's source tokens: each user batch's (rows, columns) of them; None for any other batch."""
    return _USER_BATCHES.get(src_tokens)


def batches_at_once(task) -> int:
    """How many of the user's batches the task's model decodes at once: --rfa-decode-parts when set, else the
    process's threads, for the one rfa_transformer built on the task's dictionaries and prepared for inference,
    when the static beam search runs it on the native step (the CPU); 1 otherwise."""
    from ..models.rfa_transformer import PREPARED_FOR_INFERENCE

    try:
        source, target = task.source_dictionary, task.target_dictionary
    except (AttributeError, NotImplementedError):  # a task without them (FairseqTask's own raise)
        return 1
    models = [m for m in list(PREPARED_FOR_INFERENCE)
              if m.encoder.dictionary is source and m.decoder.dictionary is target]
    if len(models) != 1 or not models[0].rfa_config.rfa_static_beam_search:
        return 1
    model = models[0]
    n = parts_at_once(model.rfa_config.rfa_decode_parts)
    try:
        native = model.decoder.decodes_natively()
    except ValueError:  # options that cannot decode here: the generator names them
        return 1
    return n if n > 1 and native else 1


def _pad_to(tokens: Tensor, width: int, pad: int, left: bool) -> Tensor:
    extra = width - tokens.size(1)
    if extra == 0:
        return tokens
    filler = tokens.new_full((tokens.size(0), extra), pad)
    return torch.cat([filler, tokens] if left else [tokens, filler], dim=1)


def join_batches(batches: List[dict], pad: int, left_pad: Dict[str, bool]) -> dict:
    """LanguagePairDataset batches -> one batch of all their sentences in order, each token tensor padded to the
    widest (left_pad: "source" / "target" -> whether that side pads on the left), recorded for `user_batches`."""
    if len(batches) == 1:
        return batches[0]

    def join(key: str, values: list):
        if key in COUNT_KEYS:
            return sum(values)
        if all(v is None for v in values):
            return None
        if key in TOKEN_KEYS:
            width = max(v.size(1) for v in values)
            return torch.cat([_pad_to(v, width, pad, left_pad[TOKEN_KEYS[key]]) for v in values])
        if key in ROW_KEYS:
            return torch.cat(values)
        raise ValueError(f"rfa_fairseq: cannot join batches with the key {key!r}")

    joined = {key: join(key, [b[key] for b in batches]) for key in batches[0] if key != "net_input"}
    joined["net_input"] = {key: join(key, [b["net_input"][key] for b in batches]) for key in batches[0]["net_input"]}
    src_tokens = joined["net_input"]["src_tokens"]
    parts, row = [], 0
    for b in batches:
        rows, width = b["net_input"]["src_tokens"].shape
        columns = slice(src_tokens.size(1) - width, None) if left_pad["source"] else slice(0, width)
        parts.append((slice(row, row + rows), columns))
        row += rows
    _USER_BATCHES[src_tokens] = parts
    return joined


def joinable(dataset) -> bool:
    """Whether join_batches joins this dataset's batches: a LanguagePairDataset without alignments or constraints
    (fairseq's generator serves those anyway)."""
    return (isinstance(dataset, LanguagePairDataset) and dataset.align_dataset is None
            and getattr(dataset, "constraints", None) is None)


class JoinedBatches:
    """An EpochBatchIterator whose epochs yield every BATCHES_PER_THREAD * `n` consecutive batches of `batches` joined
    (join_batches), for n threads."""

    def __init__(self, batches, n: int, dataset):
        self.batches, self.n = batches, n * BATCHES_PER_THREAD
        self.pad = dataset.src_dict.pad()
        self.left_pad = {"source": bool(dataset.left_pad_source), "target": bool(dataset.left_pad_target)}

    def __len__(self) -> int:
        return math.ceil(len(self.batches) / self.n)

    def __getattr__(self, name):  # the rest of the EpochBatchIterator's interface: the user's batches
        return getattr(self.batches, name)

    def next_epoch_itr(self, *args, **kwargs) -> iterators.CountingIterator:
        batches = self.batches.next_epoch_itr(*args, **kwargs)
        return iterators.CountingIterator(self._joined(batches), start=math.ceil(batches.n / self.n),
                                          total=math.ceil(len(batches) / self.n))

    def _joined(self, batches) -> Iterator[dict]:
        group = []
        for batch in batches:
            group.append(batch)
            if len(group) == self.n:
                yield join_batches(group, self.pad, self.left_pad)
                group = []
        if group:
            yield join_batches(group, self.pad, self.left_pad)


def wrap_get_batch_iterator(original):
    """FairseqTask.get_batch_iterator, whose batches come N at a time where the task's model decodes N at once."""
    logged = weakref.WeakKeyDictionary()  # task -> the N it logged

    @functools.wraps(original)
    def get_batch_iterator(self, dataset, *args, **kwargs):
        batches = original(self, dataset, *args, **kwargs)
        n = batches_at_once(self) if joinable(dataset) else 1
        if n <= 1:
            return batches
        if logged.get(self) != n:
            logged[self] = n
            logger.info(f"rfa_fairseq: {n} batches decoded at once, one thread each (--rfa-decode-parts, or the threads)")
        return JoinedBatches(batches, n, dataset)

    get_batch_iterator.rfa_fairseq_wrapper = True
    return get_batch_iterator
