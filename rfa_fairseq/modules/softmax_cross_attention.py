"""fairseq's softmax encoder-decoder attention with its part of RFA's decoding step (the default
--rfa-softmax-cross-attn). Same parameters as fairseq's MultiheadAttention: its checkpoints load unchanged.

The source's K and V are fixed while the output grows, so the step keeps them once per source sentence,
(sentences, H, S, d), shared by the sentence's beams (ops' softmax_cross_step reads sentence r // beam for
row r), and returns the head-averaged weights that fairseq reports as the alignment on request.
"""
from typing import Optional, Tuple

from fairseq.modules import MultiheadAttention
from torch import Tensor


class SoftmaxCrossAttention(MultiheadAttention):
    def prepare_step(self, buffers: dict, state, key: Tensor, key_padding_mask: Optional[Tensor], name: str,
                     source_len: Optional[int] = None) -> None:
        """A batch's first step: K, V of key (S, sentences, C) in the state's workspace (under `name`), the padding as
        an additive (sentences, S) bias and the query and output projections packed for the kernels. source_len
        (>= S): K and V padded to that length with zeros that the bias masks, and the bias always present, so
        that batches of other source lengths up to it run on the same buffers and shapes (CUDA graphs)."""
        if self.bias_k is not None or self.add_zero_attn:
            raise ValueError("RFA incremental decoding does not support cross-attention with bias_kv / zero attention")
        S, n, _ = key.shape
        H, d = self.num_heads, self.head_dim
        length = S if source_len is None else source_len
        if length < S:
            raise ValueError(f"source_len {source_len} is shorter than the source ({S} positions)")
        kv_weights = state.packed_linear(f"{name}.kv_proj", self.k_proj, self.v_proj)
        kv = state.kernels.linear(key.reshape(S * n, -1), kv_weights, key.new_empty(S * n, 2 * self.embed_dim))
        kv = kv.view(S, n, 2, H, d).permute(2, 1, 3, 0, 4)  # (2, n, H, S, d)
        for i, role in enumerate(("key", "value")):
            buffer = state.buffer(f"{name}.{role}", n, H, length, d)  # the workspace's: the same address every batch
            buffer[:, :, :S].copy_(kv[i])
            buffer[:, :, S:].zero_()
            buffers[role] = buffer
        bias = None
        if source_len is not None or (key_padding_mask is not None and bool(key_padding_mask.any())):
            bias = state.buffer(f"{name}.key_bias", n, length).zero_()
            if key_padding_mask is not None:
                bias[:, :S].masked_fill_(key_padding_mask, float("-inf"))
            bias[:, S:] = float("-inf")
        buffers["key_bias"] = bias
        buffers["q_proj"] = state.packed_linear(f"{name}.q_proj", self.q_proj)
        buffers["out_proj"] = state.packed_linear(f"{name}.out_proj", self.out_proj)

    def step(self, h: Tensor, buffers: dict, state, key_pad: Optional[Tensor] = None, need_weights: bool = False,
             residual: Optional[Tensor] = None) -> Tuple[Tensor, Optional[Tensor]]:
        """(R, C) normalized inputs -> the (R, C) output projection (plus `residual`) and the (R, S) head-averaged
        weights (need_weights) or None."""
        R, C = h.shape
        kernels = state.kernels
        q = kernels.linear(h, buffers["q_proj"], state.buffer("q", R, C))
        attn = state.buffer("attn", R, C)
        weights = state.buffer("cross_weights", R, buffers["key"].size(2)) if need_weights else None
        kernels.softmax_cross_step(q, buffers["key"], buffers["value"], buffers["key_bias"], state.beam,
                                   self.scaling, attn, weights)
        return kernels.linear(attn, buffers["out_proj"], state.buffer("y", R, C), residual=residual), weights
