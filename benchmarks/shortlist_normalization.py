#!/usr/bin/env python3
"""Why a vocabulary shortlist changes hypotheses: its union's coverage, or normalizing over the union (Marian's rule).

For the first --sentences sentences of a split, one at a time (batch 1, each sentence its own union), fairseq's
SequenceGenerator (beam 4, length penalty 1, max length source + 50) decodes the same full-vocabulary logits three
ways: the full log-softmax (the reference); the shortlist as --rfa-shortlist decodes (the logits outside the union
-inf, then the log-softmax: normalized over the union); the full log-softmax with the tokens outside the union -inf
(the full vocabulary's normalizer, no renormalization: what only the full projection can give). The last one
differs from the reference only where the search needed a token outside the union; the renormalized one differs
also where renormalizing reordered the beams. One CSV row per (pair, split, checkpoint and its updates, k, n).

    python benchmarks/shortlist_normalization.py --pair en-de --prep outputs/multi30k \
        --checkpoint outputs/quality/hedgehog_gate_softmax_cross_d32_u1000_s1/checkpoint_best.pt --points 100:100

The shortlist file is shortlist_quality.py's (built with the points' largest K and N unless up to date, or --shortlist).
"""
import argparse
import datetime
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmark_common import REPO, write_csv  # noqa: E402
from shortlist_quality import build_shortlist, checkpoint_column, checkpoint_updates, point, read_rows  # noqa: E402

RESULTS = os.path.join(REPO, "benchmarks", "results", "shortlist_normalization_multi30k.csv")
KEY = ("pair", "split", "checkpoint", "checkpoint_updates", "k", "n", "sentences")
SCORINGS = ("full", "renormalized", "full_normalizer")


def key_of(row) -> tuple:
    return tuple(str(row[name]) for name in KEY)


def decode(args, path, split, points):
    """{(k, n): {scoring: identical count}} and the sentence count, for one split, the shortlist file at path."""
    import torch

    import rfa_fairseq  # noqa: F401  (registers the model)
    from fairseq import checkpoint_utils
    from fairseq.sequence_generator import SequenceGenerator
    from rfa_fairseq.shortlist import Shortlist

    torch.set_num_threads(1)
    data = os.path.join(args.prep, "data-bin")
    models, _, task = checkpoint_utils.load_model_ensemble_and_task([args.checkpoint], arg_overrides={"data": data})
    model = models[0].eval()
    task.load_dataset(split)
    dataset = task.dataset(split)
    vocab = len(task.target_dictionary)
    scoring = {"name": "full", "inside": None}  # what the patched normalization does for the next search

    def normalized(net_output, log_probs, sample=None):
        logits = net_output[0].float()
        if scoring["name"] == "renormalized":
            return torch.log_softmax(logits.masked_fill(~scoring["inside"], float("-inf")), dim=-1)
        lprobs = torch.log_softmax(logits, dim=-1)
        return lprobs if scoring["name"] == "full" else lprobs.masked_fill(~scoring["inside"], float("-inf"))

    model.get_normalized_probs = normalized
    generator = SequenceGenerator([model], task.target_dictionary, beam_size=4, max_len_a=1, max_len_b=50,
                                  len_penalty=1.0)  # shortlist_quality.py's fairseq-generate options
    shortlists = {(k, n): Shortlist.load(path, task.source_dictionary, task.target_dictionary, k, n) for k, n in points}
    count = min(args.sentences, len(dataset))
    same = {p: dict.fromkeys(SCORINGS[1:], 0) for p in points}
    with torch.no_grad():
        for i in range(count):
            source = dataset[i]["source"].unsqueeze(0)
            sample = {"net_input": {"src_tokens": source, "src_lengths": torch.tensor([source.numel()])}}
            scoring.update(name="full", inside=None)
            reference = generator.generate([model], sample)[0][0]["tokens"].tolist()
            for p, shortlist in shortlists.items():
                inside = torch.zeros(vocab, dtype=torch.bool)
                inside[shortlist.union(source).reshape(-1)] = True
                for name in SCORINGS[1:]:
                    scoring.update(name=name, inside=inside)
                    same[p][name] += generator.generate([model], sample)[0][0]["tokens"].tolist() == reference
    return same, count


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pair", choices=["en-de", "en-fr"], required=True)
    p.add_argument("--prep", required=True, help="data-prep/prepare-multi30k.sh's output for the pair")
    p.add_argument("--checkpoint", required=True, help="an rfa_transformer checkpoint of that pair")
    p.add_argument("--points", nargs="+", type=point, default=[(100, 100)], metavar="K:N")
    p.add_argument("--splits", nargs="+", choices=["test", "valid"], default=["test"])
    p.add_argument("--sentences", type=int, default=300, help="the split's first sentences")
    p.add_argument("--shortlist", default=None,
                   help="the shortlist file, built there with the points' largest K and N unless up to date "
                        "(default: in the data-bin, as shortlist_quality.py names it)")
    p.add_argument("--csv", default=RESULTS)
    args = p.parse_args(argv)
    args.source, args.target = args.pair.split("-")
    if not os.path.isfile(args.checkpoint):
        p.error(f"--checkpoint {args.checkpoint} does not exist")
    args.checkpoint = os.path.normpath(os.path.abspath(args.checkpoint))
    updates = checkpoint_updates(args.checkpoint)
    path = build_shortlist(args)
    rows = read_rows(args.csv)
    done = {key_of(r) for r in rows}
    for split in args.splits:
        identity = {"pair": args.pair, "split": split, "checkpoint": checkpoint_column(args.checkpoint),
                    "checkpoint_updates": updates}
        todo = [(k, n) for k, n in args.points
                if key_of(dict(identity, k=k, n=n, sentences=args.sentences)) not in done]
        if not todo:
            continue
        same, count = decode(args, path, split, todo)
        for (k, n), counts in same.items():
            row = {**identity, "k": k, "n": n, "sentences": count, "batch_size": 1,
                   "identical_renormalized": f"{counts['renormalized'] / count:.4f}",
                   "identical_full_normalizer": f"{counts['full_normalizer'] / count:.4f}", "threads": 1,
                   "measured_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ")}
            rows = [r for r in rows if key_of(r) != key_of(row)] + [row]
            write_csv(args.csv, rows)
            print(f"shortlist_normalization: {args.pair} {split} K={k} N={n}, first {count} sentences at batch 1: "
                  f"identical to the full vocabulary's {row['identical_renormalized']} normalized over the union, "
                  f"{row['identical_full_normalizer']} with the full vocabulary's normalizer", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
