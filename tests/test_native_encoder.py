"""The encoder's inference as one native call (modules/encoding.py, ops/csrc/encoder_program.cpp): the same output as
the layers' own inference, to the bit, and fairseq's forward wherever the native pass does not run."""
import pytest
import torch
from fairseq.models.transformer import TransformerEncoderBase
from helpers import build_model, cpp_extension, random_batch

from rfa_fairseq.modules.encoding import EncodingRuntime

VARIANTS = {
    "default": [],
    "pre_norm": ["--encoder-normalize-before"],
    "learned_positions_embedding_norm_gelu": ["--encoder-learned-pos", "--layernorm-embedding", "--no-scale-embedding",
                                              "--activation-fn", "gelu"],
    "no_positions": ["--no-token-positional-embeddings"],
}


def _encoder_outputs_equal(got: dict, want: dict) -> None:
    for name in ("encoder_out", "encoder_padding_mask", "encoder_embedding", "src_lengths"):
        assert len(got[name]) == len(want[name]) == 1, name
        assert got[name][0].dtype == want[name][0].dtype and got[name][0].shape == want[name][0].shape, name
        assert torch.equal(got[name][0], want[name][0]), f"{name} differs"
    assert got["encoder_states"] == [] and got["src_tokens"] == []


@pytest.mark.parametrize("precision", ["fp32", "int8"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_native_encoder_pass_equals_the_layers_inference_to_the_bit(variant, precision, monkeypatch):
    """fairseq's forward over the layers' inference (SoftmaxEncoderLayer._infer on the same kernels) and the native
    pass give the same encoder output, padding, embedding and lengths, on left-padded sources and on one sentence."""
    cpp_extension()
    model, d = build_model(VARIANTS[variant] + ["--rfa-decode-precision", precision])
    model.eval()
    encoder = model.encoder
    passes = []
    original = EncodingRuntime.encode
    monkeypatch.setattr(EncodingRuntime, "encode", lambda self, *args: passes.append(1) or original(self, *args))
    for bsz, src_len in ((4, 11), (1, 6)):
        src, src_lengths, _ = random_batch(d, bsz=bsz, src_len=src_len, seed=bsz)
        with torch.no_grad():
            native = encoder(src, src_lengths=src_lengths)
            layers = TransformerEncoderBase.forward_scriptable(encoder, src, src_lengths)
        _encoder_outputs_equal(native, layers)
    assert len(passes) == 2, "the native pass did not run"
    with torch.no_grad():  # and fairseq's own forward (autograd on: its layers' training path) within rounding
        src, src_lengths, _ = random_batch(d, bsz=4, src_len=11, seed=4)
        native = encoder(src, src_lengths=src_lengths)["encoder_out"][0]
    reference = encoder(src, src_lengths=src_lengths)["encoder_out"][0].detach()
    tolerance = 1e-5 if precision == "fp32" else 0.1
    torch.testing.assert_close(native, reference, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("flags,why", [
    (["--rfa-decode-kernel", "torch"], "torch kernels"),
    (["--rfa-encoder-self-attn"], "RFA encoder layers"),
    (["--activation-fn", "tanh"], "an activation the native pass lacks"),
])
def test_the_encoder_runs_fairseqs_forward_where_the_native_pass_does_not(flags, why):
    cpp_extension()
    model, d = build_model(flags)
    model.eval()
    assert model.encoder.encoding_runtime() is None, why
    src, src_lengths, _ = random_batch(d, bsz=3, src_len=7)
    with torch.no_grad():
        out = model.encoder(src, src_lengths=src_lengths)
    reference = model.encoder(src, src_lengths=src_lengths)
    torch.testing.assert_close(out["encoder_out"][0], reference["encoder_out"][0].detach(), rtol=1e-5, atol=1e-5)


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
        torch.testing.assert_close(other["encoder_out"][0], native["encoder_out"][0], rtol=1e-6, atol=1e-6)
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
        layers = TransformerEncoderBase.forward_scriptable(model.encoder, src, src_lengths)
    assert positions.weights.size(0) >= positions.padding_idx + 1 + 12
    _encoder_outputs_equal(native, layers)
