"""N of the user's batches decoded at once at N threads, one thread each (CTranslate2's inter_threads with its
max_batch_size), in fairseq-generate, fairseq-interactive and hub.translate.

The three hand their generator one batch at a time, drawn from `task.get_batch_iterator`; the task builds both the
iterator and the generator, so the task decides, in one record of its own (`BatchJoining`, `joining_of(task)`):

- the rfa_transformers built on it (`record_model`, from the model's build_model): its iterators join batches only
  where one of them is prepared for inference (`prepare_for_inference_`, which the three call and fairseq-train never
  does), and only where the task's `inference_step` is the plugin's (below);
- the static beam search its `build_generator` made last for such a model (`use_generator`): `batches_at_once` says
  how many batches it decodes at once, N (--rfa-decode-parts when set, else the process's threads, on the native
  step; 1 for any other generator). An epoch of the task's iterator (`JoinedEpoch`) reads N when its first batch is
  drawn (fairseq-generate builds its generator after its iterator) and joins every N * BATCHES_PER_THREAD consecutive
  batches into one (`join_batches`), each collated as fairseq collates it alone, then padded to the widest on the side
  the dataset pads.

A joined sample states which rows and columns of its source hold each user batch, under the key USER_BATCHES
(`user_batches(sample)` reads and checks it). fairseq-generate and hub.translate hand the sample itself to the
generator; fairseq-interactive rebuilds each batch's dict from its source tokens and lengths, and the one hook for it
is the `joined-batch-record` patch of `FairseqTask.inference_step` (`BatchJoining.record_for`): a sample without the
record that holds the source tokens of the batch the task joined last (equal tokens: a copy too) gets its record.
The static beam search decodes each user batch on a thread of its own, its encoder included, exactly as one thread
decodes that batch alone: the same tokens and padding, so the same hypotheses and scores. The CLIs read a joined batch
as any other (ids, sources, targets, row by row).
"""
import functools
import logging
import math
import weakref
from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor
from fairseq.data import LanguagePairDataset

logger = logging.getLogger(__name__)

# the key of a joined sample that lists each user batch's (rows, columns) of its source tokens, in order
USER_BATCHES = "rfa_user_batches"
# the attribute of a task that holds its BatchJoining
TASK_ATTRIBUTE = "rfa_batch_joining"

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


def user_batches(sample: dict) -> Optional[List[Tuple[slice, slice]]]:
    """For a joined batch (join_batches): each user batch's (rows, columns) of its source tokens, as the sample states
    them (USER_BATCHES); None for any other batch. A record that does not cover the sample's source tokens, row after
    row, is an error naming the part that does not fit."""
    parts = sample.get(USER_BATCHES)
    if parts is None:
        return None
    rows_total, width = sample["net_input"]["src_tokens"].shape[:2]
    next_row = 0
    for i, part in enumerate(parts):
        rows, columns = part
        if not (isinstance(rows, slice) and isinstance(columns, slice)) or rows.step not in (None, 1):
            raise ValueError(f"rfa_fairseq: {USER_BATCHES}[{i}] of a joined batch is {part!r}, not a (rows, columns) "
                             f"pair of slices")
        if (rows.start != next_row or rows.stop is None or not rows.start < rows.stop <= rows_total
                or len(range(width)[columns]) == 0):
            raise ValueError(f"rfa_fairseq: {USER_BATCHES}[{i}] of a joined batch, rows {rows.start}:{rows.stop} and "
                             f"columns {columns.start}:{columns.stop}, does not follow the rows before it (from "
                             f"{next_row}) inside its source tokens of shape ({rows_total}, {width})")
        next_row = rows.stop
    if next_row != rows_total:
        raise ValueError(f"rfa_fairseq: the {len(parts)} user batches of a joined batch ({USER_BATCHES}) hold "
                         f"{next_row} rows, its source tokens {rows_total}")
    return list(parts)


def batches_at_once(generator) -> int:
    """How many of the user's batches `generator` decodes at once: --rfa-decode-parts when set, else the process's
    threads, for the static beam search on the native step (the CPU); 1 for any other generator."""
    from .static_beam_search import StaticBeamSearchGenerator  # (it imports this module)

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
    """A task's joining of its batches (module docstring): the rfa_transformers built on it, the static beam search it
    built last for one prepared for inference, and the last batch its iterators joined."""

    def __init__(self):
        self.models: "weakref.WeakSet" = weakref.WeakSet()
        self._generator: Optional[weakref.ref] = None  # weak: hub.translate's generator lives for one call
        self.last_joined: Optional[dict] = None  # until the task's inference_step next runs
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

    def joined(self, batch: dict, n: int) -> None:
        """Note a joined batch as its epoch hands it out, for `n` batches at once (logged when n changes)."""
        self.last_joined = batch
        if n != self._logged:
            self._logged = n
            logger.info(f"rfa_fairseq: {n} batches decoded at once, one thread each "
                        f"(--rfa-decode-parts, or the threads)")

    def record_for(self, sample):
        """`sample` with the record of the batch the task joined last, where it has none and holds that batch's source
        tokens (fairseq-interactive rebuilds a batch's dict from its tensors); else `sample` itself. The last joined
        batch is forgotten either way: the CLIs decode each batch as they draw it."""
        joined, self.last_joined = self.last_joined, None
        if joined is None or not isinstance(sample, dict) or USER_BATCHES in sample:
            return sample
        tokens = sample.get("net_input", {}).get("src_tokens")
        joined_tokens = joined["net_input"]["src_tokens"]
        if (isinstance(tokens, Tensor) and tokens.shape == joined_tokens.shape
                and torch.equal(tokens.to(joined_tokens.device), joined_tokens)):
            return {**sample, USER_BATCHES: joined[USER_BATCHES]}
        logger.warning("rfa_fairseq: a batch reached inference_step without the record of the batch the task joined "
                       "last, and with other source tokens: that joined batch is decoded as one batch, not by the "
                       "user's batches")
        return sample


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
    from .static_beam_search import StaticBeamSearchGenerator  # (it imports this module)

    joining = joining_of(task)
    if joining is None:
        return
    decides = (isinstance(generator, StaticBeamSearchGenerator)
               and getattr(generator.model, "prepared_for_inference", False))
    joining._generator = weakref.ref(generator) if decides else None


def _pad_to(tokens: Tensor, width: int, pad: int, left: bool) -> Tensor:
    extra = width - tokens.size(1)
    if extra == 0:
        return tokens
    filler = tokens.new_full((tokens.size(0), extra), pad)
    return torch.cat([filler, tokens] if left else [tokens, filler], dim=1)


def join_batches(batches: List[dict], pad: int, left_pad: Dict[str, bool]) -> dict:
    """LanguagePairDataset batches -> one batch of all their sentences in order, each token tensor padded to the
    widest (left_pad: "source" / "target" -> whether that side pads on the left), stating each batch's rows and
    columns of its source tokens under USER_BATCHES. One batch is returned as it is."""
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
    joined_width = joined["net_input"]["src_tokens"].size(1)
    parts, row = [], 0
    for b in batches:
        rows, width = b["net_input"]["src_tokens"].shape
        columns = slice(joined_width - width, joined_width) if left_pad["source"] else slice(0, width)
        parts.append((slice(row, row + rows), columns))
        row += rows
    joined[USER_BATCHES] = parts
    return joined


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
        joined = join_batches(group, self.pad, self.left_pad)
        self.joining.joined(joined, self.group // BATCHES_PER_THREAD)
        return joined


class JoinedBatches:
    """A task's EpochBatchIterator for inference, as fairseq-generate, fairseq-interactive and hub.translate use it:
    each epoch (`next_epoch_itr`) a JoinedEpoch of fairseq's. `batches` is fairseq's iterator."""

    def __init__(self, batches, joining: BatchJoining, dataset):
        self.batches, self.joining = batches, joining
        self.pad = dataset.src_dict.pad()
        self.left_pad = {"source": bool(dataset.left_pad_source), "target": bool(dataset.left_pad_target)}

    def next_epoch_itr(self, *args, **kwargs) -> JoinedEpoch:
        return JoinedEpoch(self.batches.next_epoch_itr(*args, **kwargs), self.joining, self.pad, self.left_pad)


def restores_records(task) -> bool:
    """Whether the task's inference_step is the joined-batch-record hook (a task class may have its own)."""
    return getattr(type(task).inference_step, "rfa_fairseq_wrapper", False)


def wrap_get_batch_iterator(original):
    """FairseqTask.get_batch_iterator, whose batches may come joined for a task that generates (module docstring)."""

    @functools.wraps(original)
    def get_batch_iterator(self, dataset, *args, **kwargs):
        batches = original(self, dataset, *args, **kwargs)
        joining = joining_of(self)
        if joining is None or not joining.for_inference() or not joinable(dataset) or not restores_records(self):
            return batches
        return JoinedBatches(batches, joining, dataset)

    get_batch_iterator.rfa_fairseq_wrapper = True
    return get_batch_iterator


def wrap_inference_step(original):
    """FairseqTask.inference_step, which gives a sample rebuilt from a joined batch's tensors its record back
    (BatchJoining.record_for): fairseq-interactive's."""

    @functools.wraps(original)
    def inference_step(self, generator, models, sample, prefix_tokens=None, constraints=None):
        joining = joining_of(self)
        if joining is not None:
            sample = joining.record_for(sample)
        return original(self, generator, models, sample, prefix_tokens=prefix_tokens, constraints=constraints)

    inference_step.rfa_fairseq_wrapper = True
    return inference_step
