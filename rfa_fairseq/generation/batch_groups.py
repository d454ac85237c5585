"""N of the user's batches decoded at once at N threads, one thread each (CTranslate2's inter_threads with its
max_batch_size), in fairseq-generate, fairseq-interactive and hub.translate.

The three hand their generator one batch at a time, drawn from `task.get_batch_iterator`; the task builds both the
iterator and the generator, so the task decides, in one record of its own (`BatchJoining`, `joining_of(task)`):

- the rfa_transformers built on it (`record_model`, which this module registers with models/rfa_transformer.py's
  MODEL_BUILT_HOOKS): its iterators join batches only where one of them is prepared for inference
  (`prepare_for_inference_`, which the three call and fairseq-train never does);
- the static beam search its `build_generator` made last for such a model (`use_generator`): `batches_at_once` says
  how many batches it decodes at once, N (--rfa-decode-parts when set, else the process's threads, on the native
  step; 1 for any other generator). An epoch of the task's iterator (`JoinedEpoch`) reads N when its first batch is
  drawn (fairseq-generate builds its generator after its iterator) and joins every N * BATCHES_PER_THREAD consecutive
  batches into one (`joined_sample.join_batches`).

A joined sample states which rows and columns of its source hold each user batch on its source tokens tensor itself
(joined_sample.py), which every CLI hands its generator as it got it: fairseq-generate and hub.translate in the
sample, fairseq-interactive in the dict it rebuilds from its tensors. The static beam search decodes each user batch
on a thread of its own, its encoder included, exactly as one thread decodes that batch alone: the same tokens and
padding, so the same hypotheses and scores. The CLIs read a joined batch as any other (ids, sources, targets, row by
row).
"""
import functools
import logging
import math
import weakref
from typing import Dict, Optional

from fairseq.data import LanguagePairDataset

from ..models.rfa_transformer import MODEL_BUILT_HOOKS
from .joined_sample import join_batches
from .static_beam_search import StaticBeamSearchGenerator, parts_at_once

logger = logging.getLogger(__name__)

# the attribute of a task that holds its BatchJoining
TASK_ATTRIBUTE = "rfa_batch_joining"

# a joined batch holds this many of the user's batches per thread: the threads take them in turn, largest first, and
# finish about together; each joined batch ends with one thread waiting for the other's last batch, so fewer, larger
# joins lose less (int8 at 2 threads on Multi30k's test set, fairseq-generate: batch 32 658 -> 692 -> 704 sentences/s
# at 4 / 8 / 16 per thread; docs/benchmarks.md). Only the printing waits for a joined batch: it is decoded a batch at
# a time per thread.
BATCHES_PER_THREAD = 16


def batches_at_once(generator) -> int:
    """How many of the user's batches `generator` decodes at once: --rfa-decode-parts when set, else the process's
    threads, for the static beam search on the native step (the CPU); 1 for any other generator."""
    if not isinstance(generator, StaticBeamSearchGenerator):
        return 1
    n = parts_at_once(generator.parts)
    if n <= 1:
        return 1
    try:
        native = generator.model.decoder.decodes_natively()
    except ValueError:  # options that cannot decode here: the generator names them
        return 1
    return n if native else 1


class BatchJoining:
    """A task's joining of its batches (module docstring): the rfa_transformers built on it and the static beam search
    it built last for one prepared for inference."""

    def __init__(self):
        self.models: "weakref.WeakSet" = weakref.WeakSet()
        self._generator: Optional[weakref.ref] = None  # weak: hub.translate's generator lives for one call
        self._logged = 1  # the batches at once last logged

    def for_inference(self) -> bool:
        """Whether a model built on the task was prepared for inference (fairseq-train never prepares one)."""
        return any(getattr(model, "prepared_for_inference", False) for model in list(self.models))

    def generator(self):
        return self._generator() if self._generator is not None else None

    def group_size(self) -> int:
        """How many of the user's batches one joined batch holds now: BATCHES_PER_THREAD per batch decoded at once
        by the task's generator; 1 (none joined) without one that decodes several."""
        n = batches_at_once(self.generator())
        return n * BATCHES_PER_THREAD if n > 1 else 1

    def joined(self, n: int) -> None:
        """A joined batch is handed out, for `n` batches at once (logged when n changes)."""
        if n != self._logged:
            self._logged = n
            logger.info(f"rfa_fairseq: {n} batches decoded at once, one thread each "
                        f"(--rfa-decode-parts, or the threads)")


def joining_of(task, create: bool = False) -> Optional[BatchJoining]:
    """The task's BatchJoining (made when `create`); None where it has none (or takes no attributes)."""
    joining = getattr(task, TASK_ATTRIBUTE, None)
    if joining is None and create:
        joining = BatchJoining()
        try:
            setattr(task, TASK_ATTRIBUTE, joining)
        except (AttributeError, TypeError):
            return None
    return joining


def record_model(task, model) -> None:
    """`model` was built on `task` (RFATransformerModel.build_model): once it is prepared for inference, the task's
    batches may come joined."""
    joining = joining_of(task, create=True)
    if joining is not None:
        joining.models.add(model)


def use_generator(task, generator) -> None:
    """The generator `task.build_generator` returned: the static beam search of a model prepared for inference
    decides how many batches the task's iterators join from now on; any other generator, none."""
    joining = joining_of(task)
    if joining is None:
        return
    decides = (isinstance(generator, StaticBeamSearchGenerator)
               and getattr(generator.model, "prepared_for_inference", False))
    joining._generator = weakref.ref(generator) if decides else None


def joinable(dataset) -> bool:
    """Whether join_batches joins this dataset's batches: a LanguagePairDataset without alignments or constraints
    (fairseq's generator serves those anyway)."""
    return (isinstance(dataset, LanguagePairDataset) and dataset.align_dataset is None
            and getattr(dataset, "constraints", None) is None)


class JoinedEpoch:
    """One epoch of a task's batches for inference, with what the CLIs' loops and fairseq's progress bars use of an
    epoch iterator (iteration, len, n, has_next): every `group_size` consecutive batches of fairseq's epoch `batches`
    joined (join_batches), `group_size` read from the task's BatchJoining when the first batch is drawn; fairseq's
    batches as they are where it is 1."""

    def __init__(self, batches, joining: BatchJoining, pad: int, left_pad: Dict[str, bool]):
        self.batches, self.joining, self.pad, self.left_pad = batches, joining, pad, left_pad
        self.group: Optional[int] = None  # fixed as the first batch is drawn
        self.n = 0  # batches handed out (a joined one counts one)

    def __len__(self) -> int:  # before the first batch: what the task's generator would join now
        group = self.group or self.joining.group_size()
        return self.n + math.ceil((len(self.batches) - self.batches.n) / group)

    def has_next(self) -> bool:
        return self.batches.has_next()

    def __iter__(self) -> "JoinedEpoch":
        return self

    def __next__(self) -> dict:
        if self.group is None:
            self.group = self.joining.group_size()
        group = [next(self.batches)]  # its StopIteration ends the epoch
        while len(group) < self.group:
            try:
                group.append(next(self.batches))
            except StopIteration:
                break
        self.n += 1
        if len(group) == 1:
            return group[0]
        self.joining.joined(self.group // BATCHES_PER_THREAD)
        return join_batches(group, self.pad, self.left_pad)


class JoinedBatches:
    """A task's EpochBatchIterator for inference, as fairseq-generate, fairseq-interactive and hub.translate use it:
    each epoch (`next_epoch_itr`) a JoinedEpoch of fairseq's. `batches` is fairseq's iterator."""

    def __init__(self, batches, joining: BatchJoining, dataset):
        self.batches, self.joining = batches, joining
        self.pad = dataset.src_dict.pad()
        self.left_pad = {"source": bool(dataset.left_pad_source), "target": bool(dataset.left_pad_target)}

    def next_epoch_itr(self, *args, **kwargs) -> JoinedEpoch:
        return JoinedEpoch(self.batches.next_epoch_itr(*args, **kwargs), self.joining, self.pad, self.left_pad)


def wrap_get_batch_iterator(original):
    """FairseqTask.get_batch_iterator, whose batches may come joined for a task that generates (module docstring)."""

    @functools.wraps(original)
    def get_batch_iterator(self, dataset, *args, **kwargs):
        batches = original(self, dataset, *args, **kwargs)
        joining = joining_of(self)
        if joining is None or not joining.for_inference() or not joinable(dataset):
            return batches
        return JoinedBatches(batches, joining, dataset)

    get_batch_iterator.rfa_fairseq_wrapper = True
    return get_batch_iterator


if record_model not in MODEL_BUILT_HOOKS:  # the models built on a task are recorded as they are built
    MODEL_BUILT_HOOKS.append(record_model)
