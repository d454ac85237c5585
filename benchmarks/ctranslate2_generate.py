#!/usr/bin/env python3
"""Translate SentencePiece-encoded source lines with a CTranslate2 model the way benchmark_generate.py runs
fairseq-generate (beam 4, length penalty 1, max length source + 50, one batch of --batch-size sentences at a
time, sorted by length), and print a summary line in fairseq-generate's format so both engines are read alike:

    Translated N sentences (T tokens) in S s (R sentences/s, ...)

The time is the translation call only (the model is loaded before the clock starts), as fairseq-generate's
own timer measures generation only. Hypotheses go to --output, detokenized as fairseq's
`--post-process sentencepiece` does, one line per source line, in order.

    python benchmarks/ctranslate2_generate.py --model ct2_dir --source test.spm.en --output hyps.txt \
        --threads 2 --batch-size 32
    python benchmarks/ctranslate2_generate.py ... --threads 1 --inter-threads 2   # two batches at once

--threads is CTranslate2's intra_threads (threads within one batch's translation), --inter-threads its
inter_threads (batches translated at once, each with --threads threads): on a 2-core AMD EPYC its int8 model
ran at 134 sentences/s with 1 x 1, 77 with intra 2 and 238 with inter 2 (batch 32), so the best of the two ways
to use N cores is CTranslate2's speed at N threads (benchmark_generate.py measures both).
"""
import argparse
import sys
import time

SPM_SPACE = "\u2581"


def detokenize(pieces) -> str:
    """fairseq's --post-process sentencepiece."""
    return "".join(pieces).replace(SPM_SPACE, " ").strip()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a CTranslate2 model directory (ct2-fairseq-converter --output_dir)")
    p.add_argument("--source", required=True, help="source sentences, SentencePiece pieces separated by spaces")
    p.add_argument("--output", required=True, help="where the detokenized hypotheses go")
    p.add_argument("--threads", type=int, default=1, help="intra_threads: threads within one batch's translation")
    p.add_argument("--inter-threads", type=int, default=1, help="inter_threads: batches translated at once")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--beam", type=int, default=4)
    p.add_argument("--lenpen", type=float, default=1.0)
    p.add_argument("--max-len-b", type=int, default=50, help="hypotheses end by source length (with </s>) + this")
    p.add_argument("--forced-length", type=int, default=0,
                   help="every hypothesis exactly this many tokens (min and max decoding length; 0: natural lengths)")
    p.add_argument("--sentences", type=int, default=0, help="translate the first N source lines only (0: all)")
    p.add_argument("--use-vmap", action="store_true",
                   help="translate with the model's vocabulary map (use_vmap=True: a model converted with "
                        "--vocab_mapping)")
    args = p.parse_args(argv)
    if args.sentences < 0:
        p.error(f"--sentences must be 0 (all) or positive, got {args.sentences}")

    import ctranslate2

    with open(args.source, encoding="utf-8") as f:
        sources = [line.split() for line in f.read().splitlines()]
    if args.sentences:
        sources = sources[:args.sentences]
    if args.threads < 1 or args.inter_threads < 1:
        p.error("--threads and --inter-threads must be positive")
    translator = ctranslate2.Translator(args.model, device="cpu", inter_threads=args.inter_threads,
                                        intra_threads=args.threads)
    # fairseq stops each sentence at its own source length + max-len-b; one bound per call here, so the
    # longest sentence's: it only matters for hypotheses that never end
    max_length = max(len(s) for s in sources) + 1 + args.max_len_b
    lengths = {"max_decoding_length": max_length}
    if args.forced_length > 0:  # fairseq-generate --min-len L --max-len-a 0 --max-len-b L
        lengths = {"min_decoding_length": args.forced_length, "max_decoding_length": args.forced_length}
    start = time.perf_counter()
    results = translator.translate_batch(
        sources, beam_size=args.beam, length_penalty=args.lenpen, max_batch_size=args.batch_size,
        batch_type="examples", return_scores=False, use_vmap=args.use_vmap, **lengths,
    )
    seconds = time.perf_counter() - start
    hypotheses = [r.hypotheses[0] for r in results]
    tokens = sum(len(h) + 1 for h in hypotheses)  # + </s>, as fairseq-generate counts
    with open(args.output, "w", encoding="utf-8") as out:
        out.writelines(detokenize(h) + "\n" for h in hypotheses)
    print(f"Translated {len(sources):,} sentences ({tokens:,} tokens) in {seconds:.1f}s "
          f"({len(sources) / seconds:.2f} sentences/s, {tokens / seconds:.2f} tokens/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
