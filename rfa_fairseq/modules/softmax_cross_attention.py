"""fairseq's softmax encoder-decoder attention with its part of RFA's decoding step (the default
--rfa-softmax-cross-attn). Same parameters as fairseq's MultiheadAttention: its checkpoints load unchanged.

The source's K and V are fixed while the output grows, so the step keeps them once per source sentence,
(sentences, H, S, d), shared by the sentence's beams (ops' softmax_cross_step reads sentence r // beam for
row r), and returns the head-averaged weights that fairseq reports as the alignment on request.
"""
from typing import Optional, Tuple

from fairseq.modules import MultiheadAttention
from torch import Tensor

from .decoding import SentenceCache


class SoftmaxCrossCache(SentenceCache):
    """Softmax cross-attention's cache: each source sentence's K and V (sentences, H, S, d), the padding as an
    additive (sentences, S) bias (or None), the query and output projections packed for the kernels."""

    SENTENCE_TENSORS = ("key", "value", "key_bias")

    def __init__(self, key: Tensor, value: Tensor, key_bias: Optional[Tensor], q_proj, out_proj):
        self.key, self.value, self.key_bias, self.q_proj, self.out_proj = key, value, key_bias, q_proj, out_proj


class SoftmaxCrossAttention(MultiheadAttention):
    def start_step(self, decoder, name: str, key: Tensor, key_padding_mask: Optional[Tensor],
                   source_len: Optional[int] = None) -> SoftmaxCrossCache:
        """A batch's start: K, V of key (S, sentences, C) in the IncrementalDecoder `decoder`'s workspace (under
        `name`), the padding as a bias, the projections packed. source_len (>= S): K and V padded to that length
        with zeros that the bias masks, and the bias always present, so that batches of other source lengths up
        to it run on the same buffers and shapes (CUDA graphs)."""
        if self.bias_k is not None or self.add_zero_attn:
            raise ValueError("RFA incremental decoding does not support cross-attention with bias_kv / zero attention")
        S, n, _ = key.shape
        H, d = self.num_heads, self.head_dim
        length = S if source_len is None else source_len
        if length < S:
            raise ValueError(f"source_len {source_len} is shorter than the source ({S} positions)")
        kv_weights = decoder.packed_linear(f"{name}.kv_proj", self.k_proj, self.v_proj)
        kv = decoder.kernels.linear(key.reshape(S * n, -1), kv_weights, key.new_empty(S * n, 2 * self.embed_dim))
        kv = kv.view(S, n, 2, H, d).permute(2, 1, 3, 0, 4)  # (2, n, H, S, d)
        kept = []
        for i, role in enumerate(("key", "value")):
            buffer = decoder.buffer(f"{name}.{role}", n, H, length, d)  # the workspace's: the same address every batch
            buffer[:, :, :S].copy_(kv[i])
            buffer[:, :, S:].zero_()
            kept.append(buffer)
        bias = None
        if source_len is not None or (key_padding_mask is not None and bool(key_padding_mask.any())):
            bias = decoder.buffer(f"{name}.key_bias", n, length).zero_()
            if key_padding_mask is not None:
                bias[:, :S].masked_fill_(key_padding_mask, float("-inf"))
            bias[:, S:] = float("-inf")
        return SoftmaxCrossCache(*kept, bias, decoder.packed_linear(f"{name}.q_proj", self.q_proj),
                                 decoder.packed_linear(f"{name}.out_proj", self.out_proj))

    def step(self, h: Tensor, cache: SoftmaxCrossCache, decoder, key_pad: Optional[Tensor] = None,
             need_weights: bool = False, residual: Optional[Tensor] = None) -> Tuple[Tensor, Optional[Tensor]]:
        """(R, C) normalized inputs -> the (R, C) output projection (plus `residual`) and the (R, S) head-averaged
        weights (need_weights) or None."""
        R, C = h.shape
        kernels = decoder.kernels
        q = kernels.linear(h, cache.q_proj, decoder.buffer("q", R, C))
        attn = decoder.buffer("attn", R, C)
        weights = decoder.buffer("cross_weights", R, cache.key.size(2)) if need_weights else None
        kernels.softmax_cross_step(q, cache.key, cache.value, cache.key_bias, decoder.beam, self.scaling, attn, weights)
        return kernels.linear(attn, cache.out_proj, decoder.buffer("y", R, C), residual=residual), weights
