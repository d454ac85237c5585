"""RFA attention with fairseq's MultiheadAttention call signature.

Inputs are T x B x C like fairseq's. Three roles, chosen at construction:
  causal self-attention (decoder): chunked causal RFA in training, a constant-size
      recurrent state (S and z, one (B, H, F, d + 1) tensor) in incremental decoding;
  encoder-decoder attention: S = phi(K)^T [V, 1] computed once per source sentence and
      cached in the incremental state;
  non-causal self-attention (encoder, with --rfa-encoder-self-attn).
Projection names (q_proj, k_proj, v_proj, out_proj) match fairseq's MultiheadAttention,
so softmax transformer weights load into RFA layers unchanged.
"""
import math
from typing import Dict, Optional, Tuple

import torch
from fairseq.incremental_decoding_utils import with_incremental_state
from fairseq.modules.quant_noise import quant_noise
from torch import Tensor, nn

from ..ops import (
    DECODE_KERNELS,
    SEQUENCE_KERNELS,
    CausalRFAState,
    causal_rfa,
    denominator_eps,
    draw_random_matrix,
    gate_keys,
    is_identity_order,
    noncausal_rfa,
    noncausal_rfa_state,
    random_matrix_seed,
)
from .feature_maps import LEGACY_PARAMETER_NAMES, build_feature_map

# fairseq's incremental_state; our buffer holds tensors and, under "causal", a CausalRFAState
IncrementalState = Optional[Dict[str, Dict[str, Optional[Tensor]]]]

# b_g starts at 2: g = sigmoid(2) = 0.88, a memory of ~8 tokens, so a fresh gated
# model starts close to (but more local than) plain causal RFA.
GATE_BIAS_INIT = 2.0
# stream index for the evaluation matrices, apart from every training update >= 0
EVAL_UPDATE = -1


@with_incremental_state
class RFAAttention(nn.Module):
    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        kdim: Optional[int] = None,
        vdim: Optional[int] = None,
        dropout: float = 0.0,
        bias: bool = True,
        self_attention: bool = False,
        encoder_decoder_attention: bool = False,
        causal: bool = False,
        q_noise: float = 0.0,
        qn_block_size: int = 8,
        *,
        feature_map: str = "hedgehog",
        num_features: int = 16,
        random_matrix: str = "orthogonal",
        fixed_random_matrix: bool = False,
        sigma: str = "learned",
        sigma_lr_multiplier: float = 10.0,
        temperature: float = 1.0,
        gate: bool = True,
        chunk_size: int = 64,
        decode_kernel: str = "auto",
        sequence_kernel: str = "auto",
    ):
        """The RFA options are those of `RFAConfig` (config.py) without the rfa_ prefix, with the
        same defaults; `gate` only applies to causal self-attention.

        dropout (fairseq's --attention-dropout): RFA never forms the normalized attention weights
        that softmax attention drops, so each key's value is dropped instead (per head and key,
        scaled by 1 / (1 - p)) in the numerator only: the output's expectation over the mask is
        the output without dropout, as for softmax attention's dropout on the weights.
        """
        super().__init__()
        if self_attention == encoder_decoder_attention:
            raise ValueError("RFAAttention is either self-attention or encoder-decoder attention")
        if causal and not self_attention:
            raise ValueError("causal RFA is only defined for self-attention")
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim={embed_dim} is not divisible by num_heads={num_heads}")
        self.embed_dim = embed_dim
        self.kdim = kdim if kdim is not None else embed_dim
        self.vdim = vdim if vdim is not None else embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.self_attention = self_attention
        self.encoder_decoder_attention = encoder_decoder_attention
        self.causal = causal
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"attention dropout must be in [0, 1), got {dropout}")
        self.dropout = float(dropout)
        if decode_kernel not in DECODE_KERNELS:
            raise ValueError(f"--rfa-decode-kernel={decode_kernel!r} is not one of {', '.join(DECODE_KERNELS)}")
        self.decode_kernel = str(decode_kernel)
        if sequence_kernel not in SEQUENCE_KERNELS:
            raise ValueError(f"--rfa-sequence-kernel={sequence_kernel!r} is not one of {', '.join(SEQUENCE_KERNELS)}")
        self.sequence_kernel = str(sequence_kernel)

        self.feature_map = str(feature_map)
        self.eps = denominator_eps(self.feature_map)
        self.num_features = int(num_features)
        self.random_matrix_kind = str(random_matrix)
        self.fixed_random_matrix = bool(fixed_random_matrix)
        self.chunk_size = int(chunk_size)
        self.gated = bool(gate) and causal

        # phi first: its parameters keep the place the attention's own sigma / feature weights had in
        # parameters() (resumed optimizer states are matched by position); initialized in reset_parameters
        self.phi = build_feature_map(self.feature_map, num_heads, self.num_features, self.head_dim, sigma=str(sigma),
                                     sigma_lr_multiplier=sigma_lr_multiplier, temperature=temperature, initialize=False)
        self.learned_map = not self.phi.uses_random_matrix
        self.k_proj = quant_noise(nn.Linear(self.kdim, embed_dim, bias=bias), q_noise, qn_block_size)
        self.v_proj = quant_noise(nn.Linear(self.vdim, embed_dim, bias=bias), q_noise, qn_block_size)
        self.q_proj = quant_noise(nn.Linear(embed_dim, embed_dim, bias=bias), q_noise, qn_block_size)
        self.out_proj = quant_noise(nn.Linear(embed_dim, embed_dim, bias=bias), q_noise, qn_block_size)
        self.gate_proj = nn.Linear(embed_dim, num_heads) if self.gated else None

        # fixed matrices for evaluation and generation; saved in the checkpoint (drawn for the
        # learned maps too, which do not use them, so every RFA checkpoint has the same layout)
        self.register_buffer("eval_random_matrix", torch.zeros(num_heads, self.num_features, self.head_dim))
        self.seed = 0
        self.module_index = 0
        self.num_updates = 0
        self.beam_size = 1  # set by fairseq's SequenceGenerator through set_beam_size
        self._train_matrix: Optional[Tensor] = None
        self._train_matrix_update: Optional[int] = None
        self.reset_parameters()
        self.set_random_feature_seed(0, 0)

    def reset_parameters(self):
        # same initialization as fairseq's MultiheadAttention
        gain = 1 / math.sqrt(2) if self.kdim == self.embed_dim == self.vdim else 1.0
        for proj in (self.k_proj, self.v_proj, self.q_proj):
            nn.init.xavier_uniform_(proj.weight, gain=gain)
        nn.init.xavier_uniform_(self.out_proj.weight)
        if self.out_proj.bias is not None:
            nn.init.constant_(self.out_proj.bias, 0.0)
        if self.gate_proj is not None:
            nn.init.xavier_uniform_(self.gate_proj.weight)
            nn.init.constant_(self.gate_proj.bias, GATE_BIAS_INIT)
        self.phi.reset_parameters()  # last, as before the maps were modules: same draws for a seed

    @property
    def sigma_mode(self) -> str:
        return getattr(self.phi, "sigma_mode", "none")

    def current_sigma(self) -> Tensor:
        """(H, d) sigma scaling the random projections (random feature maps only)."""
        return self.phi.current_sigma()

    def set_sigma_(self, sigma: Tensor) -> None:
        """Set sigma (H, d) in place, whatever its parametrization (weight conversion)."""
        self.phi.set_sigma_(sigma)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # checkpoints from before the feature maps were modules: feature_weight -> phi.weight, sigma -> phi.sigma, ...
        for old, new in LEGACY_PARAMETER_NAMES.items():
            if prefix + old in state_dict and prefix + new not in state_dict:
                state_dict[prefix + new] = state_dict.pop(prefix + old)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    # ------------------------------------------------------------ random matrices

    def set_random_feature_seed(self, seed: int, module_index: int) -> None:
        """Tie this module's draws to (seed, module_index) and redraw the eval matrix."""
        self.seed, self.module_index = int(seed), int(module_index)
        self._train_matrix = self._train_matrix_update = None
        with torch.no_grad():
            self.eval_random_matrix.copy_(self._draw(EVAL_UPDATE))

    def set_num_updates(self, num_updates: int) -> None:
        self.num_updates = int(num_updates)

    def _draw(self, update: int) -> Tensor:
        return draw_random_matrix(
            self.num_heads,
            self.num_features,
            self.head_dim,
            self.random_matrix_kind,
            random_matrix_seed(self.seed, update, self.module_index),
        )

    def random_matrix(self) -> Optional[Tensor]:
        """(H, D, d): redrawn per training update from (seed, update, module), fixed in eval
        (and in training with --rfa-fixed-random-matrix); None for the learned maps."""
        if self.learned_map:
            return None
        if not self.training or self.fixed_random_matrix:
            return self.eval_random_matrix
        if self._train_matrix_update != self.num_updates:
            self._train_matrix = self._draw(self.num_updates).to(self.eval_random_matrix.device)
            self._train_matrix_update = self.num_updates
        return self._train_matrix

    # ------------------------------------------------------------ forward

    def _heads(self, x: Tensor) -> Tensor:
        """(T, B, C) -> (B, H, T, d)."""
        T, B, _ = x.shape
        return x.view(T, B, self.num_heads, self.head_dim).permute(1, 2, 0, 3)

    def _phi(self, x: Tensor, w: Optional[Tensor], is_query: bool) -> Tensor:
        """(T, B, C) projected inputs -> (B, H, T, F) fp32 features."""
        return self.phi(self._heads(x), w, is_query)

    def _check_causal_mask(self, attn_mask: Tensor, length: int) -> None:
        # our decoder passes a zero-stride stand-in (no T x T memory); a materialized
        # mask from elsewhere must be fairseq's future mask, the only one RFA can honor
        if attn_mask.dim() == 2 and attn_mask.shape == (length, length) and attn_mask.stride() == (0, 0):
            return
        expected = torch.triu(torch.ones(length, length, dtype=torch.bool, device=attn_mask.device), 1)
        if attn_mask.shape != (length, length) or not torch.equal(attn_mask.isinf() | (attn_mask < -1e3), expected):
            raise ValueError("RFA causal self-attention supports only the causal future mask as attn_mask")

    def _values(self, x: Tensor) -> Tensor:
        """(T, B, C) projected values -> (B, H, T, d), with attention dropout in training (see __init__)."""
        v = self._heads(x)
        if self.training and self.dropout > 0:
            # one mask entry per (batch, head, key): the key's whole value, never the ones column of z
            keep = nn.functional.dropout(v.new_ones(v.shape[:-1] + (1,)), self.dropout, training=True)  # (B, H, T, 1)
            v = v * keep
        return v

    def forward(
        self,
        query: Tensor,
        key: Optional[Tensor],
        value: Optional[Tensor],
        key_padding_mask: Optional[Tensor] = None,
        incremental_state: IncrementalState = None,
        need_weights: bool = True,
        static_kv: bool = False,
        attn_mask: Optional[Tensor] = None,
        before_softmax: bool = False,
        need_head_weights: bool = False,
    ) -> Tuple[Tensor, Optional[Tensor]]:
        """query: (T, B, C); key, value: (S, B, C) -> ((T, B, C), None).

        RFA never forms attention weights, so the second output is always None.
        """
        if before_softmax:
            raise ValueError("RFA has no attention logits (before_softmax=True is unsupported)")
        tgt_len, bsz, _ = query.shape
        w = self.random_matrix()  # (H, D, d) or None
        phi_q = self._phi(self.q_proj(query), w, is_query=True)  # (B, H, T, F)
        if self.encoder_decoder_attention:
            out = self._cross_attention(phi_q, key, value, key_padding_mask, incremental_state, static_kv, w)
        elif self.causal and (incremental_state is not None or attn_mask is not None):
            out = self._causal_self_attention(phi_q, query, key_padding_mask, incremental_state, attn_mask, w)
        else:
            # encoder self-attention, or decoder self-attention with full context
            out = self._self_attention(phi_q, key, value, key_padding_mask, attn_mask, w)
        out = out.permute(2, 0, 1, 3).reshape(tgt_len, bsz, self.embed_dim).to(query.dtype)  # (T, B, C)
        return self.out_proj(out), None

    def _causal_self_attention(self, phi_q, query, key_padding_mask, incremental_state, attn_mask, w) -> Tensor:
        """Decoder self-attention: chunked over whole sequences, a CausalRFAState while decoding. -> (B, H, T, d)"""
        if attn_mask is not None:
            self._check_causal_mask(attn_mask, query.size(0))
        phi_k = self._phi(self.k_proj(query), w, is_query=False)  # (B, H, T, F)
        v = self._values(self.v_proj(query))  # (B, H, T, d)
        gate_logits = self.gate_proj(query).permute(1, 2, 0) if self.gate_proj is not None else None  # (B, H, T)
        phi_k, log_gate = gate_keys(phi_k, gate_logits, key_padding_mask)
        if incremental_state is None:
            out, _ = causal_rfa(phi_q, phi_k, v, log_gate, chunk_size=self.chunk_size, eps=self.eps,
                                sequence_kernel=self.sequence_kernel)
            return out
        saved = self._get_input_buffer(incremental_state)
        decoding = saved.get("causal")
        out, saved["causal"] = causal_rfa(phi_q, phi_k, v, log_gate, decoding if decoding is not None else CausalRFAState(),
                                          eps=self.eps, decode_kernel=self.decode_kernel)
        self._set_input_buffer(incremental_state, saved)
        return out

    def _cross_attention(self, phi_q, key, value, key_padding_mask, incremental_state, static_kv, w) -> Tensor:
        """Encoder-decoder attention: S = phi(K)^T [V, 1], cached per source sentence while decoding. -> (B, H, T, d)"""
        if incremental_state is not None and static_kv:
            saved = self._get_input_buffer(incremental_state)
            out = self._cross_attention_step(phi_q, key, value, key_padding_mask, w, saved)
            self._set_input_buffer(incremental_state, saved)
            return out
        phi_k, _ = gate_keys(self._phi(self.k_proj(key), w, is_query=False), None, key_padding_mask)
        out, _ = noncausal_rfa(phi_q, phi_k, self._values(self.v_proj(value)), eps=self.eps)
        return out

    def _self_attention(self, phi_q, key, value, key_padding_mask, attn_mask, w) -> Tensor:
        """Non-causal self-attention (encoder, or a decoder pass without a mask). -> (B, H, T, d)"""
        if attn_mask is not None:
            raise ValueError("non-causal RFA self-attention does not support attn_mask")
        phi_k, _ = gate_keys(self._phi(self.k_proj(key), w, is_query=False), None, key_padding_mask)
        out, _ = noncausal_rfa(phi_q, phi_k, self._values(self.v_proj(value)), eps=self.eps)
        return out

    # ------------------------------------------------------------ incremental state

    def _cross_attention_step(self, phi_q, key, value, key_padding_mask, w, saved) -> Tensor:
        """Cross-attention while decoding: S = phi(K)^T [V, 1] once per source sentence.

        Beam search feeds every source sentence `beam_size` times (identical rows), so
        the state is kept once per sentence, (B_src, H, F, d + 1), with `cross_rows`
        mapping each decoder row to its sentence; queries of a sentence's beams share
        one batched matmul and beam reorders cost nothing.
        """
        if "cross_state" not in saved:
            bsz = key.size(1)
            beam = self.beam_size if self.beam_size > 1 and bsz % self.beam_size == 0 else 1
            key, value = key[:, ::beam], value[:, ::beam]
            mask = key_padding_mask[::beam] if key_padding_mask is not None else None
            phi_k, _ = gate_keys(self._phi(self.k_proj(key), w, is_query=False), None, mask)
            saved["cross_state"] = noncausal_rfa_state(phi_k, self._heads(self.v_proj(value)))
            saved["cross_rows"] = torch.arange(bsz // beam, device=phi_q.device).repeat_interleave(beam)
        state, rows = saved["cross_state"], saved["cross_rows"]
        B, H, T, F_ = phi_q.shape
        n_src = state.size(0)
        # on CUDA, rows always have this layout (see _beams_grouped); checking would wait for the GPU
        if B % n_src == 0 and (rows.is_cuda or torch.equal(rows, torch.arange(n_src, device=rows.device).repeat_interleave(B // n_src))):
            beam = B // n_src
            q = phi_q.view(n_src, beam, H, T, F_).transpose(1, 2).reshape(n_src, H, beam * T, F_)
            out, _ = noncausal_rfa(q, None, None, state=state, eps=self.eps)  # (B_src, H, beam * T, d)
            return out.view(n_src, H, beam, T, -1).transpose(1, 2).reshape(B, H, T, -1)
        out, _ = noncausal_rfa(phi_q, None, None, state=state.index_select(0, rows), eps=self.eps)
        return out

    def reorder_incremental_state(self, incremental_state: IncrementalState, new_order: Tensor):
        """Beam search: select rows of the cached states; new_order may also shrink the batch.

        The causal state keeps the order for its next step (CausalRFAState.reorder_: no pass
        over the state here); the cross state only moves when whole sentences leave the batch.
        """
        buffer = self._get_input_buffer(incremental_state)
        if not buffer:
            return incremental_state
        if buffer.get("causal") is not None:
            buffer["causal"].reorder_(new_order)
        if "cross_rows" in buffer:
            rows = buffer["cross_rows"].index_select(0, new_order)
            beam = self.beam_size if self.beam_size > 1 and rows.numel() % self.beam_size == 0 else 1
            groups = rows.view(-1, beam)
            if _beams_grouped(groups):
                sentences = groups[:, 0]
                if not is_identity_order(sentences, buffer["cross_state"].size(0)):
                    buffer["cross_state"] = buffer["cross_state"].index_select(0, sentences)
                rows = torch.arange(sentences.numel(), device=rows.device).repeat_interleave(beam)
            buffer["cross_rows"] = rows
        return self._set_input_buffer(incremental_state, buffer)

    def _get_input_buffer(self, incremental_state: IncrementalState) -> Dict[str, Optional[Tensor]]:
        result = self.get_incremental_state(incremental_state, "rfa_state")
        return result if result is not None else {}

    def _set_input_buffer(self, incremental_state: IncrementalState, buffer: Dict[str, Optional[Tensor]]):
        return self.set_incremental_state(incremental_state, "rfa_state", buffer)

    def set_beam_size(self, beam_size: int) -> None:
        self.beam_size = int(beam_size)

    def extra_repr(self) -> str:
        role = "causal" if self.causal else ("cross" if self.encoder_decoder_attention else "self")
        return (
            f"role={role}, heads={self.num_heads}, head_dim={self.head_dim}, feature_map={self.feature_map}, "
            f"D={self.num_features}, matrix={self.random_matrix_kind}, sigma={self.sigma_mode}, gated={self.gated}, "
            f"decode_kernel={self.decode_kernel}, sequence_kernel={self.sequence_kernel}, dropout={self.dropout}, module_index={self.module_index}"
        )


def _beams_grouped(groups: Tensor) -> bool:
    """Each row of `groups` (one sentence's beams) reads one source sentence. Trusted on CUDA,
    where checking would wait for the GPU at every step: fairseq's beam search keeps a
    sentence's beams together (its MultiheadAttention relies on that too)."""
    return groups.is_cuda or bool((groups == groups[:, :1]).all())
