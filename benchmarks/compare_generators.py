#!/usr/bin/env python3
"""fairseq-generate with the plugin's static beam search vs fairseq's SequenceGenerator, same checkpoint.

Runs fairseq-generate on one split at each --batch-sizes, the two generators alternating within each of
--repeats (SequenceGenerator by --model-overrides "{'rfa_static_beam_search': False}"), and prints per
batch size the fastest sentences/s of each (fairseq-generate's own timer: generation only), how many
hypotheses are identical, the largest score difference of identical ones (H- and P- lines) and, with
--ref, sacreBLEU of both.

    python benchmarks/compare_generators.py --data outputs/demo/data-bin --path outputs/demo/checkpoints/checkpoint_last.pt
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmark_common import PLUGIN_DIR  # noqa: E402

GENERATORS = {"static": True, "fairseq": False}  # name -> --rfa-static-beam-search


def generate(args, batch_size, static_beam_search):
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    command = ["fairseq-generate", args.data, "--user-dir", PLUGIN_DIR, "--path", args.path, "--gen-subset", args.subset,
               "--beam", str(args.beam), "--batch-size", str(batch_size), "--max-len-b", str(args.max_len_b),
               "--required-batch-size-multiple", "1", "--model-overrides",
               f"{{'rfa_static_beam_search': {static_beam_search}}}", *args.extra]
    proc = subprocess.run(command, capture_output=True, text=True, env=env, check=True)
    speed = re.search(r"Translated .* \(([\d.]+) sentences/s", proc.stdout + proc.stderr)
    return float(speed.group(1)), proc.stdout


def hypotheses(stdout):
    """{id: (score, text, positional scores)} from H- and P- lines."""
    found = {}
    for line in stdout.splitlines():
        fields = line.split("\t")
        if fields[0].startswith("H-"):
            found[int(fields[0][2:])] = [float(fields[1]), fields[2] if len(fields) > 2 else ""]
        elif fields[0].startswith("P-"):
            found[int(fields[0][2:])].append([float(x) for x in fields[1].split()])
    return found


def bleu(stdout, ref):
    hyps = hypotheses(stdout)
    with tempfile.NamedTemporaryFile("w", suffix=".hyp", delete=False) as f:
        f.write("".join(hyps[i][1] + "\n" for i in sorted(hyps)))
    out = subprocess.run(["sacrebleu", ref, "-i", f.name, "-m", "bleu", "-b", "-w", "2"], capture_output=True,
                         text=True, check=True).stdout.strip()
    os.unlink(f.name)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True)
    parser.add_argument("--path", required=True, help="checkpoint")
    parser.add_argument("--subset", default="test")
    parser.add_argument("--ref", help="plain-text references, one per line, for sacreBLEU")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[32, 128])
    parser.add_argument("--beam", type=int, default=4)
    parser.add_argument("--max-len-b", type=int, default=200)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("extra", nargs="*", help="more fairseq-generate options (after --)")
    args = parser.parse_args()
    for batch_size in args.batch_sizes:
        speeds, outputs = {name: [] for name in GENERATORS}, {}
        for _ in range(args.repeats):
            for name, forced in GENERATORS.items():
                speed, outputs[name] = generate(args, batch_size, forced)
                speeds[name].append(speed)
        static, fairseq = hypotheses(outputs["static"]), hypotheses(outputs["fairseq"])
        same = [i for i in static if static[i][1] == fairseq[i][1]]
        score_diff = max((abs(static[i][0] - fairseq[i][0]) for i in same), default=0.0)
        positional_diff = max((abs(a - b) for i in same for a, b in zip(static[i][2], fairseq[i][2])), default=0.0)
        print(f"batch {batch_size}, beam {args.beam}, {args.threads} threads: sentences/s static {max(speeds['static']):.1f} "
              f"{speeds['static']}, fairseq {max(speeds['fairseq']):.1f} {speeds['fairseq']}; identical hypotheses "
              f"{len(same)}/{len(static)}, max score difference H {score_diff:.2g} P {positional_diff:.2g}"
              + (f"; BLEU static {bleu(outputs['static'], args.ref)} fairseq {bleu(outputs['fairseq'], args.ref)}"
                 if args.ref else ""))


if __name__ == "__main__":
    main()
