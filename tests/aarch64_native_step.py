"""One decoding step of a tiny model through the native runtime, compared across machines: `native_step` decodes it
(the default model at the recipe's options, the native step on the CPU's best level); `test_the_native_step_equals_the
_reference_machines` (run on aarch64 under emulation by tests/test_aarch64_emulated.py, which passes this file to
pytest by name) loads the weights and the results of an x86-64 run (RFA_NATIVE_STEP_REFERENCE) and compares."""
import os
import platform

import pytest
import torch
from helpers import build_model, random_batch
from test_model import _decode_incrementally

from rfa_fairseq.modules.decoding import DecodingState

REFERENCE_ENV = "RFA_NATIVE_STEP_REFERENCE"
FLAGS = ["--rfa-decode-state", "fp32"]  # fp32 state: the two machines' steps differ only in their sums' order
STEPS = 3


@torch.no_grad()
def native_step(state_dict=None):
    """-> (the model's weights, the decoder's log-probabilities over STEPS steps of a batch, the runtime's level)."""
    model, dictionary = build_model(FLAGS, seed=3)
    if state_dict is not None:
        model.load_state_dict(state_dict)
    model.eval()
    src, src_lengths, prev = random_batch(dictionary, bsz=2, src_len=7, tgt_len=STEPS, seed=5)
    state = {}
    logits = _decode_incrementally(model, model.encoder(src, src_lengths=src_lengths), prev, state)
    kernels = state[DecodingState.KEY].kernels
    assert kernels.native, f"the decoding step ran the {kernels.name} kernels, not the native runtime"
    return model.state_dict(), torch.log_softmax(logits, dim=-1), kernels.level


def test_the_native_step_equals_the_reference_machines():
    path = os.environ.get(REFERENCE_ENV)
    if not path:
        pytest.skip(f"{REFERENCE_ENV} names no other machine's results (tests/test_aarch64_emulated.py sets it)")
    reference = torch.load(path, weights_only=True)
    _, got, level = native_step(reference["state_dict"])
    print(f"{platform.machine()} {level}: max |log p - {reference['machine']} {reference['level']}'s| = "
          f"{(got - reference['log_probs']).abs().max().item():.2e}")
    # fp32 throughout: the levels sum in other orders (vector widths), a few ulps of the terms apart
    torch.testing.assert_close(got, reference["log_probs"], rtol=1e-4, atol=1e-4)
    assert torch.equal(got.argmax(-1), reference["log_probs"].argmax(-1))
