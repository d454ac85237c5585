"""Build a vocabulary shortlist from a binarized data-bin's training split.

Console script `rfa-build-shortlist` (also `python -m rfa_fairseq.cli.build_shortlist`):

  rfa-build-shortlist data-bin                          # -> data-bin/shortlist.SRC-TGT.npz
  rfa-build-shortlist data-bin -s en -t de --k 100 --n 100 --ct2-vmap ct2_vmap.txt

Reads SPLIT.SRC-TGT.{SRC,TGT}.{idx,bin} (fairseq-preprocess's mmap format) and dict.{SRC,TGT}.txt, estimates IBM
Model 1's p(target token | source token) over the subword ids with a few EM iterations, and writes per source token
its K most probable target tokens plus the N most frequent target tokens (the file format:
rfa_fairseq/shortlist.py, docs/model.md). The decoder reads any first k <= K candidates and n <= N frequent tokens
from it, so one file built with the largest K and N serves every smaller setting.

--ct2-vmap PATH also writes the same table as a CTranslate2 vocabulary map (pass it to ct2-fairseq-converter
--vocab_mapping, translate with use_vmap=True).

Idempotent: the file records what it was built from (the dictionaries' and the split's hashes, K, N, the iterations);
when the output already holds exactly that, nothing is rebuilt (--force rebuilds). Every file is written under a
temporary name and renamed. Exit status: 0 on success, 1 when the data or a dictionary is refused, 2 on usage errors.
"""
import argparse
import os
import sys
import time

PROG = "rfa-build-shortlist"
# the defaults are written here for --help without importing the package; rfa_fairseq/shortlist.py holds the same
# values (a test checks that they agree)
DEFAULT_K = 100
DEFAULT_N = 100
DEFAULT_ITERATIONS = 5


def build_parser():
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("data", metavar="DATA", help="a fairseq-preprocess --destdir (binarized data)")
    parser.add_argument("-s", "--source-lang", default=None, help="default: read from the file names")
    parser.add_argument("-t", "--target-lang", default=None, help="default: read from the file names")
    parser.add_argument("--split", default="train", help="the split to align (default: train)")
    parser.add_argument("--k", type=int, default=DEFAULT_K, metavar="K",
                        help=f"target candidates kept per source token, most probable first (default: {DEFAULT_K})")
    parser.add_argument("--n", type=int, default=DEFAULT_N, metavar="N",
                        help=f"most frequent target tokens, always candidates (default: {DEFAULT_N})")
    parser.add_argument("--iterations", type=int, default=DEFAULT_ITERATIONS,
                        help=f"EM iterations of IBM Model 1 (default: {DEFAULT_ITERATIONS})")
    parser.add_argument("--output", "-o", default=None,
                        help="the shortlist file (default: DATA/shortlist.SRC-TGT.npz)")
    parser.add_argument("--ct2-vmap", default=None, metavar="PATH",
                        help="also write the table as a CTranslate2 vocabulary map (vmap) to PATH")
    parser.add_argument("--force", action="store_true", help="rebuild even when the output is up to date")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser


def default_output(data, source_lang, target_lang):
    return os.path.join(data, f"shortlist.{source_lang}-{target_lang}.npz")


def load_dictionary(path, shortlist):
    """dict.LANG.txt as fairseq reads it."""
    from fairseq.data import Dictionary

    if not os.path.isfile(path):
        raise shortlist.ShortlistError(f"{path}: dictionary not found (fairseq-preprocess writes dict.<lang>.txt "
                                       "into --destdir)")
    try:
        return Dictionary.load(path)
    except Exception as error:  # fairseq raises ValueError / RuntimeError on a malformed line
        raise shortlist.ShortlistError(f"{path}: not a fairseq dictionary ({error})") from None


def check_ids(sentences, dictionary, data_path, dictionary_path, shortlist):
    """Refuse data binarized with another dictionary: an id the dictionary does not have."""
    if sentences.tokens.size:
        top, bottom = int(sentences.tokens.max()), int(sentences.tokens.min())
        if top >= len(dictionary) or bottom < 0:
            bad = top if top >= len(dictionary) else bottom
            raise shortlist.ShortlistError(
                f"{dictionary_path} does not match {data_path}: the data holds token id {bad}, "
                f"the dictionary has ids 0..{len(dictionary) - 1} (binarized with another dictionary? binarize again, "
                "or give the data-bin the dictionary it was binarized with)")


def run(args):
    from rfa_fairseq import shortlist
    from rfa_fairseq.cli.check_data import UsageError, _split_prefix, binarized_pairs, pick_pair

    if not os.path.isdir(args.data):
        raise shortlist.ShortlistError(f"{args.data}: data directory not found")
    source_lang, target_lang = args.source_lang, args.target_lang
    if source_lang is None or target_lang is None:
        try:
            source_lang, target_lang = pick_pair(binarized_pairs(args.data), source_lang, target_lang, args.data)
        except UsageError as error:
            raise shortlist.ShortlistError(str(error)) from None
    output = args.output or default_output(args.data, source_lang, target_lang)
    # DATA/SPLIT.SRC-TGT. or DATA/SPLIT.TGT-SRC. (fairseq-preprocess names a pair's files either way); when neither
    # exists, the first: reading it names the missing file
    prefix = (_split_prefix(args.data, args.split, source_lang, target_lang)
              or os.path.join(args.data, f"{args.split}.{source_lang}-{target_lang}."))
    dictionary_paths = {lang: os.path.join(args.data, f"dict.{lang}.txt") for lang in (source_lang, target_lang)}
    source_dictionary = load_dictionary(dictionary_paths[source_lang], shortlist)
    target_dictionary = load_dictionary(dictionary_paths[target_lang], shortlist)

    data = {
        "split": args.split, "source_lang": source_lang, "target_lang": target_lang,
        "files": {os.path.basename(prefix + lang + ext): shortlist.file_sha256(prefix + lang + ext)
                  for lang in (source_lang, target_lang) for ext in (".idx", ".bin")
                  if os.path.isfile(prefix + lang + ext)},
    }
    wanted = {"k": args.k, "n": args.n, "iterations": args.iterations, "data": data,
              "source_dictionary": shortlist.dictionary_fingerprint(source_dictionary),
              "target_dictionary": shortlist.dictionary_fingerprint(target_dictionary)}
    table = None
    if os.path.isfile(output) and not args.force:
        try:
            existing = shortlist.read(output)
        except shortlist.ShortlistError:
            existing = None  # another or a damaged file: rebuilt below
        if existing is not None and wanted == {
                "k": existing.header["k"], "n": existing.header["n"],
                "iterations": existing.header["alignment"].get("iterations"), "data": existing.header["data"],
                "source_dictionary": existing.header["source_dictionary"]["sha256"],
                "target_dictionary": existing.header["target_dictionary"]["sha256"]}:
            table = existing
            print(f"{PROG}: {output} is up to date (built from the same data, dictionaries, K, N and iterations; "
                  "--force rebuilds it)", file=sys.stderr)
    if table is None:
        sides = {}
        for lang, dictionary in ((source_lang, source_dictionary), (target_lang, target_dictionary)):
            sides[lang] = shortlist.read_binarized(prefix + lang)
            check_ids(sides[lang], dictionary, prefix + lang + ".bin", dictionary_paths[lang], shortlist)
        if len(sides[source_lang]) != len(sides[target_lang]):
            raise shortlist.ShortlistError(
                f"{prefix + target_lang}.idx has {len(sides[target_lang])} sentences, but {prefix + source_lang}.idx has "
                f"{len(sides[source_lang])}: the two sides do not belong together (rfa-check-data {args.data})")
        start = time.perf_counter()
        table = shortlist.build_table(sides[source_lang], sides[target_lang], source_dictionary, target_dictionary,
                                      k=args.k, n=args.n, iterations=args.iterations, progress_bar=not args.quiet,
                                      data=data)
        shortlist.save(output, table)
        print(f"{PROG}: wrote {output} ({len(sides[source_lang])} sentence pairs, K={args.k}, N={args.n}, "
              f"{args.iterations} EM iterations, {time.perf_counter() - start:.1f} s)", file=sys.stderr)
    if args.ct2_vmap:
        shortlist.write_ct2_vmap(args.ct2_vmap, table, source_dictionary, target_dictionary)
        print(f"{PROG}: wrote {args.ct2_vmap} (CTranslate2 vocabulary map, K={table.header['k']}, "
              f"N={table.header['n']})", file=sys.stderr)


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.k < 1:
        parser.error(f"--k must be at least 1, got {args.k}")
    if args.n < 0:
        parser.error(f"--n must be at least 0, got {args.n}")
    if args.iterations < 1:
        parser.error(f"--iterations must be at least 1, got {args.iterations}")
    from rfa_fairseq.cli import run_console_script
    from rfa_fairseq.shortlist import ShortlistError

    return run_console_script(PROG, parser, run, (ShortlistError,), argv)


if __name__ == "__main__":
    sys.exit(main())
