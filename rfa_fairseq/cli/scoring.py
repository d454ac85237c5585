"""Score translations: detokenized sacreBLEU (with its signature) and chrF, optionally
the tokenized, compound-split BLEU of Vaswani et al. / fairseq for WMT14 EN-DE;
and extract hypotheses from `fairseq-generate` output.

Console script `rfa-score` (also `python -m rfa_fairseq.cli.scoring`):

  rfa-score --hyp hyp.txt --ref test.raw.de [--compound-split] [--json scores.json]
  rfa-score --generate-output gen.out --spm-model spm.model --ref test.raw.de --save-hyp hyp.txt
  rfa-score --generate-output gen.out --spm-model spm.model --save-hyp hyp.txt --extract-only

All BLEU/chrF numbers come from the sacrebleu library; nothing here re-implements them.
"""
import argparse
import json
import os
import re
import sys

if __package__:
    from ..textio import InputEncodingError, read_utf8_lines
    from . import run_console_script
else:  # run as a file (scripts/generate.sh), so that importing the package does not import fairseq
    import importlib.util

    def _load_beside(name: str, relative: str):
        """A standard-library-only module of the package, loaded by its path relative to this file."""
        spec = importlib.util.spec_from_file_location(name, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                                         relative))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    _textio = _load_beside("rfa_fairseq_textio", os.path.join(os.pardir, "textio.py"))
    InputEncodingError, read_utf8_lines = _textio.InputEncodingError, _textio.read_utf8_lines
    run_console_script = _load_beside("rfa_fairseq_cli_runner", "__init__.py").run_console_script

SPM_SPACE = "\u2581"  # SentencePiece's word-boundary marker
# fairseq's scripts/compound_split_bleu.sh: perl -ple 's{(\S)-(\S)}{$1 ##AT##-##AT## $2}g'
_COMPOUND = re.compile(r"(\S)-(\S)")
_GENERATE_LINE = re.compile(r"^([HD])-(\d+)\t")


class ScoringError(Exception):
    """A user-facing failure (missing file, mismatched line counts, bad input)."""


# ---------------------------------------------------------------- reading


def read_lines(path, role):
    """Lines of a UTF-8 text file; only '\\n' ends a line, so stray '\\r' or
    U+2028 inside a sentence cannot shift the alignment with the reference. A line that is not UTF-8
    is an error naming the file and line (rfa_fairseq.textio)."""
    if os.path.isdir(path):
        raise ScoringError(f"{role} file {path} is a directory; pass the text file")
    if not os.path.isfile(path):
        raise ScoringError(f"{role} file not found: {path}")
    try:
        return [text for _, text in read_utf8_lines(path)]
    except InputEncodingError as exc:
        raise ScoringError(f"{role} file {exc}") from None


def check_same_length(hyps, hyp_path, refs, ref_path):
    if len(hyps) != len(refs):
        raise ScoringError(
            f"line counts differ: hypotheses {hyp_path} has {len(hyps)} lines, "
            f"reference {ref_path} has {len(refs)} lines"
        )


# ---------------------------------------------------------------- fairseq-generate output


def spm_decode(lines, spm_model=None):
    """Turn SentencePiece pieces back into text (with the model when given,
    otherwise with the marker rule fairseq's --post-process sentencepiece uses)."""
    if spm_model is not None:
        if not os.path.isfile(spm_model):
            raise ScoringError(f"SentencePiece model not found: {spm_model}")
        import sentencepiece as spm

        processor = spm.SentencePieceProcessor(model_file=spm_model)
        return [processor.decode(line.split()) for line in lines]
    return [line.replace(" ", "").replace(SPM_SPACE, " ").strip() for line in lines]


def extract_hypotheses(generate_output, field="auto", spm_model=None):
    """Best hypothesis per sentence from fairseq-generate output, in sentence-id order.

    field: "H" (hypothesis lines), "D" (detokenized lines, i.e. after
    --post-process/--remove-bpe), or "auto" (D when present, else H). Lines still
    in SentencePiece pieces are decoded. With --nbest > 1 the first (best) line
    of each id is kept. Fails if ids are missing (e.g. skipped inputs), since the
    hypotheses would no longer line up with the references.
    """
    if field not in ("auto", "H", "D"):
        raise ScoringError(f"unknown field {field!r}; use H, D or auto")
    by_field = {"H": {}, "D": {}}
    for line in read_lines(generate_output, "fairseq-generate output"):
        match = _GENERATE_LINE.match(line)
        if match is None:
            continue
        kind, sentence_id = match.group(1), int(match.group(2))
        parts = line.split("\t", 2)  # "H-<id>", score, text (text may be empty)
        text = parts[2] if len(parts) == 3 else ""
        by_field[kind].setdefault(sentence_id, text)
    if field == "auto":
        field = "D" if by_field["D"] else "H"
    hypotheses = by_field[field]
    if not hypotheses:
        raise ScoringError(f"no {field}-<id> lines in fairseq-generate output {generate_output}")
    ids = sorted(hypotheses)
    missing = sorted(set(range(ids[-1] + 1)) - set(ids))
    if missing:
        shown = ", ".join(map(str, missing[:10])) + (" ..." if len(missing) > 10 else "")
        raise ScoringError(
            f"{generate_output}: no hypothesis for {len(missing)} sentence id(s): {shown} "
            f"(was --skip-invalid-size-inputs-valid-test or a max length used?)"
        )
    lines = [hypotheses[i] for i in ids]
    if any(SPM_SPACE in line for line in lines):  # not post-processed yet
        lines = spm_decode(lines, spm_model)
    return lines


# ---------------------------------------------------------------- scoring


def compound_split(text):
    """Vaswani et al. / fairseq compound splitting: 'a-b' -> 'a ##AT##-##AT## b'."""
    return _COMPOUND.sub(r"\1 ##AT##-##AT## \2", text)


def moses_tokenize(lines, lang):
    from sacremoses import MosesTokenizer

    tokenizer = MosesTokenizer(lang=lang)
    return [tokenizer.tokenize(line, return_str=True, escape=False) for line in lines]


def _bleu_dict(metric, result):
    return {
        "score": result.score,
        "signature": str(metric.get_signature()),
        "text": str(result),
        "precisions": list(result.precisions),
        "bp": result.bp,
        "sys_len": result.sys_len,
        "ref_len": result.ref_len,
    }


def score(hyps, refs_list, tokenize="13a", lowercase=False, compound_split_lang=None):
    """BLEU and chrF of hypotheses against one or more reference lists.

    compound_split_lang: also report tokenized BLEU with compound splitting,
    tokenizing both sides with the Moses tokenizer of this language.
    """
    from sacrebleu.metrics import BLEU, CHRF

    bleu = BLEU(tokenize=tokenize, lowercase=lowercase)
    chrf = CHRF(lowercase=lowercase)
    chrf_result = chrf.corpus_score(hyps, refs_list)
    scores = {
        "num_sentences": len(hyps),
        "bleu": _bleu_dict(bleu, bleu.corpus_score(hyps, refs_list)),
        "chrf": {"score": chrf_result.score, "signature": str(chrf.get_signature()), "text": str(chrf_result)},
        "compound_split_bleu": None,
    }
    if compound_split_lang:
        split_hyps = [compound_split(line) for line in moses_tokenize(hyps, compound_split_lang)]
        split_refs = [[compound_split(line) for line in moses_tokenize(refs, compound_split_lang)] for refs in refs_list]
        # The text is already tokenized: sacrebleu must not tokenize again.
        tokenized_bleu = BLEU(tokenize="none", lowercase=lowercase, force=True)
        result = _bleu_dict(tokenized_bleu, tokenized_bleu.corpus_score(split_hyps, split_refs))
        result["moses_lang"] = compound_split_lang
        scores["compound_split_bleu"] = result
    return scores


def summary(scores):
    lines = [
        f"sacreBLEU {scores['bleu']['score']:6.2f}  {scores['bleu']['signature']}",
        f"  {scores['bleu']['text']}",
        f"chrF      {scores['chrf']['score']:6.2f}  {scores['chrf']['signature']}",
    ]
    split = scores["compound_split_bleu"]
    if split is not None:
        lines.append(
            f"tokenized BLEU, compound split (Moses {split['moses_lang']}) {split['score']:6.2f}"
            f"  [comparable to Vaswani et al. / fairseq compound_split_bleu.sh]"
        )
        lines.append(f"  {split['text']}")
    lines.append(f"sentences: {scores['num_sentences']}")
    return "\n".join(lines)


def write_atomic(path, text, flag):
    if os.path.isdir(path):
        raise ScoringError(f"{flag} {path} is a directory; give a file name, e.g. {flag} {os.path.join(path, 'out.txt')}")
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp_path = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp_path, "w", encoding="utf-8", newline="\n") as handle:
            handle.write(text)
        os.replace(tmp_path, path)
    finally:
        if os.path.exists(tmp_path):
            os.remove(tmp_path)


# ---------------------------------------------------------------- CLI


def build_parser():
    parser = argparse.ArgumentParser(
        prog="rfa-score", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--hyp", help="detokenized hypotheses, one per line")
    source.add_argument("--generate-output", help="stdout of fairseq-generate (H-/D- lines)")
    parser.add_argument("--ref", nargs="+", default=[], help="detokenized reference file(s), e.g. OUT/test.raw.de")
    parser.add_argument("--field", default="auto", choices=["auto", "H", "D"],
                        help="generate-output lines to use (auto: D when present, else H)")
    parser.add_argument("--spm-model", help="SentencePiece model to decode piece-level hypotheses")
    parser.add_argument("--save-hyp", help="write the extracted, decoded hypotheses here (atomically)")
    parser.add_argument("--extract-only", action="store_true", help="only extract hypotheses (needs --save-hyp)")
    parser.add_argument("--tokenize", default="13a", help="sacreBLEU tokenizer (default 13a)")
    parser.add_argument("--lowercase", action="store_true", help="case-insensitive BLEU/chrF")
    parser.add_argument("--compound-split", action="store_true",
                        help="also tokenized BLEU with compound splitting (WMT14 EN-DE papers)")
    parser.add_argument("--lang", help="target language for the Moses tokenizer of --compound-split "
                                       "(default: the reference file's extension, e.g. test.raw.de -> de)")
    parser.add_argument("--json", help="also write the scores as JSON here (atomically)")
    return parser


def run(args):
    if args.generate_output:
        hyps = extract_hypotheses(args.generate_output, args.field, args.spm_model)
        hyp_source = args.generate_output
    else:
        hyps = read_lines(args.hyp, "hypothesis")
        hyp_source = args.hyp
    if args.save_hyp:
        write_atomic(args.save_hyp, "".join(line + "\n" for line in hyps), "--save-hyp")
        print(f"wrote {len(hyps)} hypotheses to {args.save_hyp}", file=sys.stderr)
    if args.extract_only:
        if not args.save_hyp:
            raise ScoringError("--extract-only needs --save-hyp")
        return None
    if not args.ref:
        raise ScoringError("no reference given (--ref FILE)")
    refs_list = []
    for ref_path in args.ref:
        refs = read_lines(ref_path, "reference")
        check_same_length(hyps, hyp_source, refs, ref_path)
        refs_list.append(refs)
    lang = None
    if args.compound_split:
        lang = args.lang or os.path.splitext(args.ref[0])[1].lstrip(".")
        if not re.fullmatch(r"[a-z]{2,3}", lang or ""):
            raise ScoringError(f"cannot tell the target language from {args.ref[0]!r}; pass --lang")
    scores = score(hyps, refs_list, args.tokenize, args.lowercase, lang)
    scores["hypotheses"] = hyp_source
    scores["references"] = list(args.ref)
    print(summary(scores))
    if args.json:
        write_atomic(args.json, json.dumps(scores, indent=2, ensure_ascii=False) + "\n", "--json")
    return scores


def main(argv=None):
    return run_console_script("rfa-score", build_parser(), run, ScoringError, argv)


if __name__ == "__main__":
    sys.exit(main())
