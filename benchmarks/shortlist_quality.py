#!/usr/bin/env python3
"""What decoding with a vocabulary shortlist (--rfa-shortlist) costs in quality, for a grid of K and N.

fairseq-generate of one rfa_transformer checkpoint on the test and valid splits of a Multi30k pair (beam 4, length
penalty 1, max length source + 50, --batch-size B, SentencePiece-decoded, 1 thread), over the full vocabulary and
with the shortlist's first k candidates per source token and n frequent tokens (--model-overrides "{'rfa_shortlist':
PATH, 'rfa_shortlist_k': k, 'rfa_shortlist_n': n}"), scored with sacreBLEU against the raw references. The shortlist
is built once with the grid's largest K and N (rfa-build-shortlist --output DATA/shortlist.SRC-TGT.kK_nN.i5.npz, the
name benchmarks/shortlist_sizes.py gives it; skipped when up to date) and read at every smaller (k, n). One CSV row
per (pair, split, checkpoint and its updates, batch size, k, n): both BLEUs, their difference, how many hypotheses
are identical to the full vocabulary's (and why the others changed: how many of the full vocabulary's hypotheses lie
wholly in their batch's union, how many of those stayed identical), the union's mean size per batch at batch sizes
1, 32 and 128 (the split cut as fairseq-generate cuts it; the size the decoder's projection has); the full
vocabulary's row has k = n = full. The union is a batch's, so the hypotheses of a sentence depend on its batch:
batch 1 has the smallest unions (the strictest setting), larger batches approach the full vocabulary.

    python benchmarks/shortlist_quality.py --pair en-de --prep outputs/multi30k \
        --checkpoint outputs/quality/hedgehog_gate_softmax_cross_d32_u1000_s1/checkpoint_best.pt
    python benchmarks/shortlist_quality.py --pair en-fr --prep outputs/multi30k_en_fr --checkpoint CKPT \
        --k 10 20 50 --n 50 100 --batch-sizes 1
    python benchmarks/shortlist_quality.py --pair en-de --prep outputs/multi30k --checkpoint CKPT \
        --points 50:50 100:100 --splits test          # these (K, N) points instead of the --k x --n grid

Rows already in the CSV are kept and skipped (--redo measures them again): the study can be stopped and continued.
The rule of issue 72 (docs/benchmarks.md): with the default K and N, BLEU within 0.1 of the full vocabulary's and at
least 98 % of the hypotheses identical on every test and valid set of both pairs.
"""
import argparse
import datetime
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmark_common import PLUGIN_DIR, REPO, detokenized_hypotheses, write_csv  # noqa: E402

RESULTS = os.path.join(REPO, "benchmarks", "results", "shortlist_quality_multi30k.csv")
SPLITS = ("test", "valid")  # fairseq's --gen-subset; the prepared references are PREP/<split>.raw.<tgt>
UNION_BATCH_SIZES = (1, 32, 128)
FULL = "full"  # the k and n of the full vocabulary's rows
KEY = ("pair", "split", "checkpoint", "checkpoint_updates", "batch_size", "k", "n")  # a checkpoint trained on: new rows
ITERATIONS = 5  # rfa-build-shortlist's default


def log(message):
    print(f"[{time.strftime('%H:%M:%S')}] shortlist_quality: {message}", flush=True)


def read_rows(path):
    import csv

    if not os.path.isfile(path):
        return []
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def key_of(row) -> tuple:
    return tuple(str(row[name]) for name in KEY)


def build_shortlist(args) -> str:
    """The grid's shortlist (largest K and N), built by rfa-build-shortlist unless up to date."""
    data = os.path.join(args.prep, "data-bin")
    k, n = max(k for k, _ in args.points), max(n for _, n in args.points)
    path = args.shortlist or os.path.join(data, f"shortlist.{args.pair}.k{k}_n{n}.i{ITERATIONS}.npz")
    cli = [os.path.join(os.path.dirname(sys.executable), "rfa-build-shortlist"), data, "-s", args.source, "-t",
           args.target, "--k", str(k), "--n", str(n), "--iterations", str(ITERATIONS),
           "--output", path, "--quiet"]
    proc = subprocess.run(cli, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if proc.returncode != 0:
        sys.exit(f"shortlist_quality: {' '.join(cli)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return path


def translate(args, split: str, batch_size: int, overrides: dict, hyp_path: str) -> dict:
    """-> {sentence id: detokenized hypothesis} of fairseq-generate (kept in hyp_path: a later run reads it)."""
    if os.path.isfile(hyp_path):
        with open(hyp_path, encoding="utf-8") as handle:
            return detokenized_hypotheses(handle.read())
    cmd = [sys.executable, "-m", "fairseq_cli.generate", os.path.join(args.prep, "data-bin"), "--user-dir", PLUGIN_DIR,
           "--path", args.checkpoint, "--gen-subset", split, "--beam", "4", "--lenpen", "1", "--max-len-a", "1",
           "--max-len-b", "50", "--batch-size", str(batch_size), "--required-batch-size-multiple", "1",
           "--post-process", "sentencepiece", "--num-workers", "0", "--cpu", "-s", args.source, "-t", args.target]
    if overrides:
        cmd += ["--model-overrides", repr(overrides)]
    proc = subprocess.run(cmd, capture_output=True, text=True,
                          env=dict(os.environ, OMP_NUM_THREADS=str(args.threads)), timeout=args.timeout)
    if proc.returncode != 0:
        sys.exit(f"shortlist_quality: fairseq-generate failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    with open(hyp_path + ".tmp", "w", encoding="utf-8") as handle:
        handle.write(proc.stdout)
    os.replace(hyp_path + ".tmp", hyp_path)
    return detokenized_hypotheses(proc.stdout)


def split_with_shortlist(args, path: str, split: str, k: int, n: int):
    """-> the source and target dictionaries, the shortlist at `path` cut to (k, n), and `split`'s binarized sides
    ({lang: read_binarized})."""
    from fairseq.data import Dictionary

    from rfa_fairseq import shortlist

    data = os.path.join(args.prep, "data-bin")
    source_dictionary = Dictionary.load(os.path.join(data, f"dict.{args.source}.txt"))
    target_dictionary = Dictionary.load(os.path.join(data, f"dict.{args.target}.txt"))
    loaded = shortlist.Shortlist.load(path, source_dictionary, target_dictionary, k=k, n=n)
    sides = {lang: shortlist.read_binarized(os.path.join(data, f"{split}.{args.pair}.{lang}"))
             for lang in (args.source, args.target)}
    return source_dictionary, target_dictionary, loaded, sides


def union_sizes(args, path: str, split: str, k: int, n: int) -> dict:
    """The union's mean size per batch of `split`, at batch sizes 1, 32 and 128 (fairseq-generate's batches)."""
    import numpy as np
    from shortlist_sizes import fairseq_batches, padded

    source_dictionary, target_dictionary, loaded, sides = split_with_shortlist(args, path, split, k, n)
    sizes = {}
    for batch_size in UNION_BATCH_SIZES:
        batches = fairseq_batches(sides[args.source].lengths, sides[args.target].lengths, batch_size)
        counts = [loaded.union(padded(sides[args.source], rows, source_dictionary.pad())).numel() for rows in batches]
        sizes[f"union_mean_b{batch_size}"] = f"{float(np.mean(counts)):.1f}"
    sizes["vocab"] = len(target_dictionary)
    return sizes


def checkpoint_column(path: str) -> str:
    """The CSV's name of a checkpoint: its path from the checkout's outputs/ on (any checkout's), else its run
    directory and file name (no machine's paths in a committed CSV)."""
    parts = path.split(os.sep)
    if "outputs" in parts:
        return "/".join(parts[len(parts) - 1 - parts[::-1].index("outputs"):])
    return "/".join(parts[-2:])


def checkpoint_updates(path: str) -> int:
    """Training updates behind a checkpoint (a partially trained one shows in the CSV)."""
    from rfa_fairseq.checkpoints import safe_load

    history = safe_load(path, mmap=True).get("optimizer_history") or [{}]
    return int(history[-1].get("num_updates", -1))


def point(text: str) -> tuple:
    """--points' K:N -> (K, N)."""
    try:
        k, n = (int(part) for part in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a point is K:N (two integers), got {text!r}") from None
    return k, n


def inside_unions(args, path: str, split: str, k: int, n: int, batch_size: int, full: dict, hyps: dict) -> dict:
    """Why hypotheses change: the fraction of the full vocabulary's hypotheses whose tokens all lie in their batch's
    union (fairseq-generate's batches of `batch_size`; the detokenized hypothesis encoded again with PREP/spm.model,
    which gives fairseq's pieces but where the model chose a non-canonical segmentation), and how many of those the
    shortlist left identical (the others moved by renormalizing over the union)."""
    import sentencepiece
    import torch
    from shortlist_sizes import fairseq_batches, padded

    source_dictionary, target_dictionary, loaded, sides = split_with_shortlist(args, path, split, k, n)
    pieces = sentencepiece.SentencePieceProcessor(model_file=os.path.join(args.prep, "spm.model"))
    inside = kept = 0
    for rows in fairseq_batches(sides[args.source].lengths, sides[args.target].lengths, batch_size):
        union = torch.zeros(len(target_dictionary), dtype=torch.bool)
        union[loaded.union(padded(sides[args.source], rows, source_dictionary.pad()))] = True
        for row in rows.tolist():
            ids = [target_dictionary.index(piece) for piece in pieces.encode(full[row], out_type=str)]
            if bool(union[torch.tensor(ids, dtype=torch.long)].all()) if ids else True:
                inside += 1
                kept += full[row] == hyps[row]
    total = len(sides[args.source].lengths)
    return {"full_inside_union": f"{inside / total:.4f}",
            "identical_when_inside": f"{kept / inside:.4f}" if inside else ""}


def main(argv=None) -> int:
    import sacrebleu

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pair", choices=["en-de", "en-fr"], required=True)
    p.add_argument("--prep", required=True, help="data-prep/prepare-multi30k.sh's output for the pair")
    p.add_argument("--checkpoint", required=True, help="an rfa_transformer checkpoint of that pair")
    p.add_argument("--k", nargs="+", type=int, default=[10, 20, 50, 100], help="candidates per source token")
    p.add_argument("--n", nargs="+", type=int, default=[50, 100], help="frequent target tokens")
    p.add_argument("--points", nargs="+", type=point, default=None, metavar="K:N",
                   help="these (K, N) points instead of the --k x --n grid")
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 128],
                   help="fairseq-generate --batch-size (each batch has its own union): default 1 (the smallest "
                        "unions) and 128")
    p.add_argument("--splits", nargs="+", choices=SPLITS, default=list(SPLITS))
    p.add_argument("--shortlist", default=None,
                   help="the shortlist file, built there with the points' largest K and N unless up to date "
                        "(default: in the data-bin, above)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--timeout", type=float, default=3 * 3600, help="seconds one fairseq-generate may run")
    p.add_argument("--work-dir", default=os.path.join(REPO, "outputs", "shortlist_quality"),
                   help="where the hypotheses are kept (a run reads what an earlier one wrote)")
    p.add_argument("--csv", default=RESULTS)
    p.add_argument("--redo", action="store_true")
    args = p.parse_args(argv)
    args.source, args.target = args.pair.split("-")
    for needed in ("data-bin", *(f"{split}.raw.{args.target}" for split in args.splits)):
        if not os.path.exists(os.path.join(args.prep, needed)):
            p.error(f"--prep {args.prep} has no {needed} (data-prep/prepare-multi30k.sh --pair {args.pair} writes it)")
    if not os.path.isfile(args.checkpoint):
        p.error(f"--checkpoint {args.checkpoint} does not exist")
    args.points = sorted(set(args.points or [(k, n) for k in args.k for n in args.n]))
    if min(k for k, _ in args.points) < 1 or min(n for _, n in args.points) < 0 or min(args.batch_sizes) < 1:
        p.error("K (--k, --points) and --batch-sizes must be positive, N (--n, --points) at least 0")
    path = build_shortlist(args)
    checkpoint = os.path.normpath(os.path.abspath(args.checkpoint))
    updates = checkpoint_updates(checkpoint)
    checkpoint_name = checkpoint_column(checkpoint)
    log(f"{checkpoint}: {updates} training updates")
    work = os.path.join(args.work_dir, args.pair, os.path.basename(os.path.dirname(checkpoint)), f"u{updates}")
    os.makedirs(work, exist_ok=True)
    rows = read_rows(args.csv)
    grid = [(FULL, FULL)] + args.points
    for split in args.splits:
        refs = open(os.path.join(args.prep, f"{split}.raw.{args.target}"), encoding="utf-8").read().splitlines()
        for batch_size in args.batch_sizes:
            full = None
            for k, n in grid:
                key = (args.pair, split, checkpoint_name, str(updates), str(batch_size), str(k), str(n))
                if not args.redo and any(key_of(r) == key for r in rows):
                    continue
                full = full or translate(args, split, batch_size, {}, os.path.join(work, f"{split}.b{batch_size}.full"))
                overrides = {} if k == FULL else {"rfa_shortlist": path, "rfa_shortlist_k": k, "rfa_shortlist_n": n}
                hyps = full if k == FULL else translate(args, split, batch_size, overrides,
                                                        os.path.join(work, f"{split}.b{batch_size}.k{k}_n{n}"))
                score = {name: sacrebleu.corpus_bleu([h[i] for i in range(len(refs))], [refs]).score
                         for name, h in (("full", full), ("shortlist", hyps))}
                same = sum(full[i] == hyps[i] for i in range(len(refs))) / len(refs)
                row = {"pair": args.pair, "split": split, "checkpoint": checkpoint_name, "batch_size": batch_size,
                       "k": k, "n": n, "checkpoint_updates": updates, "sentences": len(refs), "bleu_full": f"{score['full']:.2f}",
                       "bleu_shortlist": f"{score['shortlist']:.2f}",
                       "shortlist_minus_full": f"{score['shortlist'] - score['full']:.2f}", "identical": f"{same:.4f}",
                       **({} if k == FULL else union_sizes(args, path, split, k, n)),
                       **({} if k == FULL else inside_unions(args, path, split, k, n, batch_size, full, hyps)),
                       "shortlist": os.path.relpath(path, REPO) if k != FULL else "",
                       "threads": args.threads,
                       "load_1min": f"{os.getloadavg()[0]:.1f}",
                       "measured_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ")}
                rows = [r for r in rows if key_of(r) != key] + [row]
                write_csv(args.csv, rows)
                log(f"{args.pair} {split} batch {batch_size} K={k} N={n}: BLEU {row['bleu_shortlist']} vs "
                    f"{row['bleu_full']} ({row['shortlist_minus_full']}), identical {same:.1%}"
                    + (f", union {row['union_mean_b1']} / {row['union_mean_b32']} / {row['union_mean_b128']} "
                       f"of {row['vocab']} at batch 1 / 32 / 128; full hypotheses inside their union "
                       f"{row['full_inside_union']}, identical among them {row['identical_when_inside']}"
                       if k != FULL else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
