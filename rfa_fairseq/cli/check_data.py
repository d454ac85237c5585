"""Check a parallel corpus before fairseq sees it; every problem is reported as FILE:LINE: message.

Console script `rfa-check-data` (also `python -m rfa_fairseq.cli.check_data`):

  rfa-check-data data-bin                    # a fairseq-preprocess --destdir: binarized, its one pair
  rfa-check-data data/train data/valid       # text: data/train.de + data/train.en, ...
  rfa-check-data data                        # text: every PREFIX.de + PREFIX.en in the directory
  rfa-check-data bin data-bin -s de -t en --splits train valid test   # the kind and the pair named

The kind of data (raw text or binarized) and the language pair are inferred where that is unambiguous:
a directory holding dict.<lang>.txt is binarized data, whose pair is read from its SPLIT.SRC-TGT.LANG.idx
files; anything else is text, whose two languages are the suffixes found beside each prefix. A first
word `raw` or `bin`, and -s/-t, name them instead (needed when a directory holds several pairs).

raw (the text given to fairseq-preprocess): both files exist and are UTF-8; same number of lines;
no empty lines; no carriage return inside a line (fairseq reads files with universal newlines, so
a stray \\r splits the line and shifts every later line against the other side); no line longer
than --max-positions tokens including the end-of-sentence token.

bin (a fairseq-preprocess --destdir): dict.<lang>.txt present and well-formed (`<token> <count>
[#fairseq:overwrite]`, no duplicates); for each split, the .idx/.bin pair of both languages, each .bin
of the size its .idx describes (a truncated copy);
the same number of sentences on both sides; no empty or too long sentence (reported as the
sentence's line in the text it was binarized from); no token id outside the dictionary.

Why: fairseq-preprocess binarizes each side separately and never compares them; fairseq-train
silently drops too-long training pairs, fails on the first too-long validation pair, trains on
empty lines, and reports misaligned sides only as "Source and target must contain the same
number of examples" with no file name. This tool only reads; it never writes anything.
Exit status: 0 when clean, 1 when it found problems, 2 on usage errors.
"""
import argparse
import os
import sys
import re
from collections import defaultdict

if __package__:
    from ..textio import describe_utf8_error
else:  # loaded as a file (rfa_fairseq_cli: --help and text checks without importing fairseq)
    import importlib.util

    _spec = importlib.util.spec_from_file_location(
        "rfa_fairseq_textio", os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "textio.py"))
    _textio = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_textio)
    describe_utf8_error = _textio.describe_utf8_error

# fairseq's default --max-source-positions / --max-target-positions
DEFAULT_MAX_POSITIONS = 1024
DEFAULT_MAX_ERRORS = 10


class Report:
    """Collects problems, printing at most max_errors of each kind per file."""

    def __init__(self, max_errors=DEFAULT_MAX_ERRORS):
        self.max_errors = max_errors
        self.counts = defaultdict(int)
        self.total = 0
        self.first_path = None

    def problem(self, path, line, kind, message):
        self.total += 1
        self.first_path = self.first_path or path
        key = (path, kind)
        self.counts[key] += 1
        if self.counts[key] <= self.max_errors:
            where = f"{path}:{line}" if line is not None else path
            print(f"{where}: {message}", file=sys.stderr)

    def finish(self):
        for (path, kind), count in sorted(self.counts.items()):
            if count > self.max_errors:
                print(f"{path}: ... and {count - self.max_errors} more: {kind}", file=sys.stderr)
        return self.total


# ---------------------------------------------------------------- raw text


def read_lines(path, report):
    """Lines as fairseq-preprocess will see them (split at \\n; \\r\\n ends a line too).
    Returns a list of str (None for undecodable lines), or None when the file is missing."""
    if not os.path.isfile(path):
        report.problem(path, None, "missing", "file not found")
        return None
    lines = []
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, start=1):
            raw = raw[:-1] if raw.endswith(b"\n") else raw
            raw = raw[:-1] if raw.endswith(b"\r") else raw
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                report.problem(path, number, "invalid UTF-8", describe_utf8_error(raw, exc))
                lines.append(None)
                continue
            if "\r" in text:
                report.problem(path, number, "carriage return",
                               "carriage return (\\r) inside the line: fairseq-preprocess reads it as a line break, "
                               "which shifts every later line against the other language")
            lines.append(text)
    return lines


def check_raw_pair(prefix, source_lang, target_lang, max_positions, report):
    """Check PREFIX.SRC and PREFIX.TGT; returns the number of pairs (0 when unreadable)."""
    paths = {lang: f"{prefix}.{lang}" for lang in (source_lang, target_lang)}
    sides = {lang: read_lines(path, report) for lang, path in paths.items()}
    if any(lines is None for lines in sides.values()):
        return 0
    for lang, lines in sides.items():
        path = paths[lang]
        for number, text in enumerate(lines, start=1):
            if text is None:
                continue
            tokens = len(text.split())  # fairseq's tokenize_line: whitespace-separated
            if tokens == 0:
                report.problem(path, number, "empty line", "empty line (fairseq would train on an empty sentence)")
            elif tokens + 1 > max_positions:
                report.problem(path, number, "too long",
                               f"{tokens} tokens (+1 end-of-sentence = {tokens + 1}) > --max-positions {max_positions} "
                               "(fairseq-train drops such training pairs silently and fails on validation ones)")
    src, tgt = sides[source_lang], sides[target_lang]
    if len(src) != len(tgt):
        longer, shorter = (target_lang, source_lang) if len(tgt) > len(src) else (source_lang, target_lang)
        report.problem(paths[longer], min(len(src), len(tgt)) + 1, "line count",
                       f"no counterpart in {paths[shorter]}, which ends after {len(sides[shorter])} lines "
                       f"({paths[source_lang]}: {len(src)} lines, {paths[target_lang]}: {len(tgt)} lines)")
    return min(len(src), len(tgt))


# ---------------------------------------------------------------- binarized data


def check_dictionary(path, report):
    """Parse dict.<lang>.txt as fairseq's Dictionary.add_from_file does; returns its size or None."""
    if not os.path.isfile(path):
        report.problem(path, None, "missing dictionary",
                       "dictionary not found (fairseq-preprocess writes dict.<lang>.txt into --destdir)")
        return None
    from fairseq.data import Dictionary

    seen = {}
    ok = True
    with open(path, encoding="utf-8", errors="replace") as handle:
        for number, line in enumerate(handle, start=1):
            line = line.rstrip()
            overwrite = line.endswith(" #fairseq:overwrite")
            if overwrite:
                line = line[: -len(" #fairseq:overwrite")]
            token, _, count = line.rpartition(" ")
            if not token or not count.lstrip("-").isdigit():
                report.problem(path, number, "dictionary format", f"expected '<token> <count> [#fairseq:overwrite]', got {line!r}")
                ok = False
                continue
            if token in seen and not overwrite:
                report.problem(path, number, "duplicate token",
                               f"token {token!r} already on line {seen[token]} (fairseq refuses duplicates)")
                ok = False
            seen.setdefault(token, number)
    if not ok:
        return None
    return len(Dictionary.load(path))


def _split_prefix(data_dir, split, source_lang, target_lang):
    for pair in (f"{source_lang}-{target_lang}", f"{target_lang}-{source_lang}"):
        prefix = os.path.join(data_dir, f"{split}.{pair}.")
        if os.path.isfile(prefix + source_lang + ".idx"):
            return prefix
    return None


def _token_ids_max(dataset):
    """Largest token id in an MMapIndexedDataset, vectorized over its .bin (private fields of
    fairseq's class; None when they are not there)."""
    import numpy as np

    index = getattr(dataset, "_index", None)
    buffer = getattr(dataset, "_bin_buffer", None)
    if index is None or buffer is None or len(dataset) == 0:
        return None
    tokens = np.frombuffer(buffer, dtype=index.dtype)
    return int(tokens.max()) if tokens.size else None


def _expected_bin_size(dataset):
    """Size in bytes of the .bin that `dataset`'s index describes (private fields of fairseq's
    MMapIndexedDataset / IndexedDataset; None when they are not there)."""
    index = getattr(dataset, "_index", None)
    if index is not None and hasattr(index, "_pointers"):  # mmap (fairseq-preprocess's default)
        if len(index) == 0:
            return 0
        return int(index._pointers[-1]) + int(index.sizes[-1]) * index.dtype().itemsize
    offsets, element_size = getattr(dataset, "data_offsets", None), getattr(dataset, "element_size", None)
    if offsets is not None and element_size is not None:  # the older lazy/cached formats
        return int(offsets[-1]) * int(element_size)
    return None


def check_bin_size(dataset, bin_path, index_path, report):
    """Whether the .bin has the size its index says; a truncated .bin passed every other check and
    failed inside fairseq's DataLoader ("offset must be non-negative and no greater than buffer length")."""
    expected = _expected_bin_size(dataset)
    actual = os.path.getsize(bin_path)
    if expected is None or expected == actual:
        return True
    how = "truncated" if actual < expected else "longer than its index says"
    report.problem(bin_path, None, "size",
                   f"{actual} bytes, but {index_path} describes {expected} bytes: the .bin is {how} (cut short "
                   f"while copied or written, or from another fairseq-preprocess run); binarize the data again")
    return False


def check_binarized_split(data_dir, split, source_lang, target_lang, dict_sizes, max_positions, report, required):
    prefix = _split_prefix(data_dir, split, source_lang, target_lang)
    if prefix is None:
        if required:
            report.problem(os.path.join(data_dir, f"{split}.{source_lang}-{target_lang}.{source_lang}.idx"), None,
                           "missing split", f"no '{split}' split for {source_lang}-{target_lang} (run fairseq-preprocess "
                           f"with --{split}pref, or check --source-lang/--target-lang)")
        return 0
    from fairseq.data import indexed_dataset

    sizes = {}
    for lang in (source_lang, target_lang):
        base = prefix + lang
        missing = [base + ext for ext in (".idx", ".bin") if not os.path.isfile(base + ext)]
        if missing:
            for path in missing:
                report.problem(path, None, "missing file", f"missing (the {split} split needs {base}.idx and .bin)")
            continue
        try:
            dataset = indexed_dataset.make_dataset(base, impl=indexed_dataset.infer_dataset_impl(base))
            if dataset is None:
                raise ValueError("unknown format")
        except Exception as exc:  # a damaged index is a data problem to report, not a crash
            report.problem(base + ".idx", None, "unreadable", f"cannot read the binarized data: {exc}")
            continue
        bin_path = base + ".bin"
        if not check_bin_size(dataset, bin_path, base + ".idx", report):
            continue
        sizes[lang] = dataset.sizes
        for sentence in [int(i) for i in (dataset.sizes <= 1).nonzero()[0]]:
            report.problem(bin_path, sentence + 1, "empty sentence",
                           f"sentence {sentence} (line {sentence + 1} of the text it was binarized from) is empty")
        for sentence in [int(i) for i in (dataset.sizes > max_positions).nonzero()[0]]:
            report.problem(bin_path, sentence + 1, "too long",
                           f"sentence {sentence} (line {sentence + 1} of the text it was binarized from) has "
                           f"{int(dataset.sizes[sentence])} tokens with end-of-sentence > --max-positions {max_positions}")
        top = _token_ids_max(dataset)
        if top is not None and dict_sizes.get(lang) is not None and top >= dict_sizes[lang]:
            report.problem(bin_path, None, "token ids",
                           f"contains token id {top} but dict.{lang}.txt gives only {dict_sizes[lang]} symbols: "
                           "it was binarized with another dictionary")
    if len(sizes) == 2 and len(sizes[source_lang]) != len(sizes[target_lang]):
        report.problem(prefix + target_lang + ".idx", None, "sentence count",
                       f"{len(sizes[target_lang])} sentences, but {prefix + source_lang}.idx has "
                       f"{len(sizes[source_lang])}: the two sides were binarized from files with different line counts "
                       f"(check the text with: rfa-check-data raw)")
    return min((len(s) for s in sizes.values()), default=0)


def check_binarized(data_dir, source_lang, target_lang, splits, max_positions, report):
    if not os.path.isdir(data_dir):
        report.problem(data_dir, None, "missing directory", "data directory not found")
        return {}
    dict_sizes = {lang: check_dictionary(os.path.join(data_dir, f"dict.{lang}.txt"), report)
                  for lang in (source_lang, target_lang)}
    counts = {}
    for split in splits or ("train", "valid", "test"):
        counts[split] = check_binarized_split(data_dir, split, source_lang, target_lang, dict_sizes, max_positions,
                                              report, required=bool(splits) or split != "test")
    return counts


# ---------------------------------------------------------------- command line

MODES = ("raw", "bin")
# SPLIT.SRC-TGT.LANG.idx, as fairseq-preprocess names binarized files
_BIN_INDEX = re.compile(r"^[^.]+\.([^.\-]+)-([^.\-]+)\.([^.]+)\.idx$")


class UsageError(Exception):
    """The command line does not say (and the files do not tell) what to check."""


def is_binarized_dir(path):
    return os.path.isdir(path) and any(name.startswith("dict.") and name.endswith(".txt") for name in os.listdir(path))


def binarized_pairs(data_dir):
    """The (source, target) pairs of a fairseq-preprocess --destdir, from its index file names."""
    pairs = set()
    for name in os.listdir(data_dir):
        match = _BIN_INDEX.match(name)
        if match and match.group(3) in match.group(1, 2):
            pairs.add(match.group(1, 2))
    return sorted(pairs)


def text_languages(prefix):
    """Suffixes L of the files PREFIX.L (one dot-free word each)."""
    directory, stem = os.path.split(prefix)
    directory = directory or "."
    if not os.path.isdir(directory):
        return set()
    return {name[len(stem) + 1:] for name in os.listdir(directory)
            if name.startswith(stem + ".") and "." not in name[len(stem) + 1:]
            and os.path.isfile(os.path.join(directory, name))}


def text_prefixes_in(directory, languages=None):
    """The prefixes of a directory of text files: every DIR/STEM with a file for both languages. Without
    `languages`, the two suffixes found for more than one stem (e.g. train.de, valid.de, train.en, valid.en)."""
    stems = defaultdict(set)
    for name in os.listdir(directory):
        stem, dot, lang = name.rpartition(".")
        if dot and stem and os.path.isfile(os.path.join(directory, name)):
            stems[stem].add(lang)
    if languages is None:
        counts = defaultdict(int)
        for langs in stems.values():
            for lang in langs:
                counts[lang] += 1
        candidates = sorted(lang for lang, count in counts.items() if count > 1)
        if len(candidates) != 2:
            found = ", ".join(candidates) or "none"
            raise UsageError(f"cannot tell the language pair of the text files in {directory} (suffixes shared by "
                             f"several files: {found}); give -s SRC -t TGT")
        languages = candidates
    prefixes = [os.path.join(directory, stem) for stem, langs in sorted(stems.items()) if set(languages) <= langs]
    if not prefixes:
        raise UsageError(f"no text pair PREFIX.{languages[0]} + PREFIX.{languages[1]} in {directory}")
    return prefixes, languages


def pick_pair(pairs, source, target, where):
    """The one pair of `pairs` that agrees with the given -s/-t, or a UsageError naming the choices."""
    if not pairs:
        raise UsageError(f"no binarized split in {where} (no SPLIT.SRC-TGT.LANG.idx files) to read the language "
                         "pair from; give -s SRC -t TGT")
    oriented = pairs if source is None and target is None else sorted(set(pairs) | {(t, s) for s, t in pairs})
    matching = [(s, t) for s, t in oriented if source in (None, s) and target in (None, t)]
    if len(matching) == 1:
        return matching[0]
    listed = ", ".join(f"{s}-{t}" for s, t in pairs)
    if not matching:
        raise UsageError(f"{where} holds no {source or '*'}-{target or '*'} pair (pairs found: {listed})")
    raise UsageError(f"{where} holds several language pairs ({listed}); pick one with -s SRC -t TGT")


def resolve(args):
    """Fill in args.mode, args.targets, args.source_lang and args.target_lang from the command line and the
    files; returns a note on what was inferred (None when nothing was)."""
    paths = list(args.paths)
    mode = None
    if paths[0] in MODES and (len(paths) > 1 or not os.path.exists(paths[0])):
        mode = paths.pop(0)
        if not paths:
            raise UsageError(f"{mode} needs a path: rfa-check-data {mode} PATH [-s SRC -t TGT]")
    inferred = []
    if mode is None:
        mode = "bin" if len(paths) == 1 and is_binarized_dir(paths[0]) else "raw"
        inferred.append(f"{'binarized data' if mode == 'bin' else 'text'}")
    source, target = args.source_lang, args.target_lang
    if mode == "bin":
        if len(paths) != 1:
            raise UsageError(f"bin checks one fairseq-preprocess --destdir, got {len(paths)} paths")
        data_dir = paths[0]
        if (source is None or target is None) and os.path.isdir(data_dir):
            source, target = pick_pair(binarized_pairs(data_dir), source, target, data_dir)
            inferred.append(f"pair {source}-{target}")
        elif source is None or target is None:
            raise UsageError("give -s SRC -t TGT (the data directory does not exist, so the pair cannot be read from it)")
        targets = paths
    else:
        if args.splits is not None:
            raise UsageError("--splits applies to binarized data (bin) only")
        given = [lang for lang in (source, target) if lang is not None]
        targets = []
        for path in paths:
            if os.path.isdir(path):
                prefixes, languages = text_prefixes_in(path, given if len(given) == 2 else None)
                targets.extend(prefixes)
            else:
                targets.append(path)
        if len(given) < 2:
            found = set()
            for prefix in targets:
                languages = text_languages(prefix)
                if not languages:
                    raise UsageError(f"no file {prefix}.LANG found: give a text prefix (PREFIX.SRC and PREFIX.TGT), "
                                     "a directory of such files, or a fairseq-preprocess --destdir")
                found |= languages
            candidates = sorted(found | set(given))
            if len(candidates) != 2:
                raise UsageError(f"cannot tell the language pair of {', '.join(targets)} (suffixes found: "
                                 f"{', '.join(candidates) or 'none'}); give -s SRC -t TGT")
            source = source or next(lang for lang in candidates if lang != target)
            target = target or next(lang for lang in candidates if lang != source)
            inferred.append(f"languages {source} and {target}")
    args.mode, args.targets, args.source_lang, args.target_lang = mode, targets, source, target
    return ", ".join(inferred) or None


def build_parser():
    parser = argparse.ArgumentParser(prog="rfa-check-data", description=__doc__,
                                     usage="rfa-check-data [raw|bin] PATH [PATH ...] [-s SRC] [-t TGT] [options]",
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="+", metavar="PATH",
                        help="a fairseq-preprocess --destdir (binarized data); or text: PREFIX (checks PREFIX.SRC and "
                             "PREFIX.TGT) or a directory of such files. A first word raw or bin names the kind")
    parser.add_argument("-s", "--source-lang", default=None, help="default: inferred from the file names")
    parser.add_argument("-t", "--target-lang", default=None, help="default: inferred from the file names")
    parser.add_argument("--splits", nargs="+", default=None,
                        help="binarized data: splits that must exist (default: train and valid, and test if present)")
    parser.add_argument("--max-positions", type=int, default=DEFAULT_MAX_POSITIONS,
                        help=f"longest sentence in tokens, end-of-sentence included (default: {DEFAULT_MAX_POSITIONS})")
    parser.add_argument("--max-errors", type=int, default=DEFAULT_MAX_ERRORS,
                        help=f"problems of one kind shown per file (default: {DEFAULT_MAX_ERRORS})")
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.max_positions <= 0:
        print(f"rfa-check-data: error: --max-positions must be positive, got {args.max_positions}", file=sys.stderr)
        return 2
    try:
        note = resolve(args)
    except UsageError as exc:
        print(f"rfa-check-data: error: {exc}", file=sys.stderr)
        return 2
    if note:
        print(f"rfa-check-data: checking {args.mode} data ({note}; inferred from the files)", file=sys.stderr)
    report = Report(args.max_errors)
    if args.mode == "raw":
        counts = {prefix: check_raw_pair(prefix, args.source_lang, args.target_lang, args.max_positions, report)
                  for prefix in args.targets}
    else:
        counts = check_binarized(args.targets[0], args.source_lang, args.target_lang, args.splits, args.max_positions,
                                 report)
    problems = report.finish()
    summary = ", ".join(f"{name}: {count} pairs" for name, count in counts.items())
    if problems:
        print(f"rfa-check-data: {problems} problem(s) found ({summary}), the first in {report.first_path} "
              f"(all listed above)", file=sys.stderr)
        return 1
    print(f"rfa-check-data: OK ({summary})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
