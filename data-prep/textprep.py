#!/usr/bin/env python3
"""Text-processing steps used by data-prep/prepare-*.sh.

Every subcommand writes its outputs under temporary names and renames them only
when all of them are complete, so an interrupted or failed run never leaves a
half-written file under a final name. Errors are reported as one
"ERROR: ..." line naming the offending file, with exit status 1.

Subcommands:
  extract         pull named members out of a .tgz/.tar archive
  build-parallel  read aligned corpora (plain, .gz, .xml/.sgm segments), normalise, concatenate
  clean           Moses clean-corpus-n.perl rules (min/max length, length ratio)
  split-every     hold out every N-th pair (IWSLT14 valid split)
  spm-train       joint SentencePiece model on the training text
  spm-encode      SentencePiece pieces, one sentence per line
  spm-dict        fairseq dictionary listing the SentencePiece pieces
  check-lines     line counts: equal across files and/or equal to published counts
"""

import argparse
import gzip
import itertools
import os
import re
import sys
import tarfile
from contextlib import contextmanager
from xml.sax.saxutils import unescape as xml_unescape

CHUNK_PAIRS = 20000  # pairs handed to a worker at once; keeps memory flat on 40M-line corpora
# a chunk takes seconds; a worker this late is hung (or the machine is swapping hard)
CHUNK_TIMEOUT_S = 1800


class PrepError(Exception):
    """A user-facing failure: bad input, missing file, inconsistent corpora."""


# ---------------------------------------------------------------- file helpers


def open_text(path):
    """Open plain or gzipped UTF-8 text. Only '\\n' ends a line (as for wc -l and
    the Moses perl scripts); a stray '\\r' inside a sentence must not split it."""
    if not os.path.isfile(path):
        raise PrepError(f"input file not found: {path}")
    if path.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8", errors="replace", newline="\n")
    return open(path, "rt", encoding="utf-8", errors="replace", newline="\n")


def read_lines(path):
    """Yield the lines of a text file without their newline."""
    try:
        with open_text(path) as handle:
            for line in handle:
                yield line[:-1] if line.endswith("\n") else line
    except (OSError, EOFError, gzip.BadGzipFile) as exc:
        raise PrepError(f"cannot read {path}: {exc}") from exc


@contextmanager
def atomic_outputs(paths):
    """Yield text handles writing to '<path>.tmp'; rename all of them to their
    final names only if the block finishes without an exception."""
    tmp_paths = [path + ".tmp" for path in paths]
    handles = []
    try:
        for tmp_path in tmp_paths:
            os.makedirs(os.path.dirname(os.path.abspath(tmp_path)), exist_ok=True)
            handles.append(open(tmp_path, "wt", encoding="utf-8", newline="\n"))
        yield handles
        for handle in handles:
            handle.close()
        for tmp_path, path in zip(tmp_paths, paths):
            os.replace(tmp_path, path)
    finally:
        for handle in handles:
            handle.close()
        for tmp_path in tmp_paths:
            if os.path.exists(tmp_path):
                os.remove(tmp_path)


def count_lines(path):
    return sum(1 for _ in read_lines(path))


def parallel_lines(src_path, tgt_path):
    """Yield (src, tgt) line pairs; fail naming both files and both line counts
    when their lengths differ (the corpora would be misaligned)."""
    for src, tgt in itertools.zip_longest(read_lines(src_path), read_lines(tgt_path)):
        if src is None or tgt is None:
            raise PrepError(
                f"line count mismatch: {src_path} has {count_lines(src_path)} lines "
                f"but {tgt_path} has {count_lines(tgt_path)} lines"
            )
        yield src, tgt


def chunked(iterable, size):
    iterator = iter(iterable)
    while True:
        chunk = list(itertools.islice(iterator, size))
        if not chunk:
            return
        yield chunk


def map_chunks(function, chunks, workers, timeout_s=None):
    """Apply function to each chunk, in order; in worker processes if workers > 1.
    At most 2 * workers chunks are in flight (Pool.imap would read the whole corpus ahead).
    A worker that dies (killed, out of memory) or keeps a chunk longer than timeout_s (default
    CHUNK_TIMEOUT_S) is a PrepError: multiprocessing.Pool would wait for a dead worker's chunk forever."""
    if workers <= 1:
        for chunk in chunks:
            yield function(chunk)
        return
    import collections
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures import TimeoutError as ChunkTimeout
    from concurrent.futures.process import BrokenProcessPool

    timeout_s = CHUNK_TIMEOUT_S if timeout_s is None else timeout_s
    pool = ProcessPoolExecutor(workers)
    pending = collections.deque()

    def next_result():
        try:
            return pending.popleft().result(timeout=timeout_s)
        except BrokenProcessPool as exc:
            raise PrepError(f"a worker process died while it processed a chunk (killed, or out of memory?): {exc}") from exc
        except ChunkTimeout:
            raise PrepError(f"a worker process did not finish its chunk of up to {CHUNK_PAIRS} pairs within "
                            f"{timeout_s:g} s") from None

    finished = False
    try:
        for chunk in chunks:
            pending.append(pool.submit(function, chunk))
            if len(pending) >= 2 * workers:
                yield next_result()
        while pending:
            yield next_result()
        finished = True
    finally:
        if not finished:  # an error: stop the workers now, a hung one would block the exit
            # the executor's processes: private, but Python < 3.14 has no public way to stop them
            processes = list((getattr(pool, "_processes", None) or {}).values())
            for process in processes:
                process.terminate()
            for process in processes:  # reaped, so that none is left behind as a zombie (SIGKILL if SIGTERM is ignored)
                process.join(timeout=5)
                if process.is_alive():
                    process.kill()
                    process.join(timeout=5)
        pool.shutdown(wait=finished, cancel_futures=True)


# ---------------------------------------------------------------- extraction


def extract_members(archive, dest_dir, members):
    """Extract the wanted members (paths as in the real archive) into dest_dir."""
    wanted = {member[2:] if member.startswith("./") else member for member in members}
    found = {}
    try:
        with tarfile.open(archive, "r:*") as tar:
            for info in tar:
                name = info.name[2:] if info.name.startswith("./") else info.name
                if name in wanted and info.isfile():
                    dest = os.path.join(dest_dir, name)
                    os.makedirs(os.path.dirname(dest), exist_ok=True)
                    source = tar.extractfile(info)
                    tmp_dest = dest + ".tmp"
                    try:
                        with open(tmp_dest, "wb") as out:
                            while True:
                                block = source.read(1 << 20)
                                if not block:
                                    break
                                out.write(block)
                        os.replace(tmp_dest, dest)
                    finally:
                        if os.path.exists(tmp_dest):
                            os.remove(tmp_dest)
                    found[name] = dest
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise PrepError(f"cannot extract from {archive}: {exc}") from exc
    missing = sorted(wanted - set(found))
    if missing:
        raise PrepError(f"archive {archive} lacks expected member(s): {', '.join(missing)}")


# ---------------------------------------------------------------- normalisation

_TAG_LINE = re.compile(r"^\s*<(/?)([A-Za-z_]+)[^>]*>.*$")
_WRAPPED_TAGS = ("title", "description")  # fairseq keeps their text, drops the tags
_SEG = re.compile(r"<seg[^>]*>(.*)</seg>")
_SPACES = re.compile(r"\s+")


class Normalizer:
    """Per-language text normaliser; built lazily in each worker process."""

    def __init__(self, lang, punct_norm, remove_nonprint, fix_apostrophe, lowercase):
        self.punct = None
        if punct_norm:
            from sacremoses import MosesPunctNormalizer

            self.punct = MosesPunctNormalizer(lang=lang)
        self.nonprint = None
        if remove_nonprint:
            import regex  # dependency of sacremoses; supports \p{C} like the perl script

            self.nonprint = regex.compile(r"\p{C}")
        self.fix_apostrophe = fix_apostrophe
        self.lowercase = lowercase

    def __call__(self, text):
        if self.punct is not None:  # normalize-punctuation.perl
            text = self.punct.normalize(text)
        if self.nonprint is not None:  # remove-non-printing-char.perl
            text = self.nonprint.sub(" ", text)
        if self.fix_apostrophe:  # prepare-iwslt14.sh: sed "s/\’/\'/g" on test sets
            text = text.replace("\u2019", "'")
        if self.lowercase:
            text = text.lower()
        return _SPACES.sub(" ", text).strip()


_WORKER_NORMALIZERS = {}


def _normalize_chunk(job):
    options, chunk = job
    key = tuple(sorted(options.items()))
    if key not in _WORKER_NORMALIZERS:
        flags = dict(options)
        src_lang, tgt_lang = flags.pop("src_lang"), flags.pop("tgt_lang")
        _WORKER_NORMALIZERS[key] = (Normalizer(src_lang, **flags), Normalizer(tgt_lang, **flags))
    src_norm, tgt_norm = _WORKER_NORMALIZERS[key]
    return [(src_norm(src), tgt_norm(tgt)) for src, tgt in chunk]


def iwslt_tag_filter(pairs, src_path, tgt_path):
    """Drop TED metadata lines (<url>, <talkid>, <keywords>, <speaker>, ...) and
    strip <title>/<description> tags, as fairseq's prepare-iwslt14.sh does.
    Both sides must agree on which lines are metadata."""
    for line_no, (src, tgt) in enumerate(pairs, start=1):
        src_tag, tgt_tag = _TAG_LINE.match(src), _TAG_LINE.match(tgt)
        src_name = src_tag.group(2).lower() if src_tag else None
        tgt_name = tgt_tag.group(2).lower() if tgt_tag else None
        if src_name != tgt_name:
            raise PrepError(
                f"metadata lines not aligned at line {line_no}: {src_path} has "
                f"{src[:60]!r}, {tgt_path} has {tgt[:60]!r}"
            )
        if src_name is None:
            yield src, tgt
        elif src_name in _WRAPPED_TAGS:
            strip = re.compile(rf"</?{src_name}>", re.IGNORECASE)
            yield strip.sub("", src), strip.sub("", tgt)
        # any other tag line is metadata and is dropped


def extract_segments(path, unescape):
    """Text of the <seg id=...> lines of an IWSLT .xml or WMT .sgm file, cleaned
    like sacrebleu does (strip, collapse whitespace). XML entities are decoded
    for .xml (real XML); WMT .sgm is kept verbatim, as sacrebleu keeps it."""
    segments = []
    for line in read_lines(path):
        if not line.lstrip().startswith("<seg"):
            continue
        match = _SEG.search(line)
        if match is None:
            raise PrepError(f"malformed <seg> line in {path}: {line[:80]!r}")
        text = match.group(1)
        if unescape:
            text = xml_unescape(text, {"&quot;": '"', "&apos;": "'"})
        segments.append(_SPACES.sub(" ", text).strip())
    if not segments:
        raise PrepError(f"no <seg> lines found in {path}")
    return segments


def cmd_build_parallel(args):
    if len(args.inputs) % 2:
        raise PrepError("build-parallel needs input files in src/tgt pairs")
    options = dict(
        src_lang=args.src_lang,
        tgt_lang=args.tgt_lang,
        punct_norm=args.punct_norm,
        remove_nonprint=args.remove_nonprint,
        fix_apostrophe=args.fix_apostrophe,
        lowercase=args.lowercase,
    )
    n_written = 0
    with atomic_outputs([args.out_src, args.out_tgt]) as (out_src, out_tgt):
        for src_path, tgt_path in zip(args.inputs[0::2], args.inputs[1::2]):
            if args.segs:
                src_segs = extract_segments(src_path, args.xml_unescape)
                tgt_segs = extract_segments(tgt_path, args.xml_unescape)
                if len(src_segs) != len(tgt_segs):
                    raise PrepError(
                        f"segment count mismatch: {src_path} has {len(src_segs)} <seg> lines "
                        f"but {tgt_path} has {len(tgt_segs)}"
                    )
                pairs = zip(src_segs, tgt_segs)
            else:
                pairs = parallel_lines(src_path, tgt_path)
            if args.iwslt_tags:
                pairs = iwslt_tag_filter(pairs, src_path, tgt_path)
            n_corpus = 0
            jobs = ((options, chunk) for chunk in chunked(pairs, CHUNK_PAIRS))
            for chunk in map_chunks(_normalize_chunk, jobs, args.workers):
                for src, tgt in chunk:
                    out_src.write(src + "\n")
                    out_tgt.write(tgt + "\n")
                n_corpus += len(chunk)
            print(f"  {n_corpus} pairs from {src_path} / {tgt_path}", file=sys.stderr)
            n_written += n_corpus
    print(f"wrote {n_written} pairs to {args.out_src} / {args.out_tgt}", file=sys.stderr)


# ---------------------------------------------------------------- cleaning

_WORKER_TOKENIZERS = {}


def _moses_length(lang, text):
    if lang not in _WORKER_TOKENIZERS:
        from sacremoses import MosesTokenizer

        _WORKER_TOKENIZERS[lang] = MosesTokenizer(lang=lang)
    # Same token boundaries as tokenizer.perl without -a (escaping does not change counts).
    return len(_WORKER_TOKENIZERS[lang].tokenize(text, escape=False))


def _length_chunk(job):
    """Return the chunk's pairs with their lengths: (src, tgt, n_src, n_tgt)."""
    count_mode, src_lang, tgt_lang, chunk = job
    if count_mode == "moses":
        return [
            (s, t, _moses_length(src_lang, s) if s else 0, _moses_length(tgt_lang, t) if t else 0)
            for s, t in chunk
        ]
    return [(s, t, len(s.split()), len(t.split())) for s, t in chunk]


def keep_pair(n_src, n_tgt, min_len, max_len, ratio):
    """clean-corpus-n.perl: both sides within [min_len, max_len] tokens and
    neither side more than `ratio` times longer than the other."""
    if not (min_len <= n_src <= max_len and min_len <= n_tgt <= max_len):
        return False
    return n_src / n_tgt <= ratio and n_tgt / n_src <= ratio


def cmd_clean(args):
    if args.min_len < 1:
        raise PrepError("--min-len must be >= 1 (the ratio test divides by lengths)")
    n_in = n_kept = 0
    with atomic_outputs([args.out_src, args.out_tgt]) as (out_src, out_tgt):
        pairs = (
            (_SPACES.sub(" ", s).strip(), _SPACES.sub(" ", t).strip())
            for s, t in parallel_lines(args.in_src, args.in_tgt)
        )
        jobs = ((args.count, args.src_lang, args.tgt_lang, chunk) for chunk in chunked(pairs, CHUNK_PAIRS))
        # Counting whitespace tokens is cheaper than shipping chunks to worker processes.
        workers = args.workers if args.count == "moses" else 1
        for measured in map_chunks(_length_chunk, jobs, workers):
            for src, tgt, n_src, n_tgt in measured:
                n_in += 1
                if keep_pair(n_src, n_tgt, args.min_len, args.max_len, args.ratio):
                    if args.lowercase_output:
                        src, tgt = src.lower(), tgt.lower()
                    out_src.write(src + "\n")
                    out_tgt.write(tgt + "\n")
                    n_kept += 1
    print(
        f"clean ({args.count} tokens, length {args.min_len}..{args.max_len}, ratio {args.ratio}): "
        f"kept {n_kept} of {n_in} pairs -> {args.out_src} / {args.out_tgt}",
        file=sys.stderr,
    )
    if n_kept == 0:
        raise PrepError(f"cleaning removed every pair of {args.in_src} / {args.in_tgt}")


def cmd_split_every(args):
    n_rest = n_held = 0
    outputs = [args.rest_src, args.rest_tgt, args.held_src, args.held_tgt]
    with atomic_outputs(outputs) as (rest_src, rest_tgt, held_src, held_tgt):
        for line_no, (src, tgt) in enumerate(parallel_lines(args.in_src, args.in_tgt), start=1):
            if line_no % args.every == 0:  # awk 'NR%23 == 0' in prepare-iwslt14.sh
                held_src.write(src + "\n")
                held_tgt.write(tgt + "\n")
                n_held += 1
            else:
                rest_src.write(src + "\n")
                rest_tgt.write(tgt + "\n")
                n_rest += 1
    print(f"held out every {args.every}-th pair: {n_rest} kept, {n_held} held out", file=sys.stderr)


# ---------------------------------------------------------------- SentencePiece


def cmd_spm_train(args):
    import sentencepiece as spm

    for path in args.inputs:
        if not os.path.isfile(path):
            raise PrepError(f"SentencePiece training input not found: {path}")
    final_model, final_vocab = args.model_prefix + ".model", args.model_prefix + ".vocab"
    tmp_prefix = args.model_prefix + ".tmp"
    if hasattr(spm, "set_random_generator_seed"):
        spm.set_random_generator_seed(args.seed)  # reproducible sentence sampling
    try:
        spm.SentencePieceTrainer.train(
            input=",".join(args.inputs),
            model_prefix=tmp_prefix,
            vocab_size=args.vocab_size,
            model_type=args.model_type,
            character_coverage=args.character_coverage,
            input_sentence_size=args.input_sentence_size,
            shuffle_input_sentence=True,
            num_threads=max(1, args.workers),
            minloglevel=2,
        )
        os.replace(tmp_prefix + ".vocab", final_vocab)
        os.replace(tmp_prefix + ".model", final_model)  # the model last: it marks completion
    except (RuntimeError, OSError) as exc:
        raise PrepError(
            f"SentencePiece training on {', '.join(args.inputs)} failed: {exc} "
            f"(a smaller --vocab-size may be needed for a small corpus)"
        ) from exc
    finally:
        for suffix in (".model", ".vocab"):
            if os.path.exists(tmp_prefix + suffix):
                os.remove(tmp_prefix + suffix)
    print(f"trained {args.model_type} SentencePiece model, {args.vocab_size} pieces -> {final_model}", file=sys.stderr)


def cmd_spm_encode(args):
    import sentencepiece as spm

    if not os.path.isfile(args.model):
        raise PrepError(f"SentencePiece model not found: {args.model}")
    processor = spm.SentencePieceProcessor(model_file=args.model)
    if len(args.files) % 2:
        raise PrepError("spm-encode needs INPUT OUTPUT pairs")
    pairs = list(zip(args.files[0::2], args.files[1::2]))
    with atomic_outputs([out for _, out in pairs]) as handles:
        for (in_path, _), out in zip(pairs, handles):
            n_lines = 0
            for chunk in chunked(read_lines(in_path), 100000):
                pieces = processor.encode(chunk, out_type=str, num_threads=max(1, args.workers))
                out.writelines(" ".join(sentence) + "\n" for sentence in pieces)
                n_lines += len(chunk)
            print(f"  encoded {n_lines} lines of {in_path}", file=sys.stderr)


def cmd_spm_dict(args):
    """fairseq dictionary = the SentencePiece pieces minus the control symbols
    fairseq adds itself (<unk>, <s>, </s>, <pad>), so vocab == SentencePiece vocab."""
    control = {"<unk>", "<s>", "</s>", "<pad>"}
    with atomic_outputs([args.out]) as (out,):
        for line in read_lines(args.vocab):
            piece = line.split("\t")[0]
            if piece in control:
                continue
            if not piece or any(ch.isspace() for ch in piece):
                raise PrepError(f"unexpected piece {piece!r} in {args.vocab}")
            out.write(f"{piece} 1\n")


# ---------------------------------------------------------------- checks


def cmd_check_lines(args):
    counts = {}
    for path in args.files:
        if not os.path.isfile(path):
            raise PrepError(f"expected file not found: {path}")
        with (gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")) as handle:
            data_has_cr = False
            n_lines = 0
            for block in iter(lambda: handle.read(1 << 20), b""):
                n_lines += block.count(b"\n")
                data_has_cr = data_has_cr or b"\r" in block
        if data_has_cr and args.no_cr:
            # fairseq-preprocess reads with universal newlines: a '\r' would split a sentence.
            raise PrepError(f"{path} contains a carriage return; it would break alignment in fairseq-preprocess")
        counts[path] = n_lines
    if args.expect is not None:
        for path, n_lines in counts.items():
            if n_lines != args.expect:
                raise PrepError(f"{path} has {n_lines} lines, expected {args.expect} (published size)")
    if len(set(counts.values())) > 1:
        detail = ", ".join(f"{path}: {n}" for path, n in counts.items())
        raise PrepError(f"line counts differ: {detail}")
    print(f"{next(iter(counts.values()))} lines: {' '.join(counts)}", file=sys.stderr)


def cmd_extract(args):
    extract_members(args.archive, args.dest_dir, args.members)


# ---------------------------------------------------------------- CLI


def build_parser():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("extract", help="extract members of a tar archive")
    p.add_argument("archive")
    p.add_argument("dest_dir")
    p.add_argument("members", nargs="+")
    p.set_defaults(func=cmd_extract)

    p = sub.add_parser("build-parallel", help="read, normalise and concatenate aligned corpora")
    p.add_argument("--src-lang", required=True)
    p.add_argument("--tgt-lang", required=True)
    p.add_argument("--out-src", required=True)
    p.add_argument("--out-tgt", required=True)
    p.add_argument("--segs", action="store_true", help="inputs are .xml/.sgm; use their <seg> lines")
    p.add_argument("--xml-unescape", action="store_true", help="decode XML entities in <seg> text")
    p.add_argument("--iwslt-tags", action="store_true", help="drop/strip TED metadata tag lines")
    p.add_argument("--punct-norm", action="store_true", help="Moses normalize-punctuation")
    p.add_argument("--remove-nonprint", action="store_true", help="Moses remove-non-printing-char")
    p.add_argument("--fix-apostrophe", action="store_true", help="map U+2019 to ASCII apostrophe")
    p.add_argument("--lowercase", action="store_true")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("inputs", nargs="+", help="SRC TGT [SRC TGT ...]")
    p.set_defaults(func=cmd_build_parallel)

    p = sub.add_parser("clean", help="clean-corpus-n length and ratio filter")
    p.add_argument("--in-src", required=True)
    p.add_argument("--in-tgt", required=True)
    p.add_argument("--out-src", required=True)
    p.add_argument("--out-tgt", required=True)
    p.add_argument("--src-lang", default="en")
    p.add_argument("--tgt-lang", default="en")
    p.add_argument("--count", choices=["whitespace", "moses"], default="whitespace",
                   help="length unit: existing whitespace tokens (e.g. SentencePiece pieces) or Moses tokens")
    p.add_argument("--ratio", type=float, default=9.0)
    p.add_argument("--min-len", type=int, default=1)
    p.add_argument("--max-len", type=int, default=250)
    p.add_argument("--lowercase-output", action="store_true")
    p.add_argument("--workers", type=int, default=1)
    p.set_defaults(func=cmd_clean)

    p = sub.add_parser("split-every", help="hold out every N-th pair")
    p.add_argument("--every", type=int, required=True)
    for name in ("in-src", "in-tgt", "rest-src", "rest-tgt", "held-src", "held-tgt"):
        p.add_argument(f"--{name}", required=True)
    p.set_defaults(func=cmd_split_every)

    p = sub.add_parser("spm-train", help="train a joint SentencePiece model")
    p.add_argument("--model-prefix", required=True)
    p.add_argument("--vocab-size", type=int, required=True)
    p.add_argument("--model-type", default="unigram", choices=["unigram", "bpe"])
    p.add_argument("--character-coverage", type=float, default=1.0)
    p.add_argument("--input-sentence-size", type=int, default=0, help="0 = use every sentence")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("inputs", nargs="+")
    p.set_defaults(func=cmd_spm_train)

    p = sub.add_parser("spm-encode", help="encode text files into pieces")
    p.add_argument("--model", required=True)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("files", nargs="+", help="INPUT OUTPUT [INPUT OUTPUT ...]")
    p.set_defaults(func=cmd_spm_encode)

    p = sub.add_parser("spm-dict", help="fairseq dictionary from a SentencePiece .vocab")
    p.add_argument("--vocab", required=True)
    p.add_argument("--out", required=True)
    p.set_defaults(func=cmd_spm_dict)

    p = sub.add_parser("check-lines", help="check line counts")
    p.add_argument("--expect", type=int, default=None, help="required line count of every file")
    p.add_argument("--no-cr", action="store_true", help="fail if a file contains '\\r'")
    p.add_argument("files", nargs="+")
    p.set_defaults(func=cmd_check_lines)
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except PrepError as exc:
        print(f"ERROR: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
