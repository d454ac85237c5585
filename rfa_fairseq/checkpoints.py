"""Checkpoint handling in one place: safe loading, atomic saving, the stored model configuration and
the check of RFA options against it.

- Loading: `safe_load(path)` is `torch.load(path, weights_only=True)` on the CPU, never without
  weights_only. torch's weights_only unpickler refuses every pickled class that is not allowlisted;
  the plugin allowlists exactly the classes fairseq checkpoints pickle (`FAIRSEQ_CHECKPOINT_CLASSES`,
  allowlisted at import by `fairseq_compat`). Before unpickling, `verify_checkpoint_file` checks that
  the file is a complete torch archive and recomputes the CRC-32 that torch.save stores for every
  record (torch.load does not check them). A file that is not a checkpoint, a truncated or overwritten
  one, a refused class or a missing file raises one error naming the file (`CheckpointLoadError`:
  `NotACheckpointError`, `DamagedCheckpointError`; FileNotFoundError).
- Sharing: `share_mapped_tensors`, the model's load_state_dict pre-hook: a parameter or buffer whose incoming tensor
  lies in a file's mapping (a checkpoint loaded mapped), with its shape, dtype and device, takes that tensor's memory
  instead of a copy of it. The weights stay the file's pages, which the decoding runtime gives back once it has packed
  them (cpu/native.py); the mapping is private (copy-on-write), so training them later writes only the process's
  copies, never the file.
- Saving: `save_atomic(state, path)` writes a temporary file beside `path`, fsyncs it and renames it
  over `path`; `copy_atomic` copies a complete file the same way. A process killed at any instant
  leaves `path` as the old complete file or the new one. `output_file_problem` checks an output path
  before any work.
- Configuration: `stored_model_config(state)` / `model_config(state)` read the model options a
  fairseq checkpoint stores (cfg["model"], or "args" in old files).
- Options: `check_rfa_overrides` refuses --model-overrides that change an RFA option the weights
  depend on; `warn_unknown_rfa_overrides` warns about rfa* keys that are no option;
  `mark_rfa_checkpoint` puts the plugin marker first in rfa_* checkpoints.

fairseq's own loading and saving go through these too: `fairseq_compat` wraps
`checkpoint_utils.load_checkpoint_to_cpu`, `torch_persistent_save` and the copies of
`save_checkpoint` with them; `resume` picks the checkpoint fairseq-train resumes from.
"""
import argparse
import contextlib
import contextvars
import difflib
import os
import pickle
import shutil
import warnings
import zipfile

import torch

from .checkpoint_safety import NeedsUserDirRfaFairseq

# name under which rfa_* checkpoints carry the marker; first key of the checkpoint dict
PLUGIN_MARKER_KEY = "rfa_fairseq_plugin_required"


# ---------------------------------------------------------------- the allowlist


def _numpy_classes():
    """numpy arrays in extra_state["metrics"] of runs with --eval-bleu (sacrebleu's n-gram counts
    and totals, int64 arrays). Both spellings of _reconstruct: numpy >= 2 pickles
    numpy._core.multiarray, checkpoints written under numpy 1.x say numpy.core.multiarray."""
    try:
        import numpy as np
    except ImportError:
        return []
    core = getattr(np, "_core", None) or np.core
    reconstruct = core.multiarray._reconstruct
    return [
        reconstruct,
        (reconstruct, "numpy.core.multiarray._reconstruct"),
        (reconstruct, "numpy._core.multiarray._reconstruct"),
        np.ndarray,
        np.dtype,
        type(np.dtype(np.int64)),  # numpy.dtypes.Int64DType
    ]


# Every class a fairseq 0.12 checkpoint pickles besides tensors and builtin containers, found by
# training and scanning checkpoints (torch.serialization.get_unsafe_globals_in_checkpoint) with
# adam/adafactor/sgd/nag/adagrad/adamax/adadelta, --amp, --ema-decay --store-ema, four lr
# schedulers, --eval-bleu --best-checkpoint-metric bleu, fairseq-hydra-train, and the
# transformer and rfa_transformer architectures (tests/test_checkpoint_safety.py):
#   argparse.Namespace      the legacy model configuration, cfg["model"] (and "args" in old files)
#   numpy ndarray/dtype     --eval-bleu metrics (see _numpy_classes)
#   NeedsUserDirRfaFairseq  our marker in rfa_* checkpoints
# fp16/bf16 runs add only a float "loss_scale" to the optimizer state (fairseq/optim/fp16_optimizer.py)
# and store half-precision tensors, which weights_only reads natively.
FAIRSEQ_CHECKPOINT_CLASSES = [argparse.Namespace, NeedsUserDirRfaFairseq, *_numpy_classes()]


def broadcast_checkpoint_classes():
    """What rank 0's in-memory checkpoint (after load_checkpoint_to_cpu: cfg is an omegaconf
    DictConfig) pickles when fairseq broadcasts it to the other ranks, found with
    get_unsafe_globals_in_checkpoint on such a broadcast. Allowlisted only while one is read."""
    import typing
    from collections import defaultdict

    from fairseq.distributed.utils import _TensorPlaceholder
    from omegaconf import DictConfig, ListConfig, base, nodes

    value_nodes = [getattr(nodes, name) for name in (
        "AnyNode", "StringNode", "IntegerNode", "FloatNode", "BooleanNode", "BytesNode", "PathNode")
        if hasattr(nodes, name)]
    return [DictConfig, ListConfig, base.ContainerMetadata, base.Metadata, *value_nodes,
            typing.Any, defaultdict, dict, list, int, _TensorPlaceholder]


def with_named_twins(entries):
    """Each class also as (class, "module.qualname"). torch's `safe_globals` context manager
    removes the classes it was given on exit, even ones allowlisted before it was entered; code
    elsewhere that wraps a load in `with safe_globals([argparse.Namespace])` would otherwise
    un-allowlist Namespace for the rest of the process. The named twin is a different set entry
    that such an exit leaves in place."""
    twins = []
    for entry in entries:
        twins.append(entry)
        if not isinstance(entry, tuple):
            twins.append((entry, f"{entry.__module__}.{entry.__qualname__}"))
    return twins


def allowlist_checkpoint_classes() -> None:
    """Allowlist FAIRSEQ_CHECKPOINT_CLASSES for torch's weights_only loading (idempotent)."""
    torch.serialization.add_safe_globals(with_named_twins(FAIRSEQ_CHECKPOINT_CLASSES))


# ---------------------------------------------------------------- loading


class CheckpointLoadError(pickle.UnpicklingError):
    """A checkpoint was not loaded: refused classes or a damaged file. Subclasses UnpicklingError,
    like torch's own refusal, so code that handled torch's error still handles this one."""


def _refused_classes(path):
    try:
        return torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception:  # the diagnosis must never hide the original error
        return []


def _torch_detail(exc):
    text = str(exc)
    marker = "WeightsUnpickler error:"
    detail = text.split(marker, 1)[1] if marker in text else text
    unsafe_message = getattr(torch.serialization, "UNSAFE_MESSAGE", None)
    if unsafe_message:
        detail = detail.replace(unsafe_message, "")
    return " ".join(detail.split())[:400]


class NotACheckpointError(CheckpointLoadError):
    """The file is not a torch checkpoint at all (text, another format, a directory, empty)."""


class DamagedCheckpointError(CheckpointLoadError):
    """A torch checkpoint whose bytes are not those that were saved: cut short or overwritten."""


# what a file that torch.save wrote starts with: a zip archive (torch >= 1.6), or a pickle (the legacy format)
_ZIP_MAGIC = b"PK\x03\x04"
_PICKLE_PROTOCOL = 0x80
# paths (with inode, size and mtime) whose checksums were verified in this process: resume checks a
# candidate, then fairseq loads it; the second check of unchanged bytes is skipped
_VERIFIED = set()


def _file_key(path):
    info = os.stat(path)
    return (os.path.abspath(path), info.st_ino, info.st_size, info.st_mtime_ns)


def verify_checkpoint_file(path, checksums=True):
    """Check that `path` is a complete torch checkpoint with the bytes that were saved, before unpickling it.

    torch.save writes a zip archive with a CRC-32 of every record (the pickled structure and each
    tensor's bytes) but torch.load does not check them, so a checkpoint whose weights were overwritten
    loads and fails (or decodes garbage) later. Here every record's CRC-32 is recomputed (about 1 GB/s;
    as long as the load itself). Raises NotACheckpointError / DamagedCheckpointError naming the file;
    FileNotFoundError when it does not exist. checksums=False checks only the kind and completeness of
    the file (cheap: a few reads at its start and end)."""
    if os.path.isdir(path):
        raise NotACheckpointError(f"{path} is a directory, not a checkpoint file: pass a checkpoint file "
                                  f"such as {os.path.join(path, 'checkpoint_best.pt')}")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint not found: {path}")
    key = _file_key(path)
    if key in _VERIFIED:
        return
    size = key[2]
    with open(path, "rb") as handle:
        head = handle.read(16)
    if head[:len(_ZIP_MAGIC)] != _ZIP_MAGIC:
        if head[:1] == bytes([_PICKLE_PROTOCOL]):
            return  # torch's legacy (pre-1.6) format carries no checksums; torch.load reports its damage
        shown = head.decode("latin-1").encode("unicode_escape").decode("ascii")
        raise NotACheckpointError(
            f"{path} is not a torch checkpoint ({size} bytes, starting with '{shown}'; a checkpoint written by "
            f"torch.save/fairseq-train is a zip archive): check the file name you passed"
            if size else f"{path} is empty (0 bytes), not a checkpoint: it was probably being written when the "
            f"process was stopped; pass another checkpoint")
    if not zipfile.is_zipfile(path):
        raise DamagedCheckpointError(
            f"checkpoint {path} is truncated ({size} bytes, the zip archive has no end): it was cut short while "
            f"being written; pass an intact checkpoint (fairseq-train resumes from the newest intact one by itself)")
    if not checksums:
        return
    record = None
    try:
        with zipfile.ZipFile(path) as archive:
            for record in archive.infolist():
                with archive.open(record) as stream:  # zipfile checks the record's CRC-32 at its end
                    while stream.read(1 << 22):
                        pass
    except (zipfile.BadZipFile, EOFError, OSError) as exc:
        if record is not None and "CRC" in str(exc):
            what = "the pickled structure" if record.filename.endswith("data.pkl") else "tensor data"
            raise DamagedCheckpointError(
                f"checkpoint {path} is damaged: record {record.filename} ({what}, {record.file_size} bytes) fails its "
                f"CRC-32 check, its bytes changed after it was saved; pass an intact checkpoint") from exc
        raise DamagedCheckpointError(f"checkpoint {path} is damaged ({exc}); pass an intact checkpoint") from exc
    _VERIFIED.add(key)


def explain_load_failure(path, exc):
    """A CheckpointLoadError for `exc`, raised by torch.load(path), or None if it is not a load failure."""
    if isinstance(exc, CheckpointLoadError):
        return exc
    if isinstance(exc, pickle.UnpicklingError) and "Weights only load failed" in str(exc):
        refused = _refused_classes(path)
        if NeedsUserDirRfaFairseq.__module__ + "." + NeedsUserDirRfaFairseq.__name__ in refused:
            return CheckpointLoadError(f"cannot load {path}: it is an rfa_fairseq checkpoint; {NeedsUserDirRfaFairseq.hint}")
        if refused:
            return CheckpointLoadError(
                f"refusing to load checkpoint {path}: it pickles {', '.join(refused)}, which a fairseq/rfa_fairseq "
                f"checkpoint does not contain. torch's weights_only loader refused it because unpickling arbitrary "
                f"objects can run code. Do not load files you do not trust; if this file is trusted and needs the "
                f"class, allowlist exactly that class with torch.serialization.add_safe_globals. "
                f"(torch: {_torch_detail(exc)})"
            )
    if isinstance(exc, (pickle.UnpicklingError, RuntimeError, EOFError, KeyError, ValueError, IndexError,
                        UnicodeDecodeError, AttributeError, TypeError, zipfile.BadZipFile)):
        size = os.path.getsize(path) if os.path.isfile(path) else 0
        return DamagedCheckpointError(
            f"checkpoint {path} cannot be read ({size} bytes; torch: {type(exc).__name__}: {_torch_detail(exc)}): "
            f"it is damaged or not a torch checkpoint; pass an intact checkpoint")
    return None


def mappable(path) -> bool:
    """Whether torch.load can map the file `path` (mmap=True) rather than read it: torch >= 1.6's zip format; torch <
    1.6's is read whole."""
    with open(path, "rb") as f:
        return f.read(len(_ZIP_MAGIC)) == _ZIP_MAGIC


def safe_load(path, mmap=False, verify=None):
    """torch.load(path) to the CPU with weights_only=True; failures raise CheckpointLoadError naming the file.
    `verify` (default: unless mmap, which is for cheap reads of the options) checks the file's checksums first."""
    if verify if verify is not None else not mmap:
        verify_checkpoint_file(path)
    elif not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint not found: {path}")
    mmap = mmap and mappable(path)
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as exc:  # torch raises many kinds on a damaged file (KeyError, RuntimeError, ...)
        explained = explain_load_failure(path, exc)
        if explained is None:
            raise
        raise explained from exc


# set while fairseq's load_model_ensemble_and_task builds models whose every parameter a checkpoint sets (strict
# loading: a missing one is an error), fairseq_compat's model-built-for-its-checkpoint
_LOADING_CHECKPOINT = contextvars.ContextVar("rfa_loading_checkpoint", default=False)


@contextlib.contextmanager
def loading_checkpoint():
    """The models built inside are loaded from a checkpoint that sets every parameter (strict)."""
    token = _LOADING_CHECKPOINT.set(True)
    try:
        yield
    finally:
        _LOADING_CHECKPOINT.reset(token)


@contextlib.contextmanager
def parameters_left_unset():
    """Inside (a model built for its checkpoint, loading_checkpoint), torch.nn.init's fills leave their tensor as it
    is: the parameters' memory is not written before the checkpoint's pages replace it (share_mapped_tensors), so it
    never becomes resident: the load's peak is not the model's size. Elsewhere: nothing changes."""
    if not _LOADING_CHECKPOINT.get():
        yield
        return
    import torch.nn.init as init

    fills = {name: getattr(init, name) for name in dir(init)
             if name.endswith("_") and not name.startswith("_") and callable(getattr(init, name))}

    def unset(tensor, *args, **kwargs):
        return tensor

    try:
        for name in fills:
            setattr(init, name, unset)
        yield
    finally:
        for name, fill in fills.items():
            setattr(init, name, fill)


def share_mapped_tensors(module, state_dict, prefix, *_hook_args) -> None:
    """nn.Module.load_state_dict pre-hook of the model (registered by the rfa_transformer model): every parameter or
    buffer whose state_dict entry is a file's mapping of the same shape, dtype and device takes that entry's memory
    (`.data`, so its Parameter object, ties and optimizer entries are kept), and the entry becomes the tensor itself:
    the load's copy is then of a tensor onto itself, which torch skips. Other entries are copied as usual."""
    from .file_mappings import FileMappings

    mappings = None
    own = {**dict(module.named_parameters(prefix=prefix.rstrip("."), remove_duplicate=False)),
           **dict(module.named_buffers(prefix=prefix.rstrip("."), remove_duplicate=False))}
    for key, target in own.items():
        incoming = state_dict.get(key)
        if (not isinstance(incoming, torch.Tensor) or target is None or incoming.shape != target.shape
                or incoming.dtype != target.dtype or incoming.device != target.device):
            continue
        mappings = mappings or FileMappings.now()
        if mappings.holds(incoming):
            target.data = incoming
            state_dict[key] = target


def num_updates(state):
    """The update count a fairseq checkpoint was saved at (0 when it records none)."""
    history = state.get("optimizer_history") or [{}]
    return int(history[-1].get("num_updates", 0) or 0)


# ---------------------------------------------------------------- saving


def is_local_path(path):
    """Whether `path` is a file on this machine (not an iopath URL such as manifold:// or s3://)."""
    from fairseq.file_io import PathManager

    return not PathManager.path_requires_pathmanager(str(path))


def _fsync_directory(directory):
    """Make a rename in `directory` durable (a power loss after it cannot bring the old name back)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # some filesystems cannot open directories; the rename is still atomic
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _temporary_name(output):
    return f"{output}.tmp{os.getpid()}"


def _publish(tmp_path, output):
    """Rename the complete `tmp_path` over `output`: readers see the old file or the new one, never a part."""
    os.replace(tmp_path, output)
    _fsync_directory(os.path.dirname(os.path.abspath(output)))


def output_file_problem(output, flag="--output"):
    """Why `output` cannot be written as a checkpoint file (checked before any work), or None."""
    output = str(output)
    if os.path.isdir(output):
        return (f"{flag} {output} is a directory; give a file name, e.g. "
                f"{flag} {os.path.join(output, 'checkpoint.pt')}")
    parent = os.path.dirname(os.path.abspath(output))
    while not os.path.exists(parent):  # save_atomic creates missing directories
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return f"{flag} {output}: {parent} is a file, not a directory"
    if not os.access(parent, os.W_OK):
        return f"{flag} {output}: directory {parent} is not writable"
    return None


def save_atomic(state, output):
    """torch.save to a temporary file beside `output`, flushed to disk (fsync) and renamed over it once
    complete: a process killed at any instant leaves `output` as the old complete file or the new one."""
    output = str(output)
    if os.path.isdir(output):
        raise IsADirectoryError(f"{output} is a directory; give the checkpoint a file name, e.g. "
                                f"{os.path.join(output, 'checkpoint.pt')}")
    directory = os.path.dirname(os.path.abspath(output))
    os.makedirs(directory, exist_ok=True)
    tmp_path = _temporary_name(output)
    try:
        with open(tmp_path, "wb") as handle:
            torch.save(state, handle)
            handle.flush()
            os.fsync(handle.fileno())
        _publish(tmp_path, output)
    finally:
        if os.path.exists(tmp_path):
            os.remove(tmp_path)


def copy_atomic(source, output):
    """Copy the complete file `source` to a temporary file beside `output`, flush it to disk (fsync) and
    rename it over `output`: `output` is the old complete file or the new one at every instant.
    A copy, not a hard link: the names stay independent files, so writing into one in place later
    (`cp other.pt checkpoint_best.pt`, a disk error) cannot change the others."""
    tmp_path = _temporary_name(output)
    try:
        shutil.copyfile(source, tmp_path)
        with open(tmp_path, "rb+") as handle:
            os.fsync(handle.fileno())
        _publish(tmp_path, output)
    finally:
        if os.path.lexists(tmp_path):
            os.remove(tmp_path)


# ---------------------------------------------------------------- the stored model configuration


def stored_model_config(state):
    """The model configuration as stored in a checkpoint (Namespace, dict or DictConfig), or None."""
    cfg = state.get("cfg")
    model = cfg.get("model") if cfg is not None else None
    if model is None:
        model = state.get("args")
    return model


def model_config(state):
    """The model configuration stored in a checkpoint, as a plain mapping ({} when there is none)."""
    model = stored_model_config(state)
    if model is None:
        return {}
    if isinstance(model, argparse.Namespace):
        return vars(model)
    try:
        from omegaconf import OmegaConf

        if OmegaConf.is_config(model):
            return OmegaConf.to_container(model)
    except ImportError:
        pass
    return dict(model)


def is_rfa_model_config(model_cfg) -> bool:
    return any(str(model_cfg.get(key) or "").startswith("rfa_") for key in ("_name", "arch"))


# ---------------------------------------------------------------- RFA options in checkpoints


def _same_value(override, stored):
    return str(override).strip().lower() == str(stored).strip().lower()


def overrides_weight_defining_option(arg_overrides) -> bool:
    """Whether --model-overrides names an RFA option the weights depend on (then it is checked)."""
    from .config import WEIGHT_DEFINING_RFA_OPTIONS

    return bool(arg_overrides) and any(name in arg_overrides for name in WEIGHT_DEFINING_RFA_OPTIONS)


def check_rfa_overrides(path, state, arg_overrides) -> None:
    """Refuse --model-overrides that change an RFA option the checkpoint's weights depend on."""
    from .config import RFA_DEFAULTS, WEIGHT_DEFINING_RFA_OPTIONS, RFAOptionMismatchError, flag

    stored_cfg = model_config(state)
    if not arg_overrides or not is_rfa_model_config(stored_cfg):
        return
    for name in WEIGHT_DEFINING_RFA_OPTIONS:
        if name not in arg_overrides:
            continue
        stored = stored_cfg.get(name, RFA_DEFAULTS[name])
        if stored is None:
            stored = RFA_DEFAULTS[name]
        if not _same_value(arg_overrides[name], stored):
            raise RFAOptionMismatchError(
                f"--model-overrides sets {name}={arg_overrides[name]!r}, but checkpoint {path} was trained with "
                f"{flag(name)} {stored} ({name}={stored!r}); its weights only work with that value. Drop {name} "
                f"from --model-overrides (to change it, fine-tune with fairseq-train --finetune-from-model)."
            )


_WARNED_OVERRIDES = set()


def warn_unknown_rfa_overrides(arg_overrides) -> list:
    """Warn (once per key and process) about rfa* keys of --model-overrides that are no RFA option:
    fairseq sets any key silently, so a typo would leave the option at its trained value. Returns the keys."""
    from .config import RFA_DEFAULTS

    unknown = [key for key in (arg_overrides or {}) if str(key).startswith("rfa") and key not in RFA_DEFAULTS]
    for key in unknown:
        if key in _WARNED_OVERRIDES:
            continue
        _WARNED_OVERRIDES.add(key)
        close = difflib.get_close_matches(str(key).replace("-", "_"), list(RFA_DEFAULTS), n=1, cutoff=0.6)
        hint = f"did you mean '{close[0]}'?" if close else f"the RFA options are {', '.join(RFA_DEFAULTS)}"
        warnings.warn(f"rfa_fairseq: --model-overrides key '{key}' is not an RFA option and changes nothing; {hint}",
                      UserWarning, stacklevel=2)
    return unknown


def check_checkpoint_against_overrides(path, arg_overrides) -> None:
    """check_rfa_overrides on the options as trained, read from `path` before fairseq applies the overrides."""
    if not overrides_weight_defining_option(arg_overrides):
        return
    check_rfa_overrides(path, safe_load(path, mmap=True), arg_overrides)  # mmap keeps reading the options cheap


def mark_rfa_checkpoint(state):
    """State with the plugin marker as its first entry if it is an rfa_* checkpoint (else unchanged)."""
    if not isinstance(state, dict) or PLUGIN_MARKER_KEY in state or not is_rfa_model_config(model_config(state)):
        return state
    # first key: torch reports the first refused class, and it must be this one, not argparse.Namespace
    return {PLUGIN_MARKER_KEY: NeedsUserDirRfaFairseq(), **state}
