"""The encoder's inference as one native call (modules/encoding.py, cpu/csrc/encoder_program.cpp): fairseq's forward,
repeated in C++ (its output within the linear layers' rounding), and fairseq's forward itself wherever the native pass
does not run, also where a fairseq function it repeats is not the source it was checked against
(fairseq_mirrors.NATIVE_ENCODER_MIRRORS)."""
import warnings

import pytest
import torch
from fairseq import utils as fairseq_utils
from fairseq.models.transformer import TransformerEncoderBase
from helpers import build_model, cpp_extension, random_batch

from rfa_fairseq import fairseq_mirrors, fairseq_sources
from rfa_fairseq.fairseq_mirrors import NativeEncoderDisabled
from rfa_fairseq.modules.encoding import EncodingRuntime

VARIANTS = {
    "default": [],
    "pre_norm": ["--encoder-normalize-before"],
    "learned_positions_embedding_norm_gelu": ["--encoder-learned-pos", "--layernorm-embedding", "--no-scale-embedding",
                                              "--activation-fn", "gelu"],
    "no_positions": ["--no-token-positional-embeddings"],
}
# the native pass's linear layers are the decoding step's (the CPU kernels: another summation order than torch's, the residual
# added inside; int8: quantized activations and weights), fairseq's are torch's: the layers' outputs differ by that
LINEAR_ROUNDING = {"fp32": 1e-5, "int8": 0.1}


def fairseqs_forward(encoder, src, src_lengths) -> dict:
    """fairseq's own encoder forward (TransformerEncoderBase's, over fairseq's layers), without autograd."""
    with torch.no_grad():
        return TransformerEncoderBase.forward_scriptable(encoder, src, src_lengths)


def _equals_fairseqs(got: dict, want: dict, tolerance: float) -> None:
    """The native pass's output against fairseq's: the same fields; the padding mask, the embedding and the lengths,
    which it computes with fairseq's torch operations, to the bit; the encoder output within the linear layers'
    rounding."""
    assert set(got) == set(want)
    for name in ("encoder_out", "encoder_padding_mask", "encoder_embedding", "src_lengths"):
        assert len(got[name]) == len(want[name]) == 1, name
        assert got[name][0].dtype == want[name][0].dtype and got[name][0].shape == want[name][0].shape, name
    for name in ("encoder_padding_mask", "encoder_embedding", "src_lengths"):
        assert torch.equal(got[name][0], want[name][0]), f"{name} differs"
    torch.testing.assert_close(got["encoder_out"][0], want["encoder_out"][0], rtol=tolerance, atol=tolerance)
    assert got["encoder_states"] == want["encoder_states"] == [] and got["src_tokens"] == [] and got["fc_results"] == []


@pytest.mark.parametrize("precision", ["fp32", "int8"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_native_encoder_pass_equals_fairseqs_forward(variant, precision, monkeypatch):
    """With the installed fairseq the native pass runs, without a warning, and gives fairseq's encoder output,
    padding, embedding and lengths, on left-padded sources and on one sentence."""
    cpp_extension()
    model, d = build_model(VARIANTS[variant] + ["--rfa-decode-precision", precision])
    model.eval()
    encoder = model.encoder
    passes = []
    original = EncodingRuntime.encode
    monkeypatch.setattr(EncodingRuntime, "encode", lambda self, *args: passes.append(1) or original(self, *args))
    with warnings.catch_warnings():
        warnings.simplefilter("error", NativeEncoderDisabled)
        for bsz, src_len in ((4, 11), (1, 6)):
            src, src_lengths, _ = random_batch(d, bsz=bsz, src_len=src_len, seed=bsz)
            with torch.no_grad():
                native = encoder(src, src_lengths=src_lengths)
            _equals_fairseqs(native, fairseqs_forward(encoder, src, src_lengths), LINEAR_ROUNDING[precision])
    assert len(passes) == 2, "the native pass did not run"


@pytest.mark.parametrize("flags,why", [
    (["--rfa-decode-kernel", "torch"], "torch kernels"),
    (["--rfa-encoder-self-attn"], "RFA encoder layers"),
    (["--activation-fn", "tanh"], "an activation the native pass lacks"),
])
def test_the_encoder_runs_fairseqs_forward_where_the_native_pass_does_not(flags, why):
    """Inference there is fairseq's forward to the bit (the forward training runs, taken here with autograd on)."""
    cpp_extension()
    model, d = build_model(flags)
    model.eval()
    assert model.encoder.encoding_runtime() is None, why
    src, src_lengths, _ = random_batch(d, bsz=3, src_len=7)
    with torch.no_grad():
        out = model.encoder(src, src_lengths=src_lengths)
    reference = model.encoder(src, src_lengths=src_lengths)
    assert torch.equal(out["encoder_out"][0], reference["encoder_out"][0].detach())


def test_a_fairseq_whose_repeated_function_differs_runs_its_own_forward_with_one_warning(monkeypatch):
    """fairseq.utils.make_positions replaced by a function of another source (fairseq's result, so that the
    forward's output can be compared): the native pass does not run, one NativeEncoderDisabled warning names the
    function, both fingerprints and where it comes from, however often the runtime is built again, and the output is
    fairseq's forward's, which called the replacement."""
    cpp_extension()
    monkeypatch.setattr(fairseq_mirrors, "_WARNED_MIRROR_DIFFERENCES", set())
    fairseqs, calls = fairseq_utils.make_positions, []

    def make_positions(tensor, padding_idx: int, onnx_trace: bool = False):
        calls.append(tensor.shape)
        return fairseqs(tensor, padding_idx, onnx_trace=onnx_trace)

    monkeypatch.setattr(fairseq_utils, "make_positions", make_positions)
    model, d = build_model()
    model.eval()
    encoder = model.encoder
    src, src_lengths, _ = random_batch(d, bsz=4, src_len=11, seed=4)
    outputs = []
    with pytest.warns(NativeEncoderDisabled) as caught:
        for _ in range(2):
            encoder.train().eval()  # the runtime is built again, and the fairseq functions checked again
            with torch.no_grad():
                outputs.append(encoder(src, src_lengths=src_lengths)["encoder_out"][0])
            assert encoder.encoding_runtime() is None
    disabled = [w for w in caught if w.category is NativeEncoderDisabled]
    assert len(disabled) == 1
    message = str(disabled[0].message)
    assert "fairseq.utils.make_positions" in message and "TransformerEncoderBase" not in message
    assert f"source fingerprint {fairseq_sources.source_fingerprint(make_positions)}" in message
    assert "c2f12c3fcb209d57" in message and f"{__file__}:{make_positions.__code__.co_firstlineno}" in message
    assert len(calls) == 2, "fairseq's forward computes the positions with make_positions; the native pass does not"
    reference = encoder(src, src_lengths=src_lengths)["encoder_out"][0].detach()  # autograd on: fairseq's forward
    assert torch.equal(outputs[0], reference) and torch.equal(outputs[1], reference)


def test_what_the_native_pass_does_not_return_comes_from_fairseqs_forward():
    """return_all_hiddens (each layer's output) and precomputed token embeddings take fairseq's forward, which gives
    the same final output; so does a call with autograd on."""
    cpp_extension()
    model, d = build_model()
    model.eval()
    encoder = model.encoder
    src, src_lengths, _ = random_batch(d, bsz=3, src_len=7)
    with torch.no_grad():
        native = encoder(src, src_lengths=src_lengths)
        hiddens = encoder(src, src_lengths=src_lengths, return_all_hiddens=True)
        embedded = encoder(src, src_lengths=src_lengths, token_embeddings=encoder.embed_tokens(src))
    assert len(hiddens["encoder_states"]) == len(encoder.layers) + 1
    for other in (hiddens, embedded):
        torch.testing.assert_close(other["encoder_out"][0], native["encoder_out"][0], rtol=1e-5, atol=1e-5)
    assert encoder(src, src_lengths=src_lengths)["encoder_out"][0].requires_grad  # fairseq's forward, with autograd


def test_a_source_longer_than_the_learned_positions_is_an_error_naming_the_limit():
    cpp_extension()
    model, d = build_model(["--encoder-learned-pos", "--max-source-positions", "8"])
    model.eval()
    src, src_lengths, _ = random_batch(d, bsz=2, src_len=12)
    with torch.no_grad(), pytest.raises(RuntimeError, match="max-source-positions"):
        model.encoder(src, src_lengths=src_lengths)


def test_the_sinusoidal_table_grows_for_a_longer_source_as_fairseqs_does():
    cpp_extension()
    model, d = build_model()
    model.eval()
    positions = model.encoder.embed_positions
    positions.weights = positions.weights[:6].clone()  # a table shorter than the source needs
    src, src_lengths, _ = random_batch(d, bsz=2, src_len=12)
    with torch.no_grad():
        native = model.encoder(src, src_lengths=src_lengths)
    assert positions.weights.size(0) >= positions.padding_idx + 1 + 12
    _equals_fairseqs(native, fairseqs_forward(model.encoder, src, src_lengths), LINEAR_ROUNDING["fp32"])
