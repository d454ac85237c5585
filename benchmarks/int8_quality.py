#!/usr/bin/env python3
"""What reduced-precision decoding costs in quality: fairseq-generate of one rfa_transformer checkpoint in the
reference precision (fp32 linear layers, the causal layers' state in fp32: --model-overrides
"{'rfa_decode_precision': 'fp32', 'rfa_decode_state': 'fp32'}") and in a scheme (--scheme: int8 linear layers with
the fp16 state, --rfa-decode-precision int8's default; or fp32 linear layers with the fp16 state, the fp32 default's),
on the test and valid splits of a Multi30k pair (beam 4, length penalty 1, max length source + 50, batch 64,
SentencePiece-decoded), scored with sacreBLEU against the raw references; one CSV row per (pair, split, scheme): both
BLEUs, their difference, and how many hypotheses are identical. Rows already in the CSV are kept (--redo measures
them again).

    python benchmarks/int8_quality.py --pair en-de --prep outputs/multi30k --checkpoint CKPT [--scheme fp32_fp16_state]
    python benchmarks/int8_quality.py --pair en-fr --prep outputs/multi30k_en_fr --checkpoint CKPT

The rule docs/benchmarks.md applies: a scheme's BLEU within 0.3 of the reference's on every (pair, split). The CSV's
`precision` column names the scheme: int8_fp16_state and fp32_fp16_state (SCHEMES); int8 (int8 codes with an fp32
state, to commit 3f65de5) and int8_u8 (CTranslate2's scheme: 8-bit codes with a +128 shift, measured at commit
4586dcd and not kept, docs/benchmarks.md) are earlier rows.
"""
import argparse
import csv
import datetime
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmark_common import PLUGIN_DIR, detokenized_hypotheses, write_csv  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "int8_quality_multi30k.csv")
SPLITS = {"test": "test", "valid": "valid"}  # fairseq's --gen-subset -> the prepared references' prefix
REFERENCE = {"rfa_decode_precision": "fp32", "rfa_decode_state": "fp32"}
SCHEMES = {  # the CSV's precision column -> fairseq-generate's --model-overrides
    "int8_fp16_state": {"rfa_decode_precision": "int8", "rfa_decode_state": "fp16"},  # --rfa-decode-precision int8
    "fp32_fp16_state": {"rfa_decode_precision": "fp32", "rfa_decode_state": "fp16"},  # the default
}


def translate(args, split: str, overrides: dict):
    """-> {sentence id: detokenized hypothesis} of fairseq-generate with these model overrides."""
    cmd = [sys.executable, "-m", "fairseq_cli.generate", os.path.join(args.prep, "data-bin"), "--user-dir", PLUGIN_DIR,
           "--path", args.checkpoint, "--gen-subset", split, "--beam", "4", "--lenpen", "1", "--max-len-a", "1",
           "--max-len-b", "50", "--batch-size", "64", "--required-batch-size-multiple", "1",
           "--post-process", "sentencepiece", "--num-workers", "0", "--cpu", "-s", "en", "-t", args.target,
           "--model-overrides", repr(overrides)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS=str(args.threads)))
    if proc.returncode != 0:
        sys.exit(f"int8_quality: fairseq-generate failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    return detokenized_hypotheses(proc.stdout)


def main(argv=None) -> int:
    import sacrebleu

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pair", choices=["en-de", "en-fr"], required=True)
    p.add_argument("--prep", required=True, help="data-prep/prepare-multi30k.sh's output for the pair")
    p.add_argument("--checkpoint", required=True, help="an rfa_transformer checkpoint of that pair")
    p.add_argument("--scheme", choices=sorted(SCHEMES), default="int8_fp16_state")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--csv", default=RESULTS)
    p.add_argument("--redo", action="store_true")
    args = p.parse_args(argv)
    args.target = args.pair.split("-")[1]
    for needed in ("data-bin", f"test.raw.{args.target}", f"valid.raw.{args.target}"):
        if not os.path.exists(os.path.join(args.prep, needed)):
            p.error(f"--prep {args.prep} has no {needed} (data-prep/prepare-multi30k.sh --pair {args.pair} writes it)")
    if not os.path.isfile(args.checkpoint):
        p.error(f"--checkpoint {args.checkpoint} does not exist")
    rows = list(csv.DictReader(open(args.csv, newline=""))) if os.path.exists(args.csv) else []
    def key_of(row):  # rows before the precision column are int8's
        return row["pair"], row["split"], row["checkpoint"], row.get("precision") or "int8"

    for split, prefix in SPLITS.items():
        key = (args.pair, split, os.path.normpath(args.checkpoint), args.scheme)
        if not args.redo and any(key_of(r) == key for r in rows):
            continue
        refs = open(os.path.join(args.prep, f"{prefix}.raw.{args.target}"), encoding="utf-8").read().splitlines()
        hyps = {name: translate(args, split, overrides)
                for name, overrides in (("fp32", REFERENCE), ("scheme", SCHEMES[args.scheme]))}
        score = {name: sacrebleu.corpus_bleu([h[i] for i in range(len(refs))], [refs]).score
                 for name, h in hyps.items()}
        same = sum(hyps["fp32"][i] == hyps["scheme"][i] for i in range(len(refs))) / len(refs)
        row = {"pair": args.pair, "split": split, "checkpoint": key[2], "precision": args.scheme,
               "sentences": len(refs), "bleu_fp32": f"{score['fp32']:.2f}", "bleu_scheme": f"{score['scheme']:.2f}",
               "scheme_minus_fp32": f"{score['scheme'] - score['fp32']:.2f}", "identical": f"{same:.4f}",
               "measured_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ")}
        rows = [r for r in rows if key_of(r) != key] + [row]
        write_csv(args.csv, rows)
        print(f"{args.pair} {split}: BLEU fp32 {row['bleu_fp32']}, {args.scheme} {row['bleu_scheme']} "
              f"({row['scheme_minus_fp32']:>5}), identical {same:.1%}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
