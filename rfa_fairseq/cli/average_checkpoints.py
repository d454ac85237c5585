"""Average the parameters of several fairseq checkpoints (as fairseq's
scripts/average_checkpoints.py, which the installed fairseq does not ship).

Console script `rfa-average-checkpoints` (also `python -m rfa_fairseq.cli.average_checkpoints`):

  rfa-average-checkpoints --inputs CKPT_DIR --num-epoch-checkpoints 5 --output avg.pt
  rfa-average-checkpoints --inputs CKPT_DIR --num-update-checkpoints 5 --output avg.pt
  rfa-average-checkpoints --inputs a.pt b.pt c.pt --output avg.pt

Epoch checkpoints are checkpoint<EPOCH>.pt, update checkpoints checkpoint_<EPOCH>_<UPDATE>.pt;
the last N by number are used. Checkpoints are read with the plugin's loader
(`checkpoints.safe_load`: torch's weights_only unpickler, never weights_only=False, with only
the classes fairseq checkpoints need allowlisted). The output keeps everything but "model" from
the first input (with --num-*-checkpoints the newest), and is written atomically.
"""
import argparse
import collections
import os
import sys

if __package__:  # loaded as a file (rfa_fairseq_cli) only to answer --help and usage errors: no torch, no fairseq
    import torch

    from . import run_console_script
    from ..checkpoints import CheckpointLoadError, output_file_problem, safe_load, save_atomic
    from ..resume import EPOCH_CHECKPOINT_NAME, UPDATE_CHECKPOINT_NAME


class AveragingError(Exception):
    """A user-facing failure: missing or unreadable checkpoints, mismatched models."""


def load_checkpoint(path):
    """Load a checkpoint onto the CPU with the plugin's explicit weights_only loader."""
    try:
        return safe_load(path)
    except (CheckpointLoadError, FileNotFoundError) as exc:  # refused classes, damaged or missing file
        raise AveragingError(str(exc)) from exc
    except (RuntimeError, OSError, EOFError) as exc:
        raise AveragingError(f"cannot read checkpoint {path}: {exc}") from exc


def last_n_checkpoints(directory, n, update_based, upper_bound=None):
    """Paths of the n checkpoints with the highest epoch (or update) number,
    newest first, at most upper_bound when given."""
    if not os.path.isdir(directory):
        raise AveragingError(f"checkpoint directory not found: {directory}")
    pattern = UPDATE_CHECKPOINT_NAME if update_based else EPOCH_CHECKPOINT_NAME
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
    problem = output_file_problem(args.output)
    if problem:
        raise AveragingError(problem)
    n = args.num_epoch_checkpoints if args.num_epoch_checkpoints is not None else args.num_update_checkpoints
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
    return run_console_script("rfa-average-checkpoints", build_parser(), run, AveragingError, argv)


if __name__ == "__main__":
    sys.exit(main())
