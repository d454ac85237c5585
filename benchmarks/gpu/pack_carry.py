#!/usr/bin/env python3
"""What a GPU machine needs to decode the real test set, small enough to travel with the checkout (.gpu/):

    .gpu/quality/<variant>_u<updates>_s<seed>/checkpoint_best.pt   decode-only copies of the quality study's
        checkpoints: weights in fp16 (what `fairseq-generate --fp16` decodes with), the tied embeddings stored
        once, no optimizer state (14.5 MB instead of 87 MB for the Multi30k models)
    .gpu/multi30k/{data-bin/, {test,valid}.raw.de, spm.model}   the binarized splits (2.9 MB), the references
        and the SentencePiece model

so that `benchmarks/benchmark_generate.py --prep .gpu/multi30k --study-dir .gpu/quality --device cuda --fp16`
and `scripts/quality_study.py --prep .gpu/multi30k` (benchmarks/gpu/train_precision.sh) run there as they
run here. Nothing is rewritten that exists (delete .gpu/ to pack again).

    python benchmarks/gpu/pack_carry.py --prep outputs/multi30k --study-dir outputs/quality --max-update 4000 --seed 1
    python benchmarks/gpu/pack_carry.py --prep outputs/multi30k_en_fr --pair en-fr     # the data alone

`decode_only_copy` also brings a GPU machine's trained checkpoints back (benchmarks/gpu/run_all.sh).
"""
import argparse
import os
import shutil
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

from benchmark_generate import MODELS  # noqa: E402
from rfa_fairseq.checkpoints import safe_load  # noqa: E402

VARIANTS = [MODELS["softmax"][0], MODELS["rfa"][0]]  # the study variants benchmark_generate decodes as softmax and rfa
TIED = ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight", "decoder.output_projection.weight")


def decode_only_copy(src: str, dst: str) -> None:
    state = safe_load(src)
    state.pop("last_optimizer_state", None)
    model = state["model"]
    for name, tensor in model.items():
        if tensor.is_floating_point():
            model[name] = tensor.half()
    shared = [name for name in TIED if name in model]
    if shared and all(torch.equal(model[name], model[shared[0]]) for name in shared):
        for name in shared[1:]:
            model[name] = model[shared[0]]  # one storage in the file
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    torch.save(state, dst + ".tmp")
    os.replace(dst + ".tmp", dst)
    print(f"{dst}: {os.path.getsize(dst) / 2**20:.1f} MB (from {os.path.getsize(src) / 2**20:.1f} MB)")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prep", default=os.path.join(REPO, "outputs", "multi30k"))
    p.add_argument("--pair", choices=["en-de", "en-fr"], default="en-de",
                   help="the --prep directory's pair: its data goes to OUT/multi30k (en-de) or OUT/multi30k_en_fr")
    p.add_argument("--study-dir", help="the quality study's checkpoints to carry (default: the data only)")
    p.add_argument("--max-update", type=int, default=1000)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", default=os.path.join(REPO, ".gpu"))
    args = p.parse_args()
    for variant in VARIANTS if args.study_dir else ():
        run = f"{variant}_u{args.max_update}_s{args.seed}"
        src = os.path.join(args.study_dir, run, "checkpoint_best.pt")
        dst = os.path.join(args.out, "quality", run, "checkpoint_best.pt")
        if not os.path.exists(src):
            sys.exit(f"pack_carry: {src} is missing (scripts/quality_study.py trains it)")
        if not os.path.exists(dst):
            decode_only_copy(src, dst)
    bin_dir = os.path.join(args.prep, "data-bin")
    names = sorted(os.listdir(bin_dir))
    for split in ("train", "valid", "test"):
        if not any(n.startswith(split + ".") for n in names):
            sys.exit(f"pack_carry: {bin_dir} has no {split} split (data-prep/prepare-multi30k.sh writes it)")
    data = os.path.join(args.out, "multi30k" if args.pair == "en-de" else "multi30k_en_fr")
    os.makedirs(os.path.join(data, "data-bin"), exist_ok=True)
    for name in names:
        shutil.copyfile(os.path.join(bin_dir, name), os.path.join(data, "data-bin", name))
    target = args.pair.split("-")[1]
    beside = [f"test.raw.{target}", f"valid.raw.{target}", "spm.model"]
    for name in beside:
        shutil.copyfile(os.path.join(args.prep, name), os.path.join(data, name))
    print(f"{data}: data-bin/ ({len(names)} files), {', '.join(beside)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
