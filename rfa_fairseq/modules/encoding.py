"""The encoder's inference as one native call: the runtime built once per weights.

fairseq-generate, fairseq-interactive and the hub encode each batch once, through TransformerEncoderBase's forward:
the embedding, its positions, the padding, and per layer some 25 torch operations (SoftmaxEncoderLayer's inference,
models/rfa_transformer.py). At one sentence a batch the Python between those operations is most of the encoder's
time, taken under the GIL. Where the decoding step is native (the CPU in fp32 weights, ops.step_kernels), the
encoder's pass is too: `EncodingRuntime` holds the encoder's records (one `EncoderLayerRecord` per layer: its linear
layers packed as SoftmaxEncoderLayer packs them, its norms) and the native EncoderProgram built from them
(ops/csrc/encoder_program.cpp), which runs the same operations in the same order, the same linear layers included:
the same output to the bit, without Python or the GIL. RFATransformerEncoder builds it once per (weights, kernels)
and falls back to fairseq's forward for what the program does not run (its `_native_unsupported`).
"""
from dataclasses import dataclass
from typing import List, Optional

from torch import Tensor
from fairseq.modules import SinusoidalPositionalEmbedding

from .decoding import NormRecord


@dataclass
class EncoderLayerRecord:
    """A softmax encoder layer as the native pass reads it (ops/csrc/encoder_program.cpp's EncoderLayerProgram):
    [q | k | v], the output projection and the FFN packed for the kernels, its two norms, post-norm or pre-norm."""

    qkv: object
    out_proj: object
    self_attn_norm: NormRecord
    fc1: object
    fc2: object
    activation: str  # "relu" or "gelu"
    final_norm: NormRecord
    normalize_before: bool
    heads: int
    head_dim: int


class EncodingRuntime:
    """What every batch's native encoder pass reads, built once per (weights, kernels): the embedding, the layers'
    records, the final norm, and the native program built from them."""

    def __init__(self, encoder, kernels):
        self.embed = encoder.embed_tokens.weight.detach()
        self.embed_scale = float(encoder.embed_scale)
        self.padding_idx = encoder.padding_idx
        positions = encoder.embed_positions
        self.positions_padding_idx = positions.padding_idx if positions is not None else encoder.padding_idx
        self.embed_norm = NormRecord.of(encoder.layernorm_embedding)
        self.layers: List[EncoderLayerRecord] = [layer.encoding_record(kernels) for layer in encoder.layers]
        self.final_norm = NormRecord.of(encoder.layer_norm)
        self.program = kernels.ext.EncoderProgram(self, kernels.library)

    def encode(self, encoder, src_tokens: Tensor) -> dict:
        """fairseq's encoder output for src_tokens (B, T), as TransformerEncoderBase.forward_scriptable returns it
        (no intermediate states)."""
        x, padding_mask, embedding, src_lengths = self.program.encode(src_tokens, position_table(encoder,
                                                                                                  src_tokens.size(1)))
        return {"encoder_out": [x], "encoder_padding_mask": [padding_mask], "encoder_embedding": [embedding],
                "encoder_states": [], "fc_results": [], "src_tokens": [], "src_lengths": [src_lengths]}


def position_table(encoder, length: int) -> Optional[Tensor]:
    """The encoder's position embeddings as a table whose rows make_positions indexes, long enough for a source of
    `length` tokens (grown as SinusoidalPositionalEmbedding.forward grows it), or None without positions."""
    positions = encoder.embed_positions
    if positions is None:
        return None
    if isinstance(positions, SinusoidalPositionalEmbedding):
        needed = positions.padding_idx + 1 + length
        if needed > positions.weights.size(0):
            table = SinusoidalPositionalEmbedding.get_embedding(needed, positions.embedding_dim,
                                                                positions.padding_idx).to(positions.weights)
            if positions.auto_expand:
                positions.weights = table
            return table
        return positions.weights
    return positions.weight.detach()
