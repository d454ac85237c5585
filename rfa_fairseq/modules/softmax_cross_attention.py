"""fairseq's softmax encoder-decoder attention with its part of RFA's decoding step (the default
--rfa-softmax-cross-attn). Same parameters as fairseq's MultiheadAttention: its checkpoints load unchanged.

The source's K and V are fixed while the output grows, so the step keeps them once per source sentence,
(sentences, H, S, d), shared by the sentence's beams (ops' softmax_cross_step reads sentence r // beam for
row r), and returns the head-averaged weights that fairseq reports as the alignment on request.
"""
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
from fairseq.modules import MultiheadAttention
from torch import Tensor

from .decoding import SentenceCache, reuse_or_allocate


class SoftmaxCrossCache(SentenceCache):
    """Softmax cross-attention's cache: each source sentence's K and V (sentences, H, S, d) and the padding as an
    additive (sentences, S) bias (or None), in buffers kept for the next batch."""

    SENTENCE_TENSORS = ("key", "value", "key_bias")

    def __init__(self):
        self.key: Optional[Tensor] = None
        self.value: Optional[Tensor] = None
        self.key_bias: Optional[Tensor] = None
        self._bias_buffer: Optional[Tensor] = None


@dataclass
class SoftmaxCrossRecord:
    """Softmax cross-attention's part of the decoding step: its query, key + value and output projections packed
    for the kernels, its shape and scaling."""

    q_proj: object
    kv_proj: object
    out_proj: object
    heads: int
    head_dim: int
    scaling: float
    kind = "softmax"  # for the native program
    has_weights = True  # fairseq's alignment: the head-averaged weights

    def start(self, previous: Optional[SoftmaxCrossCache], key: Tensor, key_padding_mask: Optional[Tensor],
              source_len: Optional[int], kernels, fill: bool = True) -> Tuple[SoftmaxCrossCache, bool]:
        """A batch's start: K, V of key (S, sentences, C) (the previous batch's buffers when large enough), the
        padding as a bias. source_len (>= S): K and V padded to that length with zeros that the bias masks, and the
        bias always present, so that batches of other source lengths up to it run on the same buffers and shapes
        (CUDA graphs). fill=False: the buffers only (the native program fills them: DecodeProgram.start_sources, the
        same product and layout). -> (the cache, whether a buffer is new)"""
        S, n, _ = key.shape
        H, d = self.heads, self.head_dim
        length = S if source_len is None else source_len
        if length < S:
            raise ValueError(f"source_len {source_len} is shorter than the source ({S} positions)")
        cache = previous if previous is not None else SoftmaxCrossCache()
        if not fill:
            if length != S:
                raise ValueError("the native program fills K and V of the source's own length (the CPU keeps no padded "
                                 f"positions), not {length} for {S}")
            cache.key, new_key = reuse_or_allocate(cache.key, (n, H, S, d), key.dtype, key.device)
            cache.value, new_value = reuse_or_allocate(cache.value, (n, H, S, d), key.dtype, key.device)
            cache.key_bias, new_bias = None, False
            if key_padding_mask is not None and bool(key_padding_mask.any()):
                cache.key_bias, new_bias = reuse_or_allocate(cache._bias_buffer, (n, S), key.dtype, key.device)
                cache._bias_buffer = cache.key_bias
            return cache, new_key or new_value or new_bias
        kv = kernels.linear(key.reshape(S * n, -1), self.kv_proj)
        kv = kv.view(S, n, 2, H, d).permute(2, 1, 3, 0, 4)  # (2, n, H, S, d)
        cache.key, new_key = reuse_or_allocate(cache.key, (n, H, length, d), kv.dtype, kv.device)
        cache.value, new_value = reuse_or_allocate(cache.value, (n, H, length, d), kv.dtype, kv.device)
        for i, buffer in enumerate((cache.key, cache.value)):
            if length == S:  # (the CPU: K/V keep the source's length)
                buffer.copy_(kv[i])
            else:
                buffer[:, :, :S].copy_(kv[i])
                buffer[:, :, S:].zero_()
        allocated = new_key or new_value
        cache.key_bias = None
        if source_len is not None or (key_padding_mask is not None and bool(key_padding_mask.any())):
            bias, new_bias = reuse_or_allocate(cache._bias_buffer, (n, length), kv.dtype, kv.device)
            cache._bias_buffer, allocated = bias, allocated or new_bias
            bias.zero_()
            if key_padding_mask is not None:
                bias[:, :S].masked_fill_(key_padding_mask, float("-inf"))
            bias[:, S:] = float("-inf")
            cache.key_bias = bias
        return cache, allocated

    def step(self, kernels, h: Tensor, cache: SoftmaxCrossCache, beam: int, need_weights: bool,
             residual: Tensor) -> Tuple[Tensor, Optional[Tensor]]:
        """(R, C) normalized inputs -> the output projection plus `residual` (R, C) and the (R, S) head-averaged
        weights (need_weights) or None."""
        q = kernels.linear(h, self.q_proj)
        attn, weights = kernels.softmax_cross_step(q, cache.key, cache.value, cache.key_bias, beam, self.scaling,
                                                   need_weights)
        return kernels.linear(attn, self.out_proj, residual=residual), weights


class SoftmaxCrossAttention(MultiheadAttention):
    def decoding_record(self, kernels) -> SoftmaxCrossRecord:
        """What the decoding step reads of this attention, its projections packed for `kernels` (built once per
        runtime)."""
        if self.bias_k is not None or self.add_zero_attn:
            raise ValueError("RFA incremental decoding does not support cross-attention with bias_kv / zero attention")
        with torch.no_grad():
            kv_bias = None if self.k_proj.bias is None else torch.cat([self.k_proj.bias, self.v_proj.bias])
            kv = kernels.pack_linear(torch.cat([self.k_proj.weight, self.v_proj.weight]), kv_bias,
                                     sources=(self.k_proj.weight, self.v_proj.weight))
            q = kernels.pack_linear(self.q_proj.weight.detach(), _detached(self.q_proj.bias))
            out = kernels.pack_linear(self.out_proj.weight.detach(), _detached(self.out_proj.bias))
        return SoftmaxCrossRecord(q, kv, out, self.num_heads, self.head_dim, float(self.scaling))


def _detached(t: Optional[Tensor]) -> Optional[Tensor]:
    return None if t is None else t.detach()
