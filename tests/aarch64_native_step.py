#!/usr/bin/env python3
"""One decoding step of a tiny model through the native runtime, compared across machines (issue 73): the default
model at the recipe's options with an fp32 state, decoded incrementally for STEPS steps of a batch on the CPU's best
level. scripts/test_aarch64_native_step.sh runs it twice:

    python tests/aarch64_native_step.py --write REF.pt      # x86-64: the weights, the log-probabilities, the level
    python tests/aarch64_native_step.py --compare REF.pt    # aarch64 (under qemu-user): the same weights, compared

--compare exits 1 when the log-probabilities differ beyond the order of sums' tolerance or a step's best token
differs, and 2 when the native runtime did not run the step."""
import argparse
import os
import platform
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from helpers import build_model, decode_incrementally, random_batch  # noqa: E402

from rfa_fairseq.modules.decoding import DecodingState  # noqa: E402

FLAGS = ["--rfa-decode-state", "fp32"]  # fp32 state: the two machines' steps differ only in their sums' order
STEPS = 3
# fp32 throughout: the levels sum in other orders (vector widths), a few ulps of the terms apart
TOLERANCE = dict(rtol=1e-4, atol=1e-4)


@torch.no_grad()
def native_step(state_dict=None):
    """-> (the model's weights, the decoder's log-probabilities over STEPS steps of a batch, the runtime's level)."""
    model, dictionary = build_model(FLAGS, seed=3)
    if state_dict is not None:
        model.load_state_dict(state_dict)
    model.eval()
    src, src_lengths, prev = random_batch(dictionary, bsz=2, src_len=7, tgt_len=STEPS, seed=5)
    state = {}
    logits = decode_incrementally(model, model.encoder(src, src_lengths=src_lengths), prev, state)
    kernels = state[DecodingState.KEY].kernels
    if not kernels.native:
        print(f"aarch64_native_step: the decoding step ran the {kernels.name} kernels, not the native runtime",
              file=sys.stderr)
        sys.exit(2)
    return model.state_dict(), torch.log_softmax(logits, dim=-1), kernels.level


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", metavar="PATH", help="decode with fresh weights; write them and the results to PATH")
    mode.add_argument("--compare", metavar="PATH",
                      help="decode with PATH's weights; compare with PATH's results (exit 1 where they differ)")
    args = parser.parse_args(argv)
    here = platform.machine()
    if args.write:
        state_dict, log_probs, level = native_step()
        torch.save({"state_dict": state_dict, "log_probs": log_probs, "level": level, "machine": here}, args.write)
        print(f"aarch64_native_step: {here} {level}: {tuple(log_probs.shape)} log-probabilities written to "
              f"{args.write}")
        return 0
    reference = torch.load(args.compare, weights_only=True)
    _, got, level = native_step(reference["state_dict"])
    want = reference["log_probs"]
    gap = (got - want).abs().max().item()
    same_best = torch.equal(got.argmax(-1), want.argmax(-1))
    print(f"aarch64_native_step: {here} {level} vs {reference['machine']} {reference['level']}: "
          f"{got.shape[1]} steps of {got.shape[0]} rows, max |log p difference| = {gap:.2e}, "
          f"best tokens {'identical' if same_best else 'DIFFER'}")
    try:
        torch.testing.assert_close(got, want, **TOLERANCE)
    except AssertionError as error:
        print(f"aarch64_native_step: the log-probabilities differ: {error}", file=sys.stderr)
        return 1
    return 0 if same_best else 1


if __name__ == "__main__":
    sys.exit(main())
