"""Shared pieces of the CLI tests for distributed training, resume, checkpoint safety, bad input and
conversion: running fairseq's tools, one cached synthetic corpus, parsing the logs."""
import json
import os
import re
import socket
import subprocess
import sys
from collections import defaultdict

from conftest import REPO
from tiny_models import CLI_TINY_MODEL as TINY_MODEL  # noqa: F401  (the CLI tests import it from here)
from tiny_models import tiny_model_flags

BIN = os.path.dirname(sys.executable)
TESTS = os.path.dirname(os.path.abspath(__file__))
# fairseq-train with full-precision logged values (fairseq rounds the loss to 3 decimals)
UNROUNDED_TRAIN = os.path.join(TESTS, "fairseq_train_unrounded.py")
# fairseq-train that logs random-matrix draws and parameter checksums to $RFA_DEBUG_LOG (see debug_log)
DEBUG_LOG_TRAIN = os.path.join(TESTS, "fairseq_train_debug_log.py")

TINY_TRAIN = [
    "--optimizer", "adam", "--lr", "3e-3", "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "10",
    "--dropout", "0.1", "--max-tokens", "500", "--num-workers", "0", "--seed", "3", "--cpu",
]


def env(**extra):
    return {**os.environ, "OMP_NUM_THREADS": "1", "PATH": BIN + os.pathsep + os.environ.get("PATH", ""),
            **{k: str(v) for k, v in extra.items()}}


def run(tool, *args, check=True, timeout=600, cwd=None, stdin=None, **env_extra):
    """Run a console script of this environment (fairseq-train, ...), a python file, or a program on PATH;
    `stdin` (text) is fed to its standard input."""
    if tool.endswith(".py"):
        command = [sys.executable, tool]
    else:
        command = [os.path.join(BIN, tool) if os.path.exists(os.path.join(BIN, tool)) else tool]
    proc = subprocess.run([*command, *map(str, args)], input=stdin, capture_output=True, text=True,
                          env=env(**env_extra), timeout=timeout, cwd=cwd)
    if check and proc.returncode != 0:
        raise AssertionError(f"{tool} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def assert_exit_code(proc, code):
    """`proc` ended with exit code `code`: 1 for a refusal (an uncaught Python exception, a script's die),
    2 for an argparse error. Refusals are checked against their code, never as `!= 0`, which a crash
    (SIGABRT: -6 here, 134 through a shell) after the expected message would also satisfy."""
    assert proc.returncode == code, (f"expected exit code {code}, got {proc.returncode}:\n"
                                     f"{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")


def synthetic_data(tmp_path_factory, train=1500, valid=60, test=40):
    """Raw and binarized synthetic corpus, built once per pytest session and size."""
    root = tmp_path_factory.getbasetemp() / f"synthetic_{train}_{valid}_{test}"
    if not (root / "bin" / "test.src-tgt.tgt.idx").is_file():
        root.mkdir(exist_ok=True)
        run(os.path.join(REPO, "data-prep", "make_synthetic_corpus.py"), root / "raw",
            "--train", train, "--valid", valid, "--test", test)
        run("fairseq-preprocess", "--source-lang", "src", "--target-lang", "tgt",
            "--trainpref", root / "raw/train", "--validpref", root / "raw/valid", "--testpref", root / "raw/test",
            "--destdir", root / "bin", "--joined-dictionary", "--workers", "1")
    return root


# a decoder of 2 layers for the fairseq-generate comparisons (kernels, generators)
GENERATE_MODEL = tiny_model_flags(embed_dim=32, ffn_dim=64, heads=2, encoder_layers=1, decoder_layers=2)


def train_generate_model(data, save_dir, max_update):
    """A tiny rfa_transformer (D = 8) trained briefly on `data`, for comparing fairseq-generate outputs;
    returns its checkpoint_last.pt."""
    from conftest import PLUGIN_DIR

    run("fairseq-train", data / "bin", "--user-dir", PLUGIN_DIR, "--arch", "rfa_transformer", *GENERATE_MODEL,
        "--rfa-num-features", "8", "--optimizer", "adam", "--lr", "3e-3", "--lr-scheduler", "inverse_sqrt",
        "--warmup-updates", "10", "--max-tokens", "2000", "--num-workers", "0", "--seed", "3", "--max-update", max_update,
        "--no-epoch-checkpoints", "--save-dir", save_dir, "--cpu")
    return save_dir / "checkpoint_last.pt"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def json_losses(log_text):
    """{num_updates: loss} from `--log-format json --log-interval 1` train_inner lines."""
    losses = {}
    for line in log_text.splitlines():
        if "train_inner" in line and "{" in line:
            stats = json.loads(line[line.index("{"):])
            losses[int(stats["num_updates"])] = float(stats["loss"])
    return losses


_DRAW = re.compile(r"rank=(\d+) draw update=(-?\d+) module=(\d+) sum=(\S+)")
_PARAMS = re.compile(r"rank=(\d+) params update=(\d+) sum=(\S+)")


def debug_log(path):
    """Lines of DEBUG_LOG_TRAIN's RFA_DEBUG_LOG file: draws[rank][(update, module)] = [sums in order],
    params[rank][update] = [checksums in order]."""
    draws, params = defaultdict(lambda: defaultdict(list)), defaultdict(lambda: defaultdict(list))
    with open(path) as handle:
        for line in handle:
            if (m := _DRAW.match(line)):
                draws[int(m[1])][(int(m[2]), int(m[3]))].append(float(m[4]))
            elif (m := _PARAMS.match(line)):
                params[int(m[1])][int(m[2])].append(float(m[3]))
    return draws, params
