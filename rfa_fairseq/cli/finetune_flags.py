"""The architecture and --rfa-* flags that rebuild the model stored in an rfa_transformer checkpoint, so that
`fairseq-train --finetune-from-model CKPT` builds a model the checkpoint fits (scripts/train.sh FINETUNE_FROM):

    python -m rfa_fairseq.cli.finetune_flags RFA.pt
    rfa_transformer                                            (line 1: the architecture)
    --rfa-feature-map hedgehog --rfa-num-features 64 ...       (line 2: the flags)

Only options that shape the weights or what they compute are printed (config.MODEL_DEFINING_RFA_OPTIONS); the
speed-only ones (kernels, chunk size) stay the command line's. Exit status 1 with a message naming the file when
it is missing, not a fairseq checkpoint, or not an RFA model (convert a softmax one first).
"""
import sys

from ..checkpoints import CheckpointLoadError, model_config, safe_load
from ..config import MODEL_DEFINING_RFA_OPTIONS, RFA_DEFAULTS, flag


class FinetuneSourceError(Exception):
    pass


def finetune_flags(path):
    """(arch, [flags]) of the rfa_transformer checkpoint at `path`."""
    try:
        state = safe_load(path)
    except FileNotFoundError:
        raise FinetuneSourceError(f"{path}: no such file")
    except CheckpointLoadError as exc:
        raise FinetuneSourceError(str(exc))
    options = model_config(state) if isinstance(state, dict) else {}
    arch = options.get("arch") or options.get("_name")
    if not arch:
        raise FinetuneSourceError(f"{path} has no model configuration: is it a fairseq checkpoint?")
    if not str(arch).startswith("rfa_"):
        raise FinetuneSourceError(
            f"{path} is a {arch} model, not rfa_transformer: convert it first with "
            f"rfa-convert-transformer --input {path} --output RFA.pt --calibration-data DATA_BIN")
    flags = []
    for name in MODEL_DEFINING_RFA_OPTIONS:
        if options.get(name) is None:
            continue
        value, default = options[name], RFA_DEFAULTS[name]
        if isinstance(default, bool):
            if value:
                flags.append(flag(name))
            elif default:  # on by default (config.ON_BY_DEFAULT): --no-FLAG turns it off
                flags.append("--no-" + flag(name)[2:])
        else:
            flags += [flag(name), str(value)]
    return str(arch), flags


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m rfa_fairseq.cli.finetune_flags RFA_CHECKPOINT", file=sys.stderr)
        return 2
    try:
        arch, flags = finetune_flags(argv[0])
    except FinetuneSourceError as exc:
        print(f"finetune_flags: error: {exc}", file=sys.stderr)
        return 1
    print(arch)
    print(" ".join(flags))
    return 0


if __name__ == "__main__":
    sys.exit(main())
