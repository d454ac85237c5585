"""The encoder's inference as one native call: the runtime built once per weights.

fairseq-generate, fairseq-interactive and the hub encode each batch once, through TransformerEncoderBase's forward:
the embedding, its positions, the padding, and per layer some 25 torch operations (fairseq's TransformerEncoderLayerBase
and MultiheadAttention). At one sentence a batch the Python between those operations is most of the encoder's time,
taken under the GIL. Where the decoding step is native (the CPU in fp32, kernel_choice.step_kernels), the encoder's
pass is too: `EncodingRuntime` holds the encoder's records (one `EncoderLayerRecord` per layer: its linear layers
packed for the decoding step's kernels, [q | k | v] as one product, its norms) and the native EncoderProgram built
from them (cpu/csrc/encoder_program.cpp), which repeats fairseq's forward in C++: the same operations in the same
order, the linear layers on the kernels' library (so fairseq's output but for the linear layers' rounding: their
fp32 summation order, or int8's quantization with --rfa-decode-precision int8), without Python or the GIL. The
fairseq functions it repeats are fairseq_mirrors.NATIVE_ENCODER_MIRRORS, each fingerprinted: RFATransformerEncoder
builds the runtime once per (weights, kernels) where they are the sources checked and the model is one the program
runs (its `_native_unsupported`), and runs fairseq's forward otherwise.
"""
from dataclasses import dataclass
from typing import List, Optional

import torch
from torch import Tensor
from fairseq.modules import SinusoidalPositionalEmbedding

from .decoding import FFN_ACTIVATIONS, NormRecord


@dataclass
class EncoderLayerRecord:
    """A softmax encoder layer as the native pass reads it (cpu/csrc/encoder_program.cpp's EncoderLayerProgram):
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

    @classmethod
    def of(cls, layer, kernels) -> "EncoderLayerRecord":
        """fairseq's TransformerEncoderLayerBase `layer` (plain self-attention, relu or gelu FFN), its linear layers
        packed for the kernels."""
        attn = layer.self_attn
        with torch.no_grad():
            return cls(_packed(kernels, attn.q_proj, attn.k_proj, attn.v_proj), _packed(kernels, attn.out_proj),
                       NormRecord.of(layer.self_attn_layer_norm), _packed(kernels, layer.fc1),
                       _packed(kernels, layer.fc2), FFN_ACTIVATIONS[layer.activation_fn],
                       NormRecord.of(layer.final_layer_norm), layer.normalize_before, attn.num_heads, attn.head_dim)


def _packed(kernels, *linears: torch.nn.Linear):
    """nn.Linear layers that read the same input as one product packed for the kernels, outputs side by side."""
    biases = [m.bias for m in linears]
    if any(b is None for b in biases) != all(b is None for b in biases):
        raise ValueError("linear layers packed as one need all or none of their biases")
    if len(linears) == 1:
        return kernels.pack_linear(linears[0].weight.detach(), None if biases[0] is None else biases[0].detach())
    bias = None if biases[0] is None else torch.cat(biases).detach()
    return kernels.pack_linear(torch.cat([m.weight for m in linears]).detach(), bias,
                               sources=[m.weight for m in linears])


class EncodingRuntime:
    """What every batch's native encoder pass reads, built once per (weights, kernels): the embedding, the layers'
    records, the final norm, and the native program built from them."""

    def __init__(self, encoder, kernels):
        self.kernels = kernels
        self.embed = encoder.embed_tokens.weight.detach()
        self.embed_scale = float(encoder.embed_scale)
        self.padding_idx = encoder.padding_idx
        positions = encoder.embed_positions
        self.positions_padding_idx = positions.padding_idx if positions is not None else encoder.padding_idx
        self.embed_norm = NormRecord.of(encoder.layernorm_embedding)
        self.layers: List[EncoderLayerRecord] = [EncoderLayerRecord.of(layer, kernels) for layer in encoder.layers]
        self.final_norm = NormRecord.of(encoder.layer_norm)
        kernels.release_packed_sources()
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
