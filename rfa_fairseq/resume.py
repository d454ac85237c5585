"""Which checkpoint fairseq-train resumes from: the newest intact one, never update 0 while one is there.

fairseq-train resumes from SAVE_DIR/checkpoint_last.pt (or --restore-file) and trains from update 0
when that file is missing. A run stopped during a save can leave checkpoint_last.pt missing (the first
save had written checkpoint_E_U.pt, not yet checkpoint_last.pt), older than another checkpoint (stopped
between writing the two), or, without the plugin's atomic writes (older versions, other tools), damaged.
Before fairseq loads, `plan_resume` looks at every checkpoint fairseq-train writes in the save
directory and picks the one with the most updates whose checksums verify (ties: the requested file):

- checkpoint_last.pt (the default) is not that one: the chosen file is copied to checkpoint_last.pt (atomically)
  (completing the interrupted save; a damaged checkpoint_last.pt is kept as checkpoint_last.pt.damaged),
  so fairseq's own logic (--finetune-from-model, --continue-once, ...) sees a normal resume;
- --restore-file FILE does not load: training resumes from the chosen file instead;
- nothing loads: one error lists every file tried and why.

Either way one warning names the file that was not used, the file used and its update. Under
distributed training rank 0 decides (and repairs) and broadcasts its decision to the other ranks.
Sharded checkpoints (--checkpoint-suffix, FSDP) are left to fairseq.
"""
import logging
import os
import re

from . import checkpoints

logger = logging.getLogger(__name__)

DEFAULT_RESTORE_FILE = "checkpoint_last.pt"
# the names fairseq-train writes into --save-dir (fairseq.checkpoint_utils.save_checkpoint)
CHECKPOINT_NAME = re.compile(r"checkpoint(_last|_best|\d+|_\d+_\d+|\.best_.+)\.pt")
UPDATE_CHECKPOINT_NAME = re.compile(r"checkpoint_\d+_(\d+)\.pt")
EPOCH_CHECKPOINT_NAME = re.compile(r"checkpoint(\d+)\.pt")
# epoch checkpoints read per resume, highest epochs first (an older epoch is never the newest state)
EPOCH_CANDIDATES = 2


class ResumeError(checkpoints.CheckpointLoadError):
    """No checkpoint in the save directory can be resumed from."""


def _reason(exc):
    return str(exc) if isinstance(exc, (checkpoints.CheckpointLoadError, FileNotFoundError)) else f"{type(exc).__name__}: {exc}"


def saved_updates(path):
    """The update count `path` records, read cheaply (memory-mapped, checksums not checked)."""
    checkpoints.verify_checkpoint_file(path, checksums=False)
    return checkpoints.num_updates(checkpoints.safe_load(path, mmap=True, verify=False))


def read_intact(path):
    """Update count of `path` after checking its checksums; raises CheckpointLoadError/OSError otherwise."""
    checkpoints.verify_checkpoint_file(path)
    return saved_updates(path)


def save_dir_checkpoints(save_dir, exclude=()):
    """Checkpoints fairseq-train wrote in `save_dir`, ordered by the update count their name or kind
    suggests (a guess, confirmed by reading): update checkpoints by number, then the others."""
    if not os.path.isdir(save_dir):
        return []
    excluded = {os.path.abspath(path) for path in exclude}
    by_update, epochs, others = [], [], []
    for name in sorted(os.listdir(save_dir)):
        path = os.path.join(save_dir, name)
        if not CHECKPOINT_NAME.fullmatch(name) or os.path.abspath(path) in excluded or not os.path.isfile(path):
            continue
        if (match := UPDATE_CHECKPOINT_NAME.fullmatch(name)):
            by_update.append((int(match[1]), path))
        elif (match := EPOCH_CHECKPOINT_NAME.fullmatch(name)):
            epochs.append((int(match[1]), path))
        else:
            others.append(path)
    epochs = [path for _, path in sorted(epochs, reverse=True)[:EPOCH_CANDIDATES]]
    return others + epochs + [path for _, path in sorted(by_update, reverse=True)]


def newest_intact(paths, tried):
    """(updates, path) of the intact checkpoint with the most updates among `paths` (earlier paths win
    ties), or None; every file that did not load is appended to `tried` as (path, reason). Update counts
    come from the name where it has one; only files at least as new as the one chosen are checksummed."""
    known = []
    for order, path in enumerate(paths):
        match = UPDATE_CHECKPOINT_NAME.fullmatch(os.path.basename(path))
        try:
            updates = int(match[1]) if match else saved_updates(path)
        except (checkpoints.CheckpointLoadError, OSError) as exc:
            tried.append((path, _reason(exc)))
            continue
        known.append((updates, order, path))
    for _, _, path in sorted(known, key=lambda item: (-item[0], item[1])):
        try:
            return read_intact(path), path
        except (checkpoints.CheckpointLoadError, OSError) as exc:
            tried.append((path, _reason(exc)))
    return None


def _listing(tried):
    return "; ".join(f"{path}: {reason}" for path, reason in tried)


def plan_resume(restore_file, save_dir):
    """The file fairseq-train should load instead of the one it would, or None to load as fairseq would.
    For the default checkpoint_last.pt the replacement is made in place (copied to that name), so the
    result is then None too. Raises ResumeError when checkpoints exist but none is intact."""
    default = restore_file == DEFAULT_RESTORE_FILE
    requested = os.path.join(save_dir, DEFAULT_RESTORE_FILE) if default else restore_file
    tried = []
    if not default:
        if os.path.exists(requested):
            try:
                read_intact(requested)
                return None  # an explicit --restore-file that loads is used, whatever else is there
            except (checkpoints.CheckpointLoadError, OSError) as exc:
                tried.append((requested, _reason(exc)))
        else:
            tried.append((requested, "not found"))
        found = newest_intact(save_dir_checkpoints(save_dir, exclude=[requested]), tried)
        if found is None:
            raise ResumeError(f"--restore-file {requested} cannot be loaded and no checkpoint in --save-dir {save_dir} "
                              f"is intact; tried: {_listing(tried)}. Pass an intact checkpoint with --restore-file")
        updates, chosen = found
        logger.warning(f"--restore-file {requested} cannot be loaded ({tried[0][1]}); resuming from {chosen} "
                       f"({updates} updates), the newest intact checkpoint in {save_dir}")
        return chosen

    others = save_dir_checkpoints(save_dir, exclude=[requested])
    if not others:
        return None  # a first launch, or only checkpoint_last.pt: fairseq loads it (its errors name it)
    pool = ([requested] if os.path.lexists(requested) else []) + others
    found = newest_intact(pool, tried)
    if found is None:
        raise ResumeError(f"no checkpoint in --save-dir {save_dir} is intact, so training cannot resume; tried: "
                          f"{_listing(tried)}. Pass an intact checkpoint with --restore-file, or move these files "
                          f"away to train from update 0")
    updates, chosen = found
    if chosen == requested:
        return None
    if os.path.lexists(requested):
        failure = dict(tried).get(requested)
        if failure is None:
            try:
                why = f"holds {read_intact(requested)} updates (the run was stopped between writing the two)"
            except (checkpoints.CheckpointLoadError, OSError) as exc:
                failure = _reason(exc)
        if failure is not None:
            kept = requested + ".damaged"
            os.replace(requested, kept)
            why = f"cannot be loaded ({failure}; kept as {kept})"
    else:
        why = "is missing (the run was stopped before writing it)"
    checkpoints.copy_atomic(chosen, requested)
    logger.warning(f"{requested} {why}; resuming from {chosen} ({updates} updates), the newest intact checkpoint "
                   f"in {save_dir}, now also {requested}")
    return None


# temporary files of a checkpoint write that was killed: ours (NAME.tmpPID) and fairseq's own (NAME.tmp)
_TEMPORARY_NAME = re.compile(r"checkpoint.*\.pt\.tmp\d*")


def remove_stale_temporaries(save_dir):
    """Delete the temporary files that killed checkpoint writes left in `save_dir` (run before this
    training saves anything, so none of them can be in use); returns their paths."""
    removed = []
    if os.path.isdir(save_dir):
        for name in sorted(os.listdir(save_dir)):
            if _TEMPORARY_NAME.fullmatch(name):
                os.remove(os.path.join(save_dir, name))
                removed.append(os.path.join(save_dir, name))
    if removed:
        logger.info(f"removed {len(removed)} temporary file(s) of interrupted checkpoint writes: {', '.join(removed)}")
    return removed


def prepare_resume(cfg, trainer):
    """plan_resume for fairseq-train's checkpoint configuration `cfg`, decided on rank 0 and broadcast
    to the other ranks; returns the file to load instead of cfg.restore_file, or None."""
    if trainer.checkpoint_suffix or not checkpoints.is_local_path(cfg.save_dir) \
            or not checkpoints.is_local_path(cfg.restore_file):
        return None
    decision = None
    if trainer.data_parallel_rank == 0:
        remove_stale_temporaries(cfg.save_dir)
        try:
            decision = {"restore_file": plan_resume(cfg.restore_file, cfg.save_dir)}
        except ResumeError as exc:
            decision = {"error": str(exc)}
    if trainer.data_parallel_world_size > 1:
        from fairseq.distributed import utils as distributed_utils

        decision = distributed_utils.broadcast_object(decision, src_rank=0, group=trainer.data_parallel_process_group,
                                                      dist_device=trainer.device)
    if "error" in decision:
        raise ResumeError(decision["error"])
    return decision["restore_file"]
