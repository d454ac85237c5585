"""Average the parameters of several fairseq checkpoints (as fairseq's
scripts/average_checkpoints.py, which the installed fairseq does not ship).

Console script `rfa-average-checkpoints` (also `python -m rfa_fairseq.average_checkpoints`):

  rfa-average-checkpoints --inputs CKPT_DIR --num-epoch-checkpoints 5 --output avg.pt
  rfa-average-checkpoints --inputs CKPT_DIR --num-update-checkpoints 5 --output avg.pt
  rfa-average-checkpoints --inputs a.pt b.pt c.pt --output avg.pt

Epoch checkpoints are checkpoint<EPOCH>.pt, update checkpoints checkpoint_<EPOCH>_<UPDATE>.pt;
the last N by number are used. Checkpoints are read with torch's weights_only loader
(never weights_only=False): only the classes fairseq checkpoints need are allowlisted.
The output keeps everything but "model" from the newest input, and is written atomically.
"""
import argparse
import collections
import os
import pickle
import re
import sys

import torch

# Classes a fairseq checkpoint pickles besides tensors and builtin containers:
# the legacy training args (also nested in cfg["model"] for legacy architectures).
_FALLBACK_SAFE_GLOBALS = [argparse.Namespace]


class AveragingError(Exception):
    """A user-facing failure: missing or unreadable checkpoints, mismatched models."""


def _allowlist_checkpoint_classes():
    try:
        from rfa_fairseq.checkpoint_safety import allowlist_fairseq_checkpoint_classes
    except ImportError:  # run as a plain file without the package on the path
        torch.serialization.add_safe_globals(_FALLBACK_SAFE_GLOBALS)
        return
    allowlist_fairseq_checkpoint_classes()


def load_checkpoint(path):
    """Load a checkpoint onto the CPU with weights_only loading."""
    if not os.path.isfile(path):
        raise AveragingError(f"checkpoint not found: {path}")
    _allowlist_checkpoint_classes()
    try:
        return torch.load(path, map_location="cpu")
    except pickle.UnpicklingError as exc:
        try:
            unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(path)
        except Exception:  # the diagnosis itself must not hide the original error
            unsafe = []
        detail = f" It pickles classes that are not allowlisted: {', '.join(unsafe)}." if unsafe else ""
        raise AveragingError(
            f"cannot load {path} with torch's weights_only loader.{detail} "
            f"If the file is trusted, allowlist those classes with torch.serialization.add_safe_globals "
            f"(see rfa_fairseq.checkpoint_safety). Original error: {exc}"
        ) from exc
    except (RuntimeError, OSError, EOFError) as exc:
        raise AveragingError(f"cannot read checkpoint {path}: {exc}") from exc


def last_n_checkpoints(directory, n, update_based, upper_bound=None):
    """Paths of the n checkpoints with the highest epoch (or update) number,
    newest first, at most upper_bound when given."""
    if not os.path.isdir(directory):
        raise AveragingError(f"checkpoint directory not found: {directory}")
    pattern = re.compile(r"checkpoint_\d+_(\d+)\.pt" if update_based else r"checkpoint(\d+)\.pt")
    entries = []
    for name in os.listdir(directory):
        match = pattern.fullmatch(name)
        if match is not None:
            number = int(match.group(1))
            if upper_bound is None or number <= upper_bound:
                entries.append((number, name))
    if len(entries) < n:
        kind = "update" if update_based else "epoch"
        found = ", ".join(name for _, name in sorted(entries)) or "none"
        raise AveragingError(f"found {len(entries)} {kind} checkpoints in {directory} ({found}) but need {n}")
    return [os.path.join(directory, name) for _, name in sorted(entries, reverse=True)[:n]]


def average_checkpoints(paths):
    """Return the first checkpoint's state with "model" replaced by the mean of
    all checkpoints' model parameters (integer buffers: floor of the mean)."""
    if not paths:
        raise AveragingError("no checkpoints to average")
    sums = collections.OrderedDict()
    keys = None
    new_state = None
    for path in paths:
        state = load_checkpoint(path)
        if "model" not in state:
            raise AveragingError(f"{path} has no 'model' entry; is it a fairseq checkpoint?")
        if new_state is None:
            new_state = state
        params = state["model"]
        if keys is None:
            keys = list(params.keys())
        elif list(params.keys()) != keys:
            differing = sorted(set(keys) ^ set(params.keys()))
            raise AveragingError(
                f"{path} has different parameters than {paths[0]}"
                + (f": {', '.join(differing[:10])}" if differing else " (order differs)")
            )
        for key in keys:
            param = params[key]
            if param.dtype == torch.float16 or param.dtype == torch.bfloat16:
                param = param.float()  # sum in fp32 (fairseq does the same for fp16)
            if key not in sums:
                sums[key] = param.clone()  # clone: shared parameters must not be summed in place
            else:
                if sums[key].shape != param.shape:
                    raise AveragingError(
                        f"parameter {key} has shape {tuple(param.shape)} in {path} "
                        f"but {tuple(sums[key].shape)} in {paths[0]}"
                    )
                sums[key] += param
    averaged = collections.OrderedDict()
    for key, total in sums.items():
        if total.is_floating_point():
            averaged[key] = total.div_(len(paths))
        else:
            averaged[key] = total // len(paths)
    new_state["model"] = averaged
    return new_state


def save_atomic(state, output):
    directory = os.path.dirname(os.path.abspath(output))
    os.makedirs(directory, exist_ok=True)
    tmp_path = f"{output}.tmp{os.getpid()}"
    try:
        torch.save(state, tmp_path)
        os.replace(tmp_path, output)
    finally:
        if os.path.exists(tmp_path):
            os.remove(tmp_path)


def build_parser():
    parser = argparse.ArgumentParser(
        prog="rfa-average-checkpoints", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--inputs", required=True, nargs="+",
                        help="checkpoint files, or one directory with --num-*-checkpoints")
    parser.add_argument("--output", required=True, help="averaged checkpoint to write")
    count = parser.add_mutually_exclusive_group()
    count.add_argument("--num-epoch-checkpoints", type=int, help="average the last N checkpoint<EPOCH>.pt")
    count.add_argument("--num-update-checkpoints", type=int, help="average the last N checkpoint_<E>_<U>.pt")
    parser.add_argument("--checkpoint-upper-bound", type=int,
                        help="ignore checkpoints with a larger epoch/update number")
    return parser


def run(args):
    n = args.num_epoch_checkpoints or args.num_update_checkpoints
    if n is not None:
        if len(args.inputs) != 1:
            raise AveragingError("with --num-epoch/update-checkpoints, --inputs must be one directory")
        if n < 1:
            raise AveragingError("the number of checkpoints to average must be >= 1")
        paths = last_n_checkpoints(
            args.inputs[0], n, update_based=args.num_update_checkpoints is not None,
            upper_bound=args.checkpoint_upper_bound,
        )
    else:
        if args.checkpoint_upper_bound is not None:
            raise AveragingError("--checkpoint-upper-bound needs --num-epoch-checkpoints or --num-update-checkpoints")
        paths = list(args.inputs)
    print("averaging: " + " ".join(paths), file=sys.stderr)
    state = average_checkpoints(paths)
    save_atomic(state, args.output)
    print(f"wrote averaged checkpoint {args.output}", file=sys.stderr)
    return paths


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        run(args)
    except AveragingError as exc:
        print(f"rfa-average-checkpoints: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
