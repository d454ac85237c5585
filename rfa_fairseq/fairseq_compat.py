"""Every patch the plugin applies to fairseq 0.12 and torch when it is imported, and why.

`apply_patches()` runs when rfa_fairseq is imported, which `--user-dir` does in fairseq-train,
fairseq-hydra-train, fairseq-generate/-interactive/-validate and in every distributed worker. It is
idempotent (the plugin may be imported more than once, e.g. by a test and by --user-dir): an attribute
the plugin already replaced (marked `rfa_fairseq_wrapper`) is left alone.

`PATCHES` is the one table of fairseq patches (docs/design.md's table is `patch_table_markdown()`; a test
keeps the two equal). Each record names the attribute it replaces and the fingerprint of the fairseq
source it was checked against (`fairseq_sources.source_fingerprint`, from ve-fairseq 0.12.3 as installed). A patch is
applied only when the attribute's current fingerprint is that one; otherwise (another fairseq version,
or another package replaced the attribute) fairseq's attribute is left as it is and one
`FairseqPatchSkipped` warning names the patch, what differs and what the user loses.

The fairseq functions the native encoder repeats instead of calling are fingerprinted the same way, in
fairseq_mirrors.py.

The patches (their names in PATCHES in brackets):

1. torch's weights_only allowlist (`checkpoints.allowlist_checkpoint_classes`). torch >= 2.6 loads
   with weights_only=True, which refuses every pickled class that is not allowlisted, and fairseq
   0.12 calls `torch.load` without arguments. We allowlist exactly the classes fairseq checkpoints
   pickle (`checkpoints.FAIRSEQ_CHECKPOINT_CLASSES`); anything else is still refused. weights_only
   is never turned off.
2. [checked-checkpoint-loading] `fairseq.checkpoint_utils.load_checkpoint_to_cpu` (fairseq-train resume,
   --restore-file, --finetune-from-model, fairseq-generate/-interactive/-validate): the file's checksums are verified
   first (`checkpoints.verify_checkpoint_file`), and a file that is not a checkpoint, a truncated or
   overwritten one, a refused class or an RFA option changed by --model-overrides gives one clear
   error naming the file (`checkpoints.CheckpointLoadError`, `config.RFAOptionMismatchError`) instead of
   torch's generic text (or `KeyError: 101`); an rfa* --model-overrides key that is no RFA option gets a
   warning naming the closest one. fairseq's code then loads the file mapped (`_TorchLoadingMapped`), not read
   whole: generation reads the model's tensors once and never the optimizer's state.
3. [atomic-checkpoint-save, atomic-checkpoint-copy, resume-from-newest-intact,
   no-training-past-max-update] Checkpoint writing, so that every name fairseq-train writes appears
   atomically (a process killed at any instant leaves each name as the old complete file or the new one):
   `checkpoint_utils.torch_persistent_save` writes through `checkpoints.save_atomic` (temporary file,
   fsync, rename; fairseq's own had no fsync), and `checkpoint_utils.PathManager` becomes
   `AtomicCopyPathManager`, whose `copy` (checkpoint_last.pt, checkpoint_best.pt, ... are copies of the
   first file) writes a temporary copy, fsyncs it and renames it into place (`checkpoints.copy_atomic`)
   where fairseq copied into the final name. Pruning (--keep-*) removes whole names. Under distributed
   training rank 0 writes, through the same hooks. An rfa_* checkpoint also gets a first entry
   `NeedsUserDirRfaFairseq()` so that loading it WITHOUT the plugin fails with torch's
   "Unsupported global: GLOBAL rfa_fairseq.checkpoint_safety.NeedsUserDirRfaFairseq": the only text
   we can put in front of a user whose process never imported this plugin.
   `checkpoint_utils.load_checkpoint` (fairseq-train's resume) first picks the newest intact checkpoint
   in --save-dir (`resume.prepare_resume`: a torn or older checkpoint_last.pt, a missing one, an
   unloadable --restore-file) and removes temporary files of killed writes. `fairseq_cli.train.train`
   returns at once when the resumed checkpoint is already at --max-update (fairseq trained one more
   update each time the finished command was run again, e.g. after a kill during its exit).
4. [broadcast-checkpoint-classes] `fairseq.distributed.utils._broadcast_object_slow`: with several ranks,
   rank 0 loads the checkpoint (through the checks above) and broadcasts it, as a pickle that now holds omegaconf
   DictConfig objects, to the other ranks, which `torch.load` it with weights_only. The omegaconf
   classes (`checkpoints.broadcast_checkpoint_classes`) are allowlisted only while such a broadcast
   is read, never for files.
5. [utf8-interactive-input] `fairseq_cli.interactive.buffered_read`: fairseq-interactive's input (--input
   FILE or stdin) is read under the plugin's one rule for text (`textio`): a line that is not UTF-8 is an error naming
   the file and line (fairseq failed without naming either for a file, and made <unk> of stdin).
6. [stoppable-data-thread] fairseq's background data thread, stopped before the interpreter exits
   (`StoppableConsumer` replaces `fairseq.data.iterators.BackgroundConsumer`; `stop_data_threads` runs at exit). Without
   it a run that stops mid-epoch (e.g. at --max-update) can abort at exit with SIGABRT. Details below.
7. [static-beam-search] `fairseq.tasks.FairseqTask.build_generator` (fairseq-generate, fairseq-interactive,
   --eval-bleu): a single rfa_transformer with plain beam-search options gets the plugin's static beam search
   (`generation.StaticBeamSearchGenerator`: same hypotheses and scores, buffers that keep their shape,
   a batch that only halves); anything else gets fairseq's generator and one log line naming the reason
   (`generation.fallback_reason`).
   [batches-at-once] `FairseqTask.get_batch_iterator`: for a task whose rfa_transformer was prepared for inference,
   where the static beam search the task built decodes on the native step at N threads, every N batches come joined,
   the source tokens stating each user batch's rows and columns (they reach the generator in fairseq-generate,
   fairseq-interactive and hub.translate alike), and the static beam search decodes each on its own thread
   (`generation.batch_groups`).

8. [numpy2-get-buckets, numpy2-get-buckets-pad-dataset, numpy2-get-buckets-audio-dataset,
   numpy2-language-pair-buckets, numpy2-token-blocks] fairseq 0.12's data code that numpy 2.3 and later no longer
   run: `--num-batch-buckets` (`data_utils.get_buckets` calls `np.percentile(..., interpolation=)`, a keyword
   removed in numpy 2.4; `LanguagePairDataset.__init__` types its bucketed lengths `np.compat.long`, and
   `numpy.compat` was removed in numpy 2.3) and `TokenBlockDataset`'s `--sample-break-mode eos` (`np.compat.long`).
   Each function runs its own code, with its `np` bound to `NUMPY_AS_FAIRSEQ_CALLS_IT`: numpy, plus
   `compat.long` (= int, what numpy 1.x defined it as) and `percentile(interpolation=)` passed on as `method=`
   (numpy >= 1.22). `get_buckets` is replaced wherever fairseq imported it by name. Left as fairseq has them, and
   failing under numpy >= 1.24: `data_utils.compute_mask_indices(no_overlap=True)` (speech pretraining, `np.int`) and
   `DynamicCRF._compute_normalizer` (non-autoregressive CRF models, `np.float`); tests/test_numpy_compat.py lists them.

Not applied at import: [bf16-on-gpu] `cli.train` (rfa-train) replaces `fairseq.options.parse_args_and_arch`
only in its own process, so that --bf16 trains on the GPU rather than asking for a TPU.

The background data thread (6). fairseq wraps every epoch iterator in a `BufferedIterator`
(`--data-buffer-size`, default 10): a daemon thread (`BackgroundConsumer`) pulls batches from the
torch DataLoader (with `--num-workers 0` it collates them itself) and keeps up to 10 ready in a queue.
Training that stops at `--max-update` (or `--max-valid-steps`, an error, ...) in the middle of an epoch
leaves that thread running. At exit, CPython (3.11, 3.12) lets daemon threads run until finalization
starts and then ends any of them that tries to take the GIL back with `pthread_exit`. When the thread
is inside a torch call at that moment (a collate, a tensor freed, both release the GIL), `pthread_exit`
unwinds through torch's C++ frames, meets a `noexcept` one, and the C++ runtime calls std::terminate:
"terminate called without an active exception", SIGABRT, exit code 134, after a training that
finished and saved its checkpoints. A thread that is waiting on its full queue is not in torch and
dies quietly, so whether a run aborts depends on timing.

The fix registers `stop_data_threads` to run at interpreter exit, before finalization, while the
thread is still running normally. It tells each live consumer to stop and joins it: the thread
finishes the batch it is making (inside torch, with the GIL handed back normally), puts nothing more
in the queue and returns. Nothing else changes: the same batches in the same order, the same buffer
size, prefetching during training as before; the iterator position saved in checkpoints
(`iterations_in_epoch`) counts the batches training took, never the prefetched ones, so resume is
exact as before.
"""
import atexit
import contextlib
import dataclasses
import functools
import logging
import os
import pickle
import queue
import sys
import threading
import types
import warnings
from typing import Any, Callable, Dict, Optional

import numpy
import torch
from fairseq.data import iterators
from fairseq.file_io import PathManager

from . import checkpoints, resume, textio
from .fairseq_sources import (  # noqa: F401
    ALL_TAGS,
    CHECKED_FAIRSEQ,
    owner_of,
    record_table,
    source_difference,
    source_fingerprint,
)

logger = logging.getLogger(__name__)

# while its queue is full, a consumer looks at its stop flag this often (the wait it replaces was
# unbounded); the only cost is one wake-up per interval of a thread that has nothing to do
PUT_POLL_SECONDS = 0.1
# a batch still being made at exit gets this long to finish; a thread that does not stop in time is
# left as fairseq left it (and a warning says so)
JOIN_TIMEOUT_SECONDS = 60.0


class StoppableConsumer(iterators.BackgroundConsumer):
    """fairseq's BackgroundConsumer (same items, order and buffering) that stops between two items
    when `stop_event` is set, also while it waits for room in a full queue."""

    rfa_fairseq_wrapper = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.stop_event = threading.Event()

    def run(self):
        # fairseq's run(), with each put able to give up on stop
        if getattr(self, "cuda_device", None) is not None:
            torch.cuda.set_device(self.cuda_device)
        try:
            for item in self._source:
                if not self._put(item) or self.stop_event.is_set():
                    return
                self.count += 1
                if self._max_len is not None and self.count >= self._max_len:
                    break
            self._put(iterators._sentinel)
        except Exception as e:
            self._put(e)

    def _put(self, item):
        """Queue `item`, waiting for room; False (item dropped) once stopping."""
        while not self.stop_event.is_set():
            try:
                self._queue.put(item, timeout=PUT_POLL_SECONDS)
                return True
            except queue.Full:
                pass
        return False


def stop_data_threads(timeout=JOIN_TIMEOUT_SECONDS):
    """Stop and join every live StoppableConsumer; returns those that did not stop within `timeout`."""
    consumers = [t for t in threading.enumerate() if isinstance(t, StoppableConsumer)]
    for consumer in consumers:
        consumer.stop_event.set()
    stuck = []
    for consumer in consumers:
        consumer.join(timeout)
        if consumer.is_alive():
            stuck.append(consumer)
    if stuck:
        logger.warning("%d fairseq data thread(s) still busy after %.0f s at exit; the process may abort "
                       "with 'terminate called without an active exception'", len(stuck), timeout)
    return stuck


def _install_stoppable_consumer(original):
    # threading's exit hooks run first at shutdown, before atexit's: before torch's own atexit
    # hooks, which shut DataLoader workers down and could pull them away from a consumer still
    # waiting for a batch. (A private CPython API, stable since Python 3.9 and relied on by
    # concurrent.futures; atexit where it is missing.)
    register = getattr(threading, "_register_atexit", atexit.register)
    register(stop_data_threads)
    return StoppableConsumer  # BufferedIterator looks BackgroundConsumer up in its module for each thread


# ---------------------------------------------------------------- checkpoint loading and saving, text input (2-5)


class _TorchLoadingMapped(types.ModuleType):
    """torch, as fairseq's load_checkpoint_to_cpu calls it: every name is torch's, except that `load` of an open
    local checkpoint maps the file (mmap) instead of reading all of it. What the caller never touches is then never
    read: generation's load reads the model's tensors once, into the parameters load_state_dict copies them to, and
    not the optimizer's state (twice the model with Adam; the load's peak memory was model + checkpoint). The
    mapping is private (copy-on-write: nothing is written back to the file); fairseq-train's optimizer state stays
    file-backed until its first update rewrites it, and the plugin replaces checkpoints by rename only, so the file
    under the mapping does not change."""

    def __init__(self):
        super().__init__("torch", "torch for fairseq's load_checkpoint_to_cpu (rfa_fairseq.fairseq_compat)")

    def __getattr__(self, name):  # only for names not defined here: torch's own
        return getattr(torch, name)

    @staticmethod
    def load(f, *args, **kwargs):
        path = getattr(f, "name", None)
        if isinstance(path, str) and "mmap" not in kwargs and os.path.isfile(path) and checkpoints.mappable(path):
            return torch.load(path, *args, mmap=True, **kwargs)
        return torch.load(f, *args, **kwargs)


TORCH_LOADING_MAPPED = _TorchLoadingMapped()


def _wrap_load_model_ensemble_and_task(original):
    @functools.wraps(original)
    def load_model_ensemble_and_task(filenames, arg_overrides=None, task=None, strict=True, *args, **kwargs):
        # strict: every parameter is set from the checkpoint (a missing one is an error), so the models are built
        # without filling them first (checkpoints.parameters_left_unset)
        with checkpoints.loading_checkpoint() if strict else contextlib.nullcontext():
            return original(filenames, arg_overrides, task, strict, *args, **kwargs)

    load_model_ensemble_and_task.rfa_fairseq_wrapper = True
    return load_model_ensemble_and_task


def _wrap_load_checkpoint_to_cpu(original):
    mapped = _with_globals(original, torch=TORCH_LOADING_MAPPED)

    @functools.wraps(original)
    def load_checkpoint_to_cpu(path, arg_overrides=None, load_on_all_ranks=False):
        checkpoints.warn_unknown_rfa_overrides(arg_overrides)
        if checkpoints.is_local_path(path):
            checkpoints.verify_checkpoint_file(path)
        checkpoints.check_checkpoint_against_overrides(path, arg_overrides)
        try:
            return mapped(path, arg_overrides=arg_overrides, load_on_all_ranks=load_on_all_ranks)
        except (pickle.UnpicklingError, RuntimeError, EOFError) as exc:
            explained = checkpoints.explain_load_failure(path, exc)
            if explained is None:
                raise
            raise explained from exc
        except KeyError as exc:  # a torch file that loaded, without the entries fairseq's upgrade step reads
            raise checkpoints.NotACheckpointError(
                f"{path} is a torch file but not a fairseq checkpoint (it has no entry {exc}): pass a checkpoint "
                f"written by fairseq-train or rfa-convert-transformer") from exc

    load_checkpoint_to_cpu.rfa_fairseq_wrapper = True
    return load_checkpoint_to_cpu


def _wrap_torch_persistent_save(original):
    @functools.wraps(original)
    def torch_persistent_save(obj, filename, async_write=False, *args, **kwargs):
        obj = checkpoints.mark_rfa_checkpoint(obj)
        if async_write or not isinstance(filename, (str, os.PathLike)) or not checkpoints.is_local_path(filename):
            return original(obj, filename, async_write, *args, **kwargs)
        checkpoints.save_atomic(obj, filename)  # fairseq's own write has no fsync and leaves FILE.tmp behind

    torch_persistent_save.rfa_fairseq_wrapper = True
    return torch_persistent_save


class AtomicCopyPathManager(PathManager):
    """fairseq's PathManager, as `checkpoint_utils` sees it, with `copy` of local files made atomic:
    save_checkpoint copies the checkpoint it wrote to checkpoint_last.pt, checkpoint_best.pt, ... in
    place, and a process killed inside that copy left a torn file under the final name. Here each
    name is written as a temporary copy, fsynced and renamed into place (checkpoints.copy_atomic)."""

    rfa_fairseq_wrapper = True

    @staticmethod
    def copy(src_path, dst_path, overwrite=False):
        if not (checkpoints.is_local_path(src_path) and checkpoints.is_local_path(dst_path)):
            return PathManager.copy(src_path, dst_path, overwrite=overwrite)
        if not overwrite and os.path.exists(dst_path):
            return False
        checkpoints.copy_atomic(src_path, dst_path)
        return True


def _wrap_load_checkpoint(original):
    @functools.wraps(original)
    def load_checkpoint(cfg, trainer, **passthrough_args):
        substitute = resume.prepare_resume(cfg, trainer)
        if substitute is None:
            return original(cfg, trainer, **passthrough_args)
        requested = cfg.restore_file
        cfg.restore_file = substitute
        try:
            return original(cfg, trainer, **passthrough_args)
        finally:
            cfg.restore_file = requested

    load_checkpoint.rfa_fairseq_wrapper = True
    return load_checkpoint


def _wrap_broadcast_object_slow(original):
    @functools.wraps(original)
    def _broadcast_object_slow(*args, **kwargs):
        with torch.serialization.safe_globals(checkpoints.broadcast_checkpoint_classes()):
            return original(*args, **kwargs)

    _broadcast_object_slow.rfa_fairseq_wrapper = True
    return _broadcast_object_slow


def _wrap_train_epoch(original):
    @functools.wraps(original)
    def train(cfg, trainer, task, epoch_itr):
        max_update = cfg.optimization.max_update
        if max_update and trainer.get_num_updates() >= max_update:
            logger.info(f"rfa_fairseq: the checkpoint is at {trainer.get_num_updates()} updates, --max-update is "
                        f"{max_update}: nothing left to train")
            return [None], True
        return original(cfg, trainer, task, epoch_itr)

    train.rfa_fairseq_wrapper = True
    return train


def _wrap_parse_args_and_arch(original):
    @functools.wraps(original)
    def parse_args_and_arch(*args, **kwargs):
        parsed = original(*args, **kwargs)
        if getattr(parsed, "bf16", False) and "--tpu" not in sys.argv:
            parsed.tpu = False
        return parsed

    parse_args_and_arch.rfa_fairseq_wrapper = True
    return parse_args_and_arch


def _wrap_build_generator(original):
    from .generation import wrap_build_generator  # when applied: it imports the decoding modules

    return wrap_build_generator(original)


def _wrap_get_batch_iterator(original):
    from .generation.batch_groups import wrap_get_batch_iterator

    return wrap_get_batch_iterator(original)


# ---------------------------------------------------------------- numpy 2 (8)


class _NumpyAsFairseqCallsIt(types.ModuleType):
    """numpy, as fairseq 0.12's data code calls it: every name is numpy's, except the two that numpy 2.3 and
    2.4 removed in the form fairseq uses them."""

    compat = types.SimpleNamespace(long=int)  # numpy.compat.long: Python's int (numpy/compat/py3k.py in numpy 1.x)

    def __init__(self):
        super().__init__("numpy", "numpy for fairseq 0.12's data code (rfa_fairseq.fairseq_compat)")

    def __getattr__(self, name):  # only for names not defined here: numpy's own
        return getattr(numpy, name)

    @staticmethod
    def percentile(a, q, *args, interpolation=None, **kwargs):
        """numpy.percentile, with `interpolation=` (removed in numpy 2.4) passed on as `method=` (numpy >= 1.22)."""
        if interpolation is not None:
            kwargs["method"] = interpolation
        return numpy.percentile(a, q, *args, **kwargs)


NUMPY_AS_FAIRSEQ_CALLS_IT = _NumpyAsFairseqCallsIt()


def _with_globals(original, **names):
    """`original`'s own code and defaults, with its globals `names` bound to the values given (its other globals as
    its module holds them now, the module itself untouched)."""
    globals_ = dict(original.__globals__, **names)
    function = types.FunctionType(original.__code__, globals_, original.__name__, original.__defaults__,
                                  original.__closure__)  # the closure keeps super()'s __class__ cell
    function.__kwdefaults__ = original.__kwdefaults__
    functools.update_wrapper(function, original)
    function.rfa_fairseq_wrapper = True
    return function


def _with_numpy_as_fairseq_calls_it(original):
    """`original` with the global `np` bound to NUMPY_AS_FAIRSEQ_CALLS_IT."""
    return _with_globals(original, np=NUMPY_AS_FAIRSEQ_CALLS_IT)


def _static_with_numpy_as_fairseq_calls_it(original):
    return staticmethod(_with_numpy_as_fairseq_calls_it(original))  # the fingerprint covers the @staticmethod line


def _wrap_trainer_init(original):
    """fp16 training where it can run (CUDA) only: elsewhere a clear error before fairseq's (torch's "Torch not
    compiled with CUDA enabled" from deep in the first update)."""

    @functools.wraps(original)
    def __init__(self, cfg, *args, **kwargs):
        common = cfg.common
        on_cuda = torch.cuda.is_available() and not common.cpu
        if (common.fp16 or common.memory_efficient_fp16) and not on_cuda and not getattr(common, "tpu", False):
            raise ValueError(
                "fp16 training needs a CUDA GPU, and " + ("--cpu was given" if common.cpu else "torch sees none here") +
                ": train in fp32 with common.fp16=false (fairseq-hydra-train; the WMT configs set it true), "
                "FP16=0 (scripts/train.sh), or without --fp16 (fairseq-train)")
        return original(self, cfg, *args, **kwargs)

    __init__.rfa_fairseq_wrapper = True
    return __init__


# ---------------------------------------------------------------- the table, and applying it


class FairseqPatchSkipped(UserWarning):
    """A fairseq patch was not applied: the attribute is not the source it was checked against."""


@dataclasses.dataclass(frozen=True)
class FairseqPatch:
    """One fairseq attribute the plugin replaces (`module`.`attribute`, the attribute possibly
    Class.method) with `replace(original)`, and the fingerprint of the source it was checked against."""
    name: str
    module: str
    attribute: str
    replace: Callable[[Any], Any]
    why: str
    without: str  # what a user loses where the patch is not applied
    fingerprint: str  # source_fingerprint of the attribute in ve-fairseq 0.12.3
    same_source_in: str  # other fairseq sources with the same fingerprint
    at_import: bool = True  # False: applied by the one command that needs it (apply_patch)

    @property
    def target(self) -> str:
        return f"{self.module}.{self.attribute}"


PATCHES = (
    FairseqPatch(
        "fp16-needs-cuda", "fairseq.trainer", "Trainer.__init__", _wrap_trainer_init,
        "fp16 training (common.fp16, --fp16) where torch sees no CUDA GPU, or with --cpu, stops before the trainer is "
        "built, naming common.fp16=false and FP16=0: the WMT configs and recipes train in fp16.",
        "fp16 training on a CPU dies in torch's first update (\"Torch not compiled with CUDA enabled\")",
        "7e07697ee7049f19", "ve-fairseq 0.12.3 (other sources not checked)", at_import=True),
    FairseqPatch(
        "model-built-for-its-checkpoint", "fairseq.checkpoint_utils", "load_model_ensemble_and_task",
        _wrap_load_model_ensemble_and_task,
        "fairseq-generate, fairseq-interactive, fairseq-validate and the hub load models with it: an rfa_transformer "
        "built there for a checkpoint that sets every parameter (strict) skips torch.nn.init's fills, so the "
        "parameters' memory is never written before the checkpoint's mapped pages replace it.",
        "loading a model writes all its parameters once more: the load's peak memory holds the whole model",
        "d02656a3ebb39c01", "ve-fairseq 0.12.3 (other sources not checked)"),
    FairseqPatch(
        "checked-checkpoint-loading", "fairseq.checkpoint_utils", "load_checkpoint_to_cpu",
        _wrap_load_checkpoint_to_cpu,
        "Verifies a checkpoint's checksums and its RFA options against --model-overrides before unpickling; a "
        "file that is not a checkpoint, a torn one or a class weights_only refuses gives one error naming the file "
        "and the cause; an rfa* --model-overrides key that is no RFA option gets a warning. The file is mapped, not "
        "read whole: generation never reads the optimizer's state.",
        "checkpoint files are loaded unchecked, whole, and a bad one fails with torch's generic error",
        "ebbb067afbc898f0", "fairseq v0.12.2, v0.12.3 (git tags); main differs (it loads with weights_only=False)"),
    FairseqPatch(
        "atomic-checkpoint-save", "fairseq.checkpoint_utils", "torch_persistent_save", _wrap_torch_persistent_save,
        "Writes each checkpoint atomically (temporary file, fsync, rename) and marks rfa_* checkpoints so that "
        "loading one without the plugin names it.",
        "a process killed while saving can leave a torn checkpoint under its final name",
        "4ca21bc6f98260cd", ALL_TAGS),
    FairseqPatch(
        "atomic-checkpoint-copy", "fairseq.checkpoint_utils", "PathManager", lambda _: AtomicCopyPathManager,
        "`AtomicCopyPathManager`: `copy` (checkpoint_last.pt, checkpoint_best.pt, ... are copies of the first file "
        "saved) writes a temporary copy, fsyncs it and renames it into place.",
        "a process killed while copying can leave a torn checkpoint_last.pt or checkpoint_best.pt",
        "72d08055e0fc2553", ALL_TAGS),
    FairseqPatch(
        "resume-from-newest-intact", "fairseq.checkpoint_utils", "load_checkpoint", _wrap_load_checkpoint,
        "fairseq-train resumes from the newest intact checkpoint in --save-dir (a torn, older or missing "
        "checkpoint_last.pt, an unloadable --restore-file) and removes temporary files of killed writes.",
        "fairseq-train resumes from checkpoint_last.pt only and fails when it is torn",
        "7ba7092eb37f45b4", "fairseq main (3d262bb); v0.12.2, v0.12.3 (git tags) differ (no task state restored)"),
    FairseqPatch(
        "no-training-past-max-update", "fairseq_cli.train", "train", _wrap_train_epoch,
        "Returns at once when the resumed checkpoint is already at --max-update (fairseq trained one more "
        "update each time a finished command was run again).",
        "running a finished fairseq-train again trains one more update",
        "9a00551242afd0d4", ALL_TAGS),
    FairseqPatch(
        "broadcast-checkpoint-classes", "fairseq.distributed.utils", "_broadcast_object_slow",
        _wrap_broadcast_object_slow,
        "With several ranks, rank 0 broadcasts the checkpoint it loaded as a pickle holding omegaconf objects, "
        "which the other ranks read with weights_only: omegaconf's classes are allowlisted only while it is read.",
        "distributed fairseq-train cannot resume (weights_only refuses omegaconf's classes)",
        "47a361d3c465f073", ALL_TAGS),
    FairseqPatch(
        "utf8-interactive-input", "fairseq_cli.interactive", "buffered_read",
        lambda _: textio.buffered_read_utf8,
        "fairseq-interactive's input under the plugin's one rule for text: a line that is not UTF-8 is an error "
        "naming the file and line (fairseq named neither for a file, and made <unk> of stdin).",
        "fairseq-interactive turns bad bytes on stdin into <unk> and names no line of a bad file",
        "c64b5d270318613b", ALL_TAGS),
    FairseqPatch(
        "stoppable-data-thread", "fairseq.data.iterators", "BackgroundConsumer", _install_stoppable_consumer,
        "Becomes `StoppableConsumer`, which is stopped and joined at interpreter exit, while it still runs "
        "normally (`threading._register_atexit`, a private CPython API, where it exists, else `atexit`).",
        "a training that stops mid-epoch (e.g. at --max-update) can abort at exit with SIGABRT, after saving",
        "1085f31865c2e512", ALL_TAGS),
    FairseqPatch(
        "static-beam-search", "fairseq.tasks", "FairseqTask.build_generator", _wrap_build_generator,
        "A single rfa_transformer with plain beam-search options gets the static beam search (same hypotheses "
        "and scores, buffers that keep their shape); anything else fairseq's generator and a log line saying why.",
        "fairseq's SequenceGenerator decodes (same hypotheses, slower)",
        "a1fa802cb71a70be", ALL_TAGS),
    FairseqPatch(
        "batches-at-once", "fairseq.tasks", "FairseqTask.get_batch_iterator", _wrap_get_batch_iterator,
        "Where a task's rfa_transformer is prepared for inference and the static beam search the task built for it "
        "decodes on the native step at N threads (or --rfa-decode-parts N), its batches come N at a time, joined, the "
        "source tokens stating each one's rows and columns, and the static beam search decodes each on its own thread, "
        "as one thread decodes it alone (`generation.batch_groups`).",
        "fairseq-generate, fairseq-interactive and hub.translate decode one batch at a time on the threads",
        "ce8db78326543b99", "fairseq main (3d262bb); v0.12.2, v0.12.3 (git tags) differ"),
    FairseqPatch(
        "numpy2-get-buckets", "fairseq.data.data_utils", "get_buckets", _with_numpy_as_fairseq_calls_it,
        "`--num-batch-buckets`' bucket sizes: fairseq's code, with `np.percentile(interpolation=)` (a keyword removed "
        "in numpy 2.4) passed on as `method=`.",
        "--num-batch-buckets fails under numpy >= 2.4 (TypeError: percentile() got an unexpected keyword argument "
        "'interpolation')",
        "8655c00a76f2608b", ALL_TAGS),
    FairseqPatch(
        "numpy2-get-buckets-pad-dataset", "fairseq.data.bucket_pad_length_dataset", "get_buckets",
        _with_numpy_as_fairseq_calls_it,
        "The same function as `numpy2-get-buckets`, as `BucketPadLengthDataset` (text data) imported it by name.",
        "--num-batch-buckets fails under numpy >= 2.4 (TypeError: percentile() got an unexpected keyword argument "
        "'interpolation')",
        "8655c00a76f2608b", ALL_TAGS),
    FairseqPatch(
        "numpy2-get-buckets-audio-dataset", "fairseq.data.audio.raw_audio_dataset", "get_buckets",
        _with_numpy_as_fairseq_calls_it,
        "The same function as `numpy2-get-buckets`, as `RawAudioDataset` imported it by name.",
        "--num-batch-buckets fails under numpy >= 2.4 on audio data (TypeError: percentile() got an unexpected "
        "keyword argument 'interpolation')",
        "8655c00a76f2608b", ALL_TAGS),
    FairseqPatch(
        "numpy2-language-pair-buckets", "fairseq.data.language_pair_dataset", "LanguagePairDataset.__init__",
        _with_numpy_as_fairseq_calls_it,
        "fairseq's code, whose bucketed lengths (`--num-batch-buckets`) are typed `np.compat.long` (`numpy.compat` was "
        "removed in numpy 2.3): Python's int, as numpy 1.x defined it.",
        "translation with --num-batch-buckets fails under numpy >= 2.3 (AttributeError: module 'numpy' has no "
        "attribute 'compat')",
        "b7954b80d7d89894", ALL_TAGS),
    FairseqPatch(
        "numpy2-token-blocks", "fairseq.data.token_block_dataset", "TokenBlockDataset._build_slice_indices",
        _static_with_numpy_as_fairseq_calls_it,
        "fairseq's code, whose blocks for `--sample-break-mode eos` are typed `np.compat.long` (removed in numpy "
        "2.3): Python's int, as numpy 1.x defined it.",
        "TokenBlockDataset with break mode eos (language modeling, denoising) fails under numpy >= 2.3 "
        "(AttributeError: module 'numpy' has no attribute 'compat')",
        "75beb6f1ca1d5f10", ALL_TAGS),
    FairseqPatch(
        "bf16-on-gpu", "fairseq.options", "parse_args_and_arch", _wrap_parse_args_and_arch,
        "rfa-train only, in its own process: --bf16 trains in bfloat16 on the GPU (or the CPU); fairseq 0.12 "
        "reads it as a TPU run.",
        "rfa-train --bf16 asks for a TPU (torch_xla), as fairseq-train does",
        "4270635d988c70a7", ALL_TAGS, at_import=False),
)
PATCHES_BY_NAME = {patch.name: patch for patch in PATCHES}
APPLIED: Dict[str, Any] = {}  # name -> the fairseq attribute it replaced


def apply_patch(name: str) -> bool:
    """Apply the patch `name` of PATCHES where fairseq's attribute is the source it was checked against; else
    warn (FairseqPatchSkipped) and leave it. True when the patch is in place (also from before)."""
    patch = PATCHES_BY_NAME[name]
    try:
        owner, attribute = owner_of(patch)
        current = getattr(owner, attribute)
    except (ImportError, AttributeError):
        current, difference = None, "does not exist"
    else:
        if getattr(current, "rfa_fairseq_wrapper", False):
            return True
        difference = source_difference(current, patch.fingerprint)
        if difference is None:
            setattr(owner, attribute, patch.replace(current))
            APPLIED[name] = current
            return True
    warnings.warn(
        f"rfa_fairseq: patch {name!r} not applied: {patch.target} {difference}, not the source it was checked "
        f"against ({CHECKED_FAIRSEQ}, fingerprint {patch.fingerprint}): another fairseq version, or another package "
        f"replaced it. Without the patch, {patch.without}.", FairseqPatchSkipped, stacklevel=2)
    return False


def apply_patches() -> None:
    """The plugin's import: torch's allowlist (1 above) and every PATCHES record with at_import; idempotent."""
    checkpoints.allowlist_checkpoint_classes()
    for patch in PATCHES:
        if patch.at_import:
            apply_patch(patch.name)


def patch_table_markdown() -> str:
    """docs/design.md's table of PATCHES."""
    return record_table("| patch | what is patched | why | fairseq versions checked |", PATCHES,
                        lambda patch: [f"`{patch.name}`", f"`{patch.target}`", f"{patch.why} Without it, {patch.without}."])
