#!/usr/bin/env python3
"""How large a batch's shortlist union is, and how much of the reference it covers, for a grid of K and N.

For each data-prep output (--prep: its data-bin), the shortlist is built once with the grid's largest K and N
(rfa-build-shortlist --output PREP/data-bin/shortlist.SRC-TGT.kK_nN.iI.npz; its time goes to --build-csv) and read
at every smaller (k, n), since its candidates and frequent tokens are stored best first. The test and valid splits
are cut into batches the way fairseq-generate --batch-size B cuts them (sentences ordered by source length, then
target length; B at a time), and for each batch Shortlist.union() is called on its padded (B, S) source tokens, as
the decoder will call it. Per (pair, split, iterations, batch size, k, n), one CSV row:

  union_mean / union_p50 / union_max   the union's size per batch, in target tokens
  union_frac                           union_mean over the target dictionary's size
  token_coverage                       fraction of the reference target tokens (special tokens left out: they are
                                       always in) inside their batch's union: a cheap proxy of quality, since a
                                       reference token outside the union cannot be produced
  sentence_coverage                    fraction of sentences whose whole reference lies inside their batch's union
  hyp_token_coverage, hyp_sentence_coverage   the same over the hypotheses of a full-vocabulary decoding
                                       (--hypotheses: fairseq-generate's output): a hypothesis wholly inside its batch's
                                       union is one the shortlist leaves reachable, the closer proxy of identical
                                       hypotheses
  union_us_p50                         median time of one Shortlist.union() call, microseconds, 1 thread (CPU); the
                                       row's load_1min is the machine's load average when measured

Rows already in the CSV are kept and skipped (--redo measures them again).

--aligners eflomal compares the table with one from eflomal's alignments (pip install eflomal; its forward links
counted: p(t | s) = links(s, t) / links(s), the same top-K and frequent tokens, the same file), the aligner column
telling them apart: at equal union sizes it covered no more of the references than IBM Model 1's table
(docs/recipes.md), which is why rfa-build-shortlist estimates IBM Model 1 itself.

    python benchmarks/shortlist_sizes.py --prep M30K_EN_DE M30K_EN_FR \
        --csv benchmarks/results/shortlist_sizes_multi30k.csv --build-csv benchmarks/results/shortlist_build_multi30k.csv
"""
import argparse
import csv
import os
import platform
import statistics
import subprocess
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, REPO)

KEY = ("pair", "aligner", "split", "iterations", "batch_size", "k", "n")


def read_rows(path):
    if not path or not os.path.isfile(path):
        return []
    with open(path, newline="") as handle:
        rows = list(csv.DictReader(handle))
    for row in rows:  # rows written before the aligner column were IBM Model 1's
        row["aligner"] = row.get("aligner") or "ibm1"
    return rows


def write_rows(path, rows):
    tmp = path + ".tmp"
    fields = list(dict.fromkeys(key for row in rows for key in row))
    with open(tmp, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields, restval="")
        writer.writeheader()
        writer.writerows(rows)
    os.replace(tmp, path)


def key_of(row):
    return tuple(str(row[name]) for name in KEY)


def machine():
    cpu = platform.processor() or "cpu"
    try:
        with open("/proc/cpuinfo") as handle:
            cpu = next(line.split(":", 1)[1].strip() for line in handle if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {os.cpu_count()} cores"


def fairseq_batches(source_lengths, target_lengths, batch_size):
    """fairseq-generate's batches with --batch-size B and no --max-tokens: LanguagePairDataset.ordered_indices
    (a stable sort by target length, then by source length), cut B sentences at a time."""
    order = np.arange(len(source_lengths))
    order = order[np.argsort(target_lengths[order], kind="mergesort")]
    order = order[np.argsort(source_lengths[order], kind="mergesort")]
    return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]


def padded(sentences, rows, pad):
    """The sentences `rows` as fairseq's (B, S) source batch: left-padded with `pad`."""
    import torch

    lengths = sentences.lengths[rows]
    width = int(lengths.max())
    batch = torch.full((len(rows), width), pad, dtype=torch.long)
    for i, (row, length) in enumerate(zip(rows, lengths)):
        start = sentences.offsets[row]
        batch[i, width - length:] = torch.from_numpy(sentences.tokens[start:start + length])
    return batch


def build(args, data, pair, aligner, k, n, iterations, build_rows):
    """The shortlist file for this grid (built once; its build time recorded in --build-csv)."""
    source, target = pair.split("-")
    name = (f"shortlist.{pair}.k{k}_n{n}.i{iterations}.npz" if aligner == "ibm1"
            else f"shortlist.{pair}.{aligner}.k{k}_n{n}.npz")
    path = os.path.join(data, name)
    start = time.perf_counter()
    if aligner == "eflomal":
        if os.path.isfile(path):
            return path, build_rows
        build_with_eflomal(data, source, target, k, n, path)
        command, fresh = f"benchmarks/shortlist_sizes.py --aligners eflomal (eflomal defaults, K {k}, N {n})", True
    else:
        cli = [os.path.join(os.path.dirname(sys.executable), "rfa-build-shortlist"), data, "-s", source, "-t", target,
               "--k", str(k), "--n", str(n), "--iterations", str(iterations), "--output", path, "--quiet"]
        proc = subprocess.run(cli, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
        if proc.returncode != 0:
            sys.exit(f"shortlist_sizes: {' '.join(cli)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        sys.stderr.write(proc.stderr)
        command = f"rfa-build-shortlist DATA --k {k} --n {n} --iterations {iterations}"
        fresh = "up to date" not in proc.stderr
    seconds = time.perf_counter() - start
    if fresh and args.build_csv:
        same = (pair, aligner, str(k), str(n), str(iterations))
        build_rows = [r for r in build_rows if (r["pair"], r["aligner"], r["k"], r["n"], r["iterations"]) != same]
        build_rows.append({"pair": pair, "aligner": aligner, "k": k, "n": n, "iterations": iterations,
                           "build_s": round(seconds, 1), "command": command, "load_1min": round(os.getloadavg()[0], 1),
                           "machine": machine()})
        write_rows(args.build_csv, build_rows)
    return path, build_rows


def build_with_eflomal(data, source_lang, target_lang, k, n, path):
    """The same file from eflomal's forward alignments of the training split (token ids as its words)."""
    import io

    import eflomal
    from fairseq.data import Dictionary

    from rfa_fairseq import shortlist

    pair = f"{source_lang}-{target_lang}"
    source_dictionary = Dictionary.load(os.path.join(data, f"dict.{source_lang}.txt"))
    target_dictionary = Dictionary.load(os.path.join(data, f"dict.{target_lang}.txt"))
    sides = [shortlist.drop_tokens(shortlist.read_binarized(os.path.join(data, f"train.{pair}.{lang}")),
                                   shortlist.special_token_ids(dictionary))
             for lang, dictionary in ((source_lang, source_dictionary), (target_lang, target_dictionary))]
    texts = ["".join(" ".join(map(str, side.tokens[a:b])) + "\n" for a, b in zip(side.offsets[:-1], side.offsets[1:]))
             for side in sides]
    links = path + ".links"
    eflomal.Aligner().align(io.StringIO(texts[0]), io.StringIO(texts[1]), links_filename_fwd=links)
    source, target = sides
    pairs = []
    with open(links) as handle:
        for sentence, line in enumerate(handle):
            for link in line.split():
                i, j = map(int, link.split("-"))
                pairs.append((source.tokens[source.offsets[sentence] + i], target.tokens[target.offsets[sentence] + j]))
    os.unlink(links)
    width = len(target_dictionary)
    keys, counts = np.unique(np.array([s * width + t for s, t in pairs], dtype=np.int64), return_counts=True)
    pair_source, pair_target = np.divmod(keys, width)
    per_source = np.bincount(pair_source, weights=counts, minlength=len(source_dictionary))
    lexical = shortlist.LexicalTable(source=pair_source, target=pair_target,
                                     probability=counts / per_source[pair_source], null_id=len(source_dictionary))
    candidates, probabilities = shortlist.top_candidates(lexical, len(source_dictionary), k)
    header = {"format": shortlist.FORMAT_NAME, "version": shortlist.FORMAT_VERSION,
              "source_dictionary": shortlist._dictionary_record(source_dictionary),
              "target_dictionary": shortlist._dictionary_record(target_dictionary), "k": k, "n": n,
              "alignment": {"model": "eflomal", "links": "forward"}, "data": {}}
    shortlist.save(path, shortlist.ShortlistTable(header=header, candidates=candidates, probabilities=probabilities,
                                                  frequent=shortlist.most_frequent(target.tokens, width, n)))


def read_hypotheses(path, target_dictionary, count, shortlist):
    """fairseq-generate's output (without --post-process): the token ids of each sentence's first H- line, as a
    Sentences of `count` sentences in sentence-id order (eos and the other special tokens left out)."""
    hypotheses = {}
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.startswith("H-"):
                continue
            head, _, rest = line.rstrip("\n").partition("\t")
            sentence = int(head[2:])
            if sentence in hypotheses:
                continue
            pieces = rest.partition("\t")[2].split()
            ids = [target_dictionary.index(piece) for piece in pieces]
            unknown = [piece for piece, i in zip(pieces, ids) if i == target_dictionary.unk() and piece != "<unk>"]
            if unknown:
                sys.exit(f"shortlist_sizes: {path}:{number}: {unknown[0]!r} is no token of the target dictionary "
                         "(give fairseq-generate's output without --post-process)")
            hypotheses[sentence] = ids
    missing = sorted(set(range(count)) - set(hypotheses))
    if missing:
        sys.exit(f"shortlist_sizes: {path} has no hypothesis for {len(missing)} of the {count} sentences "
                 f"(sentence {missing[0]}, ...)")
    specials = set(shortlist.special_token_ids(target_dictionary))
    return shortlist_sentences([[i for i in hypotheses[s] if i not in specials] for s in range(count)], shortlist)


def shortlist_sentences(token_lists, shortlist):
    offsets = np.zeros(len(token_lists) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(tokens) for tokens in token_lists])
    tokens = np.array([t for tokens in token_lists for t in tokens], dtype=np.int64)
    return shortlist.Sentences(tokens=tokens, offsets=offsets)


def coverage(inside, sentences, rows):
    """(tokens inside, tokens, sentences wholly inside) of the sentences `rows`."""
    covered = total = whole = 0
    for row in rows:
        tokens = sentences.tokens[sentences.offsets[row]:sentences.offsets[row + 1]]
        hit = int(inside[tokens].sum())
        covered, total, whole = covered + hit, total + len(tokens), whole + (hit == len(tokens))
    return covered, total, whole


def measure(args):
    import torch
    from fairseq.data import Dictionary

    from rfa_fairseq import shortlist
    from rfa_fairseq.cli.check_data import binarized_pairs

    torch.set_num_threads(1)
    rows = [] if args.redo else read_rows(args.csv)
    build_rows = read_rows(args.build_csv)
    hypothesis_files = dict(item.split("=", 1) for item in args.hypotheses)

    def done(key, with_hypotheses):
        row = next((r for r in rows if key_of(r) == key), None)
        return row is not None and (not with_hypotheses or bool(row.get("hyp_sentence_coverage")))

    for prep in args.prep:
        data = os.path.join(prep, "data-bin")
        pairs = binarized_pairs(data)
        if len(pairs) != 1:
            sys.exit(f"shortlist_sizes: {data} holds {len(pairs)} language pairs ({pairs}); expected one")
        source_lang, target_lang = pairs[0]
        pair = f"{source_lang}-{target_lang}"
        source_dictionary = Dictionary.load(os.path.join(data, f"dict.{source_lang}.txt"))
        target_dictionary = Dictionary.load(os.path.join(data, f"dict.{target_lang}.txt"))
        specials = np.array(shortlist.special_token_ids(target_dictionary))
        for aligner, iterations in [(a, i) for a in args.aligners for i in (args.iterations if a == "ibm1" else [0])]:
            def key(split, b, k, n):
                return tuple(map(str, (pair, aligner, split, iterations, b, k, n)))

            todo = [(split, b, k, n) for split in args.splits for b in args.batch_sizes for k in args.k for n in args.n
                    if not done(key(split, b, k, n), f"{pair}:{split}" in hypothesis_files)]
            if not todo:
                continue
            path, build_rows = build(args, data, pair, aligner, max(args.k), max(args.n), iterations, build_rows)
            for split in args.splits:
                prefix = os.path.join(data, f"{split}.{pair}.")
                source = shortlist.read_binarized(prefix + source_lang)
                target = shortlist.read_binarized(prefix + target_lang)
                reference = shortlist.drop_tokens(target, specials)
                hypotheses_path = hypothesis_files.get(f"{pair}:{split}")
                hypotheses = (read_hypotheses(hypotheses_path, target_dictionary, len(source), shortlist)
                              if hypotheses_path else None)
                for batch_size in args.batch_sizes:
                    batches = fairseq_batches(source.lengths, target.lengths, batch_size)
                    tensors = [padded(source, rows_, source_dictionary.pad()) for rows_ in batches]
                    for k in args.k:
                        for n in args.n:
                            if done(key(split, batch_size, k, n), hypotheses is not None):
                                continue
                            loaded = shortlist.Shortlist.load(path, source_dictionary, target_dictionary, k=k, n=n)
                            sizes, seconds = [], []
                            counts, hypothesis_counts = np.zeros(3, dtype=np.int64), np.zeros(3, dtype=np.int64)
                            for rows_, tensor in zip(batches, tensors):
                                start = time.perf_counter()
                                union = loaded.union(tensor)
                                seconds.append(time.perf_counter() - start)
                                sizes.append(len(union))
                                inside = np.zeros(len(target_dictionary), dtype=bool)
                                inside[union.numpy()] = True
                                counts += coverage(inside, reference, rows_)
                                if hypotheses is not None:
                                    hypothesis_counts += coverage(inside, hypotheses, rows_)
                            row = {"pair": pair, "aligner": aligner, "split": split, "iterations": iterations,
                                   "batch_size": batch_size, "k": k, "n": n, "sentences": len(source),
                                   "batches": len(batches), "vocab": len(target_dictionary),
                                   "union_mean": round(float(np.mean(sizes)), 1),
                                   "union_p50": int(np.median(sizes)), "union_max": int(np.max(sizes)),
                                   "union_frac": round(float(np.mean(sizes)) / len(target_dictionary), 4),
                                   "token_coverage": round(counts[0] / counts[1], 5),
                                   "sentence_coverage": round(counts[2] / len(source), 4),
                                   "union_us_p50": round(statistics.median(seconds) * 1e6, 1),
                                   "load_1min": round(os.getloadavg()[0], 1),
                                   "torch": torch.__version__, "machine": machine()}
                            if hypotheses is not None:
                                row.update({"hyp_token_coverage": round(hypothesis_counts[0] / hypothesis_counts[1], 5),
                                            "hyp_sentence_coverage": round(hypothesis_counts[2] / len(source), 4),
                                            "hypotheses": os.path.basename(hypotheses_path)})
                            rows = [r for r in rows if key_of(r) != key_of(row)] + [row]
                            write_rows(args.csv, rows)
                            print(", ".join(f"{name}={row.get(name)}" for name in (
                                *KEY, "union_mean", "union_max", "token_coverage", "sentence_coverage",
                                "hyp_sentence_coverage", "union_us_p50")), flush=True)
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prep", nargs="+", required=True, help="data-prep outputs (each with a data-bin of one pair)")
    parser.add_argument("--csv", required=True, help="the results (rows already there are skipped)")
    parser.add_argument("--build-csv", default=None, help="the shortlists' build times")
    parser.add_argument("--splits", nargs="+", default=["valid", "test"])
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 32, 128])
    parser.add_argument("--k", nargs="+", type=int, default=[10, 20, 50, 100])
    parser.add_argument("--n", nargs="+", type=int, default=[50, 100, 200])
    parser.add_argument("--iterations", nargs="+", type=int, default=[5], help="EM iterations of IBM Model 1")
    parser.add_argument("--aligners", nargs="+", choices=["ibm1", "eflomal"], default=["ibm1"],
                        help="whose lexical table: rfa-build-shortlist's IBM Model 1, or eflomal's alignments")
    parser.add_argument("--hypotheses", nargs="+", default=[], metavar="PAIR:SPLIT=PATH",
                        help="fairseq-generate's output over that split with the full vocabulary (no --post-process): "
                             "also the fraction of its hypotheses inside their batch's union (hyp_* columns)")
    parser.add_argument("--redo", action="store_true", help="measure every row again")
    args = parser.parse_args(argv)
    for prep in args.prep:
        if not os.path.isdir(os.path.join(prep, "data-bin")):
            parser.error(f"--prep {prep}: no data-bin in it (data-prep/prepare-multi30k.sh OUT writes OUT/data-bin)")
    for item in args.hypotheses:
        if "=" not in item or ":" not in item.split("=", 1)[0] or not os.path.isfile(item.split("=", 1)[1]):
            parser.error(f"--hypotheses {item}: expected PAIR:SPLIT=PATH with an existing PATH (en-de:test=gen.out)")
    if min(args.batch_sizes + args.k + args.iterations) < 1 or min(args.n) < 0:
        parser.error("batch sizes, K and iterations must be at least 1, N at least 0")
    measure(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
