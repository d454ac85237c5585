#!/usr/bin/env python3
"""A change's speed against the code before it: the static beam search of the same random model (the Multi30k
recipe's dimensions: 3 + 3 layers, 256 wide, vocabulary 8,000, beam 4, every output forced to 16 tokens, sources
of 14) per sentence at batch 1 and 32, fp32 and int8, one thread, in two checkouts whose C++ module is built in
place (`python setup.py build_ext --inplace` in each), taking turns (run noise hits both alike). Writes one CSV row
per (checkout, precision, batch size, turn): the best of --repeats in milliseconds per sentence.

    git worktree add /tmp/before REV && (cd /tmp/before && python setup.py build_ext --inplace)
    python benchmarks/compare_checkouts.py /tmp/before . --csv benchmarks/results/compare_checkouts_<name>.csv
"""
import argparse
import csv
import os
import subprocess
import sys

WORKER = r"""
import sys, time, torch
root, precision, batch, repeats = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
sys.path[:0] = [root, root + "/tests"]
import rfa_fairseq
assert rfa_fairseq.__file__.startswith(root), f"rfa_fairseq from {rfa_fairseq.__file__}, not {root}"
from helpers import build_model, make_dictionary
from rfa_fairseq.generation import StaticBeamSearchGenerator
torch.set_num_threads(1)
dims = ["--encoder-embed-dim", "256", "--decoder-embed-dim", "256", "--encoder-ffn-embed-dim", "1024",
        "--decoder-ffn-embed-dim", "1024", "--encoder-layers", "3", "--decoder-layers", "3",
        "--encoder-attention-heads", "4", "--decoder-attention-heads", "4"]
model, d = build_model(dims, dictionary=make_dictionary(8000))
model.eval()
model.decoder.rfa.rfa_decode_precision = precision
generator = StaticBeamSearchGenerator(model, d, beam_size=4, max_len_a=0, max_len_b=15, min_len=15)
src = torch.randint(4, 8000, (batch, 14), generator=torch.Generator().manual_seed(0))
src[:, -1] = d.eos()
sample = {"net_input": {"src_tokens": src, "src_lengths": torch.full((batch,), 14)}}
with torch.no_grad():
    for _ in range(3):
        generator.generate([model], sample)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        generator.generate([model], sample)
        best = min(best, time.perf_counter() - start)
print(f"RESULT {1000 * best / batch:.4f}")
"""


def describe(root: str) -> str:
    """The checkout's commit, with "+changes" when its tracked files differ from it."""
    commit = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            timeout=60).stdout.strip()
    dirty = subprocess.run(["git", "-C", root, "diff", "--quiet", "HEAD"], timeout=60).returncode != 0
    return commit + ("+changes" if dirty else "")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("before", help="the checkout before the change (its C++ module built in place)")
    p.add_argument("after", help="the checkout with the change")
    p.add_argument("--turns", type=int, default=2)
    p.add_argument("--csv", required=True)
    args = p.parse_args()
    rows = []
    commits = {name: describe(root) for name, root in (("before", args.before), ("after", args.after))}
    for turn in range(args.turns):
        for name, root in (("before", args.before), ("after", args.after)):
            root = os.path.abspath(root)
            for precision in ("fp32", "int8"):
                for batch, repeats in ((1, 60), (32, 8)):
                    proc = subprocess.run([sys.executable, "-c", WORKER, root, precision, str(batch), str(repeats)],
                                          capture_output=True, text=True, timeout=1800,
                                          env=dict(os.environ, OMP_NUM_THREADS="1"))
                    result = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
                    if proc.returncode != 0 or not result:
                        sys.exit(f"compare_checkouts: {root} {precision} batch {batch} failed:\n{proc.stderr[-2000:]}")
                    ms = float(result[0].split()[1])
                    rows.append({"checkout": name, "commit": commits[name], "precision": precision, "batch_size": batch,
                                 "turn": turn, "ms_per_sentence": f"{ms:.3f}"})
                    print(f"turn {turn} {name:6s} {precision} batch {batch:2d}: {ms:.3f} ms per sentence", flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.csv)), exist_ok=True)
    with open(args.csv + ".tmp", "w", newline="") as f:
        writer = csv.DictWriter(f, list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    os.replace(args.csv + ".tmp", args.csv)
    print(f"wrote {args.csv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
