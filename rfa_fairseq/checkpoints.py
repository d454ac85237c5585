"""Checkpoint handling in one place: safe loading, atomic saving, the stored model configuration and
the check of RFA options against it.

- Loading: `safe_load(path)` is `torch.load(path, weights_only=True)` on the CPU, never without
  weights_only. torch's weights_only unpickler refuses every pickled class that is not allowlisted;
  the plugin allowlists exactly the classes fairseq checkpoints pickle (`FAIRSEQ_CHECKPOINT_CLASSES`,
  allowlisted at import by `fairseq_compat`). A refused class, a truncated file or a missing file
  raises one error naming the file (`CheckpointLoadError`, FileNotFoundError).
- Saving: `save_atomic(state, path)` writes a temporary file and renames it, so an interrupted
  write never leaves a half-written checkpoint under the final name.
- Configuration: `stored_model_config(state)` / `model_config(state)` read the model options a
  fairseq checkpoint stores (cfg["model"], or "args" in old files).
- Options: `check_rfa_overrides` refuses --model-overrides that change an RFA option the weights
  depend on; `mark_rfa_checkpoint` puts the plugin marker first in rfa_* checkpoints.

fairseq's own loading and saving go through these too: `fairseq_compat` wraps
`checkpoint_utils.load_checkpoint_to_cpu` and `torch_persistent_save` with them.
"""
import argparse
import os
import pickle
import re

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


def _intact_candidates(path):
    """Epoch and update checkpoints (written atomically by fairseq) beside `path`, newest first."""
    directory = os.path.dirname(os.path.abspath(path))
    pattern = re.compile(r"checkpoint(\d+|_\d+_\d+)\.pt")
    names = [name for name in os.listdir(directory) if pattern.fullmatch(name)] if os.path.isdir(directory) else []
    names.sort(key=lambda name: os.path.getmtime(os.path.join(directory, name)), reverse=True)
    return names[:3]


def explain_load_failure(path, exc):
    """A CheckpointLoadError for `exc`, raised by torch.load(path), or None if it is not a load failure."""
    if isinstance(exc, CheckpointLoadError):
        return exc
    if isinstance(exc, pickle.UnpicklingError) and "Weights only load failed" in str(exc):
        refused = _refused_classes(path)
        if NeedsUserDirRfaFairseq.__module__ + "." + NeedsUserDirRfaFairseq.__name__ in refused:
            return CheckpointLoadError(f"cannot load {path}: it is an rfa_fairseq checkpoint; {NeedsUserDirRfaFairseq.hint}")
        names = ", ".join(refused) if refused else _torch_detail(exc)
        return CheckpointLoadError(
            f"refusing to load checkpoint {path}: it pickles {names}, which a fairseq/rfa_fairseq checkpoint "
            f"does not contain. torch's weights_only loader refused it because unpickling arbitrary objects "
            f"can run code. Do not load files you do not trust; if this file is trusted and needs the class, "
            f"allowlist exactly that class with torch.serialization.add_safe_globals. (torch: {_torch_detail(exc)})"
        )
    damaged = isinstance(exc, EOFError) or (isinstance(exc, RuntimeError) and "PytorchStreamReader" in str(exc))
    if damaged:
        size = os.path.getsize(path) if os.path.exists(path) else 0
        others = _intact_candidates(path)
        hint = f" Epoch/update checkpoints in that directory, newest first: {', '.join(others)}." if others else ""
        return CheckpointLoadError(
            f"checkpoint {path} is truncated or not a torch checkpoint ({size} bytes): it was probably being written "
            f"when the process was stopped (fairseq writes checkpoint_*.pt atomically but copies it to "
            f"checkpoint_last.pt/checkpoint_best.pt without). Resume from an intact one with --restore-file, or "
            f"delete this file.{hint}"
        )
    return None


def safe_load(path, mmap=False):
    """torch.load(path) to the CPU with weights_only=True; failures raise CheckpointLoadError naming the file."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint not found: {path}")
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except (pickle.UnpicklingError, RuntimeError, EOFError) as exc:
        explained = explain_load_failure(path, exc)
        if explained is None:
            raise
        raise explained from exc


# ---------------------------------------------------------------- saving


def save_atomic(state, output):
    """torch.save to a temporary file beside `output`, renamed over it once complete."""
    directory = os.path.dirname(os.path.abspath(output))
    os.makedirs(directory, exist_ok=True)
    tmp_path = f"{output}.tmp{os.getpid()}"
    try:
        torch.save(state, tmp_path)
        os.replace(tmp_path, output)
    finally:
        if os.path.exists(tmp_path):
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


def check_checkpoint_against_overrides(path, arg_overrides) -> None:
    """check_rfa_overrides on the options as trained, read from `path` before fairseq applies the overrides."""
    if not overrides_weight_defining_option(arg_overrides):
        return
    try:
        stored = safe_load(path, mmap=True)  # mmap keeps reading the options cheap
    except RuntimeError:  # legacy (non-zip) format cannot be mapped
        stored = safe_load(path)
    check_rfa_overrides(path, stored, arg_overrides)


def mark_rfa_checkpoint(state):
    """State with the plugin marker as its first entry if it is an rfa_* checkpoint (else unchanged)."""
    if not isinstance(state, dict) or PLUGIN_MARKER_KEY in state or not is_rfa_model_config(model_config(state)):
        return state
    # first key: torch reports the first refused class, and it must be this one, not argparse.Namespace
    return {PLUGIN_MARKER_KEY: NeedsUserDirRfaFairseq(), **state}
