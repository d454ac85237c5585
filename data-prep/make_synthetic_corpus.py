#!/usr/bin/env python3
"""Write a small synthetic parallel corpus (the embedded default of the demo and the tests).

A toy "language pair" that a tiny model learns in minutes on a CPU but that still
needs attention: every source word has a fixed translation, adjectives follow
their noun on the target side (local reordering), and the target ends with a
count word for the number of nouns (long-range dependency). Deterministic for a
given --seed.

Writes {train,valid,test}.{src,tgt} into OUT_DIR (atomically: each file is written
under a temporary name and renamed).
"""
import argparse
import os
import random
import sys

NOUNS = "cat dog bird fish horse cow sheep goat mouse frog lion bear".split()
ADJECTIVES = "red big small old young fast slow happy sad green".split()
VERBS = "sees likes eats finds follows chases hears helps".split()
FUNCTION = "the a and with near".split()
COUNT_WORDS = ["zero", "one", "two", "three", "four", "five", "six"]


def _target_word(word: str) -> str:
    # an invertible, regular "translation": reversed spelling plus a class suffix
    suffix = {"n": "o", "a": "i", "v": "u", "f": "e"}
    cls = "n" if word in NOUNS else "a" if word in ADJECTIVES else "v" if word in VERBS else "f"
    return word[::-1] + suffix[cls]


def make_pair(rng: random.Random):
    src, tgt = [], []
    num_nouns = 0
    for _ in range(rng.randint(1, 3)):
        phrase = [rng.choice(FUNCTION[:2])]
        adjectives = [rng.choice(ADJECTIVES) for _ in range(rng.randint(0, 2))]
        noun = rng.choice(NOUNS)
        num_nouns += 1
        src_phrase = phrase + adjectives + [noun]
        tgt_phrase = phrase + [noun] + adjectives  # adjectives after the noun
        if rng.random() < 0.6:
            verb = rng.choice(VERBS)
            src_phrase.append(verb)
            tgt_phrase.append(verb)
        src += src_phrase
        tgt += tgt_phrase
    tgt = [_target_word(w) for w in tgt] + [COUNT_WORDS[num_nouns]]
    return " ".join(src), " ".join(tgt)


def write_atomic(path: str, lines) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        for line in lines:
            f.write(line + "\n")
    os.replace(tmp, path)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir")
    parser.add_argument("--train", type=int, default=20000, help="training pairs (default: 20000)")
    parser.add_argument("--valid", type=int, default=300, help="validation pairs (default: 300)")
    parser.add_argument("--test", type=int, default=300, help="test pairs (default: 300)")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    for name in ("train", "valid", "test"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name} must be positive, got {getattr(args, name)}")
    os.makedirs(args.out_dir, exist_ok=True)
    rng = random.Random(args.seed)
    for split in ("train", "valid", "test"):
        pairs = [make_pair(rng) for _ in range(getattr(args, split))]
        write_atomic(os.path.join(args.out_dir, f"{split}.src"), (s for s, _ in pairs))
        write_atomic(os.path.join(args.out_dir, f"{split}.tgt"), (t for _, t in pairs))
    print(f"wrote synthetic corpus to {args.out_dir} ({args.train}/{args.valid}/{args.test} pairs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
