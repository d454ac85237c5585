"""fairseq-train that SIGKILLs itself at a chosen instant inside a checkpoint save (test helper).

    RFA_KILL_AT=POINT:N python tests/fairseq_train_kill.py FAIRSEQ_TRAIN_ARGS...

POINT is one step of the plugin's checkpoint writing (rfa_fairseq/checkpoints.py), N counts its
occurrences in this process (1 = the first):
    write    torch.save of a checkpoint into its temporary file, killed when half of its bytes are written
    copy     the copy of a saved checkpoint to checkpoint_last.pt / checkpoint_best.pt / ..., killed half-way
    publish  the rename of a complete temporary file to its final name, killed just before it
    prune    fairseq's removal of an old checkpoint (--keep-interval-updates), killed just after one
The process dies as a preempted or OOM-killed job does: SIGKILL, no cleanup. Without RFA_KILL_AT this
is fairseq-train. The hooks wrap functions in this process only; the package has no test hooks.
"""
import io
import os
import shutil
import signal
import sys

import torch
from fairseq_cli.train import cli_main

from rfa_fairseq import checkpoints


def die():
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def install_kill(point: str, occurrence: int) -> None:
    seen = {"count": 0}

    def reached(name):
        if name != point:
            return False
        seen["count"] += 1
        return seen["count"] == occurrence

    save = torch.save

    def save_then_die_half_way(obj, f, *args, **kwargs):
        name = getattr(f, "name", f)
        if ".pt.tmp" in str(name) and reached("write"):
            buffer = io.BytesIO()
            save(obj, buffer, *args, **kwargs)
            f.write(buffer.getvalue()[: buffer.tell() // 2])
            f.flush()
            die()
        return save(obj, f, *args, **kwargs)

    copyfile = shutil.copyfile

    def copy_then_die_half_way(src, dst, *args, **kwargs):
        if ".pt.tmp" in str(dst) and reached("copy"):
            with open(src, "rb") as source, open(dst, "wb") as target:
                data = source.read()
                target.write(data[: len(data) // 2])
            die()
        return copyfile(src, dst, *args, **kwargs)

    publish = checkpoints._publish

    def die_before_publish(tmp_path, output):
        if reached("publish"):
            die()
        return publish(tmp_path, output)

    remove = os.remove

    def remove_then_die(path, *args, **kwargs):
        result = remove(path, *args, **kwargs)
        if os.path.basename(str(path)).startswith("checkpoint") and str(path).endswith(".pt") and reached("prune"):
            die()
        return result

    torch.save = save_then_die_half_way
    shutil.copyfile = copy_then_die_half_way
    checkpoints._publish = die_before_publish
    os.remove = remove_then_die


if __name__ == "__main__":
    if os.environ.get("RFA_KILL_AT"):
        point, occurrence = os.environ["RFA_KILL_AT"].split(":")
        install_kill(point, int(occurrence))
    sys.argv[0] = "fairseq-train"
    sys.exit(cli_main())
