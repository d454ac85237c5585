"""RFA attention with fairseq's MultiheadAttention call signature.

Inputs are T x B x C like fairseq's. Three roles, chosen at construction:
  causal self-attention (decoder): chunked causal RFA over whole sequences, causal by construction
      (no attention mask needed);
  encoder-decoder attention: S = phi(K)^T [V, 1] per source sentence;
  non-causal self-attention (encoder, with --rfa-encoder-self-attn).
Projection names (q_proj, k_proj, v_proj, out_proj) match fairseq's MultiheadAttention,
so softmax transformer weights load into RFA layers unchanged.

Incremental decoding does not go through forward: the attention gives the decoding runtime its record
(`decoding_record`: CausalRecord or RFACrossRecord, modules/decoding.py), whose `start` makes a batch's cache and
whose `step` is its part of the torch step (the native step reads the same record).
"""
import math
from dataclasses import dataclass
from typing import Optional, Tuple, Union

import torch
from fairseq.modules.quant_noise import quant_noise
from torch import Tensor, nn

from ..config import RFAConfig
from ..kernel_choice import causal_rfa
from ..ops import activate_learned, denominator_eps, draw_random_matrix, gate_keys, noncausal_rfa, noncausal_rfa_state, random_matrix_seed
from .decoding import CausalCache, SentenceCache, reuse_or_allocate
from .feature_maps import LEGACY_PARAMETER_NAMES, build_feature_map

# b_g starts at 2: g = sigmoid(2) = 0.88, a memory of ~8 tokens, so a fresh gated
# model starts close to (but more local than) plain causal RFA.
GATE_BIAS_INIT = 2.0
# stream index for the evaluation matrices, apart from every training update >= 0
EVAL_UPDATE = -1


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
        rfa: Optional[RFAConfig] = None,
    ):
        """rfa: the model's RFA options (RFAConfig's defaults when None); the gate only applies to causal
        self-attention.

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
        self.rfa = rfa if rfa is not None else RFAConfig()  # the options, read where they are used
        self.eps = denominator_eps(self.feature_map)
        self.gated = bool(self.rfa.rfa_gate) and causal

        # phi first: its parameters keep the place the attention's own sigma / feature weights had in
        # parameters() (resumed optimizer states are matched by position); initialized in reset_parameters
        self.phi = build_feature_map(self.rfa, num_heads, self.head_dim, initialize=False)
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

    # the model's options, as RFAConfig holds them (fairseq-generate's --model-overrides included)
    sequence_kernel = property(lambda self: str(self.rfa.rfa_sequence_kernel))
    triton_self_check = property(lambda self: bool(self.rfa.rfa_triton_self_check))
    feature_map = property(lambda self: str(self.rfa.rfa_feature_map))
    num_features = property(lambda self: int(self.rfa.rfa_num_features))
    random_matrix_kind = property(lambda self: str(self.rfa.rfa_random_matrix))
    fixed_random_matrix = property(lambda self: bool(self.rfa.rfa_fixed_random_matrix))
    chunk_size = property(lambda self: int(self.rfa.rfa_chunk_size))

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

    def features(self, x: Tensor, w: Optional[Tensor], is_query: bool) -> Tensor:
        """(T, B, C) projected inputs -> (B, H, T, F) fp32 features."""
        return self.phi(self._heads(x), w, is_query)

    def _check_causal_mask(self, attn_mask: Tensor, length: int) -> None:
        # the module is causal by construction and needs no mask; one passed anyway must be fairseq's
        # future mask, the only one RFA can honor
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
        incremental_state=None,
        need_weights: bool = True,
        static_kv: bool = False,
        attn_mask: Optional[Tensor] = None,
        before_softmax: bool = False,
        need_head_weights: bool = False,
    ) -> Tuple[Tensor, Optional[Tensor]]:
        """query: (T, B, C); key, value: (S, B, C) -> ((T, B, C), None) over whole sequences.

        RFA never forms attention weights, so the second output is always None.
        """
        if before_softmax:
            raise ValueError("RFA has no attention logits (before_softmax=True is unsupported)")
        if incremental_state is not None:
            raise ValueError("RFAAttention decodes incrementally through the decoding step (its decoding_record, run "
                             "by RFATransformerDecoder's DecodingState), not through forward")
        tgt_len, bsz, _ = query.shape
        w = self.random_matrix()  # (H, D, d) or None
        phi_q = self.features(self.q_proj(query), w, is_query=True)  # (B, H, T, F)
        if self.causal:
            if attn_mask is not None:
                self._check_causal_mask(attn_mask, tgt_len)
            out = self._causal_self_attention(phi_q, query, key_padding_mask, w)
        else:
            if attn_mask is not None:
                raise ValueError("non-causal RFA attention does not support attn_mask")
            phi_k, _ = gate_keys(self.features(self.k_proj(key), w, is_query=False), None, key_padding_mask)
            out, _ = noncausal_rfa(phi_q, phi_k, self._values(self.v_proj(value)), eps=self.eps)
        out = out.permute(2, 0, 1, 3).reshape(tgt_len, bsz, self.embed_dim).to(query.dtype)  # (T, B, C)
        return self.out_proj(out), None

    def _get_input_buffer(self, incremental_state) -> None:
        return None  # fairseq's decoder layer asks for it; incremental decoding keeps its cache in the DecodingState

    def _causal_self_attention(self, phi_q, query, key_padding_mask, w) -> Tensor:
        """Decoder self-attention over whole sequences, chunked. -> (B, H, T, d)"""
        phi_k = self.features(self.k_proj(query), w, is_query=False)  # (B, H, T, F)
        v = self._values(self.v_proj(query))  # (B, H, T, d)
        gate_logits = self.gate_proj(query).permute(1, 2, 0) if self.gate_proj is not None else None  # (B, H, T)
        phi_k, log_gate = gate_keys(phi_k, gate_logits, key_padding_mask)
        out, _ = causal_rfa(phi_q, phi_k, v, log_gate, chunk_size=self.chunk_size, eps=self.eps,
                            sequence_kernel=self.sequence_kernel, self_check=self.triton_self_check)
        return out

    # ------------------------------------------------------------ the decoding step

    def decoding_record(self, kernels) -> Union["CausalRecord", "RFACrossRecord"]:
        """What the decoding step reads of this attention, its linear layers packed for `kernels` (built once per
        runtime): causal, one fused input projection [q | k | v | gate logits]; cross, the query and output
        projections and what makes the per-sentence state."""
        H, d, C = self.num_heads, self.head_dim, self.embed_dim
        map_record = FeatureMapRecord.of(self.phi, self.random_matrix())
        out_proj = kernels.pack_linear(*_weight_and_bias(self.out_proj))
        linear = self.phi.linear_part()
        q_width = linear[0].size(1) * H if linear is not None else C  # H * D (learned linear map) or C
        if not self.causal:
            with torch.no_grad():  # a learned map's linear part folded into the query projection, as below
                wq, bq = self.q_proj.weight, _bias(self.q_proj, C)
                q_proj = kernels.pack_linear(*(_fold(*linear, wq, bq, H, d) if linear is not None else (wq, bq)),
                                             sources=(self.q_proj.weight,))
            return RFACrossRecord(self, q_proj, out_proj, q_width, H, d, self.eps, map_record)
        with torch.no_grad():
            sources = [m.weight for m in (self.q_proj, self.k_proj, self.v_proj, self.gate_proj) if m is not None]
            proj = kernels.pack_linear(*self._fused_input_projection(), sources=sources)
        return CausalRecord(proj, out_proj, q_width, H, d, self.phi.output_dim, self.gate_proj is not None, self.eps,
                            map_record)

    def _fused_input_projection(self) -> Tuple[Tensor, Tensor]:
        """Causal: one (N, C) weight and (N,) bias giving [q | k | v | gate logits] from x, where a learned
        map's linear part p = W_phi (W x + b) + b_phi is folded into q and k."""
        H, d, C = self.num_heads, self.head_dim, self.embed_dim
        wq, bq = self.q_proj.weight, _bias(self.q_proj, C)
        wk, bk = self.k_proj.weight, _bias(self.k_proj, C)
        linear = self.phi.linear_part()
        if linear is not None:
            wq, bq = _fold(*linear, wq, bq, H, d)
            wk, bk = _fold(*linear, wk, bk, H, d)
        pieces = [(wq, bq), (wk, bk), (self.v_proj.weight, _bias(self.v_proj, C))]
        if self.gate_proj is not None:
            pieces.append((self.gate_proj.weight, self.gate_proj.bias))
        return torch.cat([w for w, _ in pieces], dim=0).contiguous(), torch.cat([b for _, b in pieces]).contiguous()

    def extra_repr(self) -> str:
        role = "causal" if self.causal else ("cross" if self.encoder_decoder_attention else "self")
        return (
            f"role={role}, heads={self.num_heads}, head_dim={self.head_dim}, feature_map={self.feature_map}, "
            f"D={self.num_features}, matrix={self.random_matrix_kind}, sigma={self.sigma_mode}, gated={self.gated}, "
            f"sequence_kernel={self.sequence_kernel}, dropout={self.dropout}, module_index={self.module_index}"
        )


@dataclass
class FeatureMapRecord:
    """A feature map as the decoding step applies it: `activation` on the fused projection's pre-activations of a
    learned affine map (hedgehog, relu), or the map module itself on raw per-head q / k (`phi`, with its random
    matrix and sigma, which the native program reads). `kind` names it for the native program; `width`: the values
    per head it is applied to (D pre-activations of an affine map, else the head dimension), `features`: F."""

    kind: str
    activation: Optional[str]
    phi: nn.Module
    random_matrix: Optional[Tensor]
    sigma: Optional[Tensor]
    width: int
    features: int

    @classmethod
    def of(cls, phi, random_matrix: Optional[Tensor]) -> "FeatureMapRecord":
        # copies (small, read at every step: see NormRecord.of)
        sigma = phi.current_sigma().detach().float().clone() if hasattr(phi, "current_sigma") else None
        matrix = random_matrix.detach().float().clone() if random_matrix is not None else None
        linear = phi.linear_part()
        width = linear[0].size(1) if linear is not None else phi.head_dim
        return cls(phi.kind, phi.step_activation, phi, matrix, sigma, width, phi.output_dim)

    def step_features(self, q: Tensor, k: Tensor) -> Tuple[Tensor, Tensor]:
        """phi(q), phi(k) of one step's raw (R, H * d) inputs -> (R, H * F) fp32 each (maps without an activation)."""
        return self.phi.step_features(q, k, self.random_matrix)


@dataclass
class CausalRecord:
    """A causal RFA layer's part of the decoding step: its fused input projection [q | k | v | gate logits] (q and
    k q_width wide: H * D pre-activations of a learned affine map, else C) and output projection packed for the
    kernels, its shape and feature map."""

    proj: object
    out_proj: object
    q_width: int
    heads: int
    head_dim: int
    features: int
    gated: bool
    eps: float
    map: FeatureMapRecord

    def start(self, previous: Optional[CausalCache], rows: int, device, dtype=torch.float32,
              buffers: int = 2) -> Tuple[CausalCache, bool]:
        """A batch's cache: `buffers` state buffers (CausalCache) of `dtype` (the kernels' state_dtype) for `rows` rows
        (the previous batch's when large enough)."""
        cache = previous if previous is not None else CausalCache()
        return cache, cache.allocate(rows, self.heads, self.features, self.head_dim, device, dtype, buffers)

    def step(self, kernels, h: Tensor, cache: CausalCache, state, order: Optional[Tensor], key_pad: Optional[Tensor],
             residual: Tensor) -> Tensor:
        """One step of the (R, C) normalized inputs h -> the output projection plus `residual` (R, C). Reads the
        state buffer state.parity through `order` (None: row r reads row r), writes the other."""
        C, H, width = self.heads * self.head_dim, self.heads, self.q_width
        proj = kernels.linear(h, self.proj)  # [q | k | v | gate]
        q, k = proj[:, :width], proj[:, width: 2 * width]
        if self.map.activation is None:  # the step takes features, computed here
            q, k = self.map.step_features(q, k)
        v = proj[:, 2 * width: 2 * width + C]
        gate = proj[:, 2 * width + C: 2 * width + C + H] if self.gated else None
        # rows only shrink, so the first step's buffers fit; the first step reads no state
        state_in = None if state.first else cache.states[state.parity]
        attn = kernels.causal_layer_step(q, k, v, gate, key_pad, state_in, order, cache.states[1 - state.parity],
                                         self.eps, self.map.activation)
        return kernels.linear(attn, self.out_proj, residual=residual)


class RFACrossCache(SentenceCache):
    """RFA cross-attention's cache: each source sentence's state S = phi(K)^T [V, 1] (sentences, H, F, d + 1)."""

    SENTENCE_TENSORS = ("rfa_state",)

    def __init__(self):
        self.rfa_state: Optional[Tensor] = None


@dataclass
class RFACrossRecord:
    """RFA cross-attention's part of the decoding step: its query and output projections packed for the kernels, its
    map; `attention` (the module) makes each sentence's state at a batch's start."""

    attention: "RFAAttention"
    q_proj: object  # gives q, or a learned affine map's pre-activations (q_width: H * D)
    out_proj: object
    q_width: int
    heads: int
    head_dim: int
    eps: float
    map: FeatureMapRecord
    kind = "rfa"  # for the native program
    has_weights = False  # RFA forms no attention weights

    def start(self, previous: Optional[RFACrossCache], key: Tensor, key_padding_mask: Optional[Tensor],
              source_len: Optional[int], kernels) -> Tuple[RFACrossCache, bool]:
        """S = phi(K)^T [V, 1] of key (S, sentences, C), once per source sentence (its size does not depend on S:
        source_len, softmax K/V's padded length, is moot)."""
        module = self.attention
        with torch.no_grad():
            phi_k = module.features(module.k_proj(key), self.map.random_matrix, is_query=False)  # (n, H, S, F)
            if key_padding_mask is not None:
                phi_k = phi_k.masked_fill(key_padding_mask[:, None, :, None], 0.0)
            sentence_states = noncausal_rfa_state(phi_k, module._heads(module.v_proj(key)))  # (n, H, F, d + 1)
        cache = previous if previous is not None else RFACrossCache()
        kept, allocated = reuse_or_allocate(cache.rfa_state, tuple(sentence_states.shape), sentence_states.dtype,
                                            sentence_states.device)
        cache.rfa_state = kept.copy_(sentence_states)
        return cache, allocated

    def step(self, kernels, h: Tensor, cache: RFACrossCache, beam: int, need_weights: bool,
             residual: Tensor) -> Tuple[Tensor, None]:
        R, C, H = h.size(0), self.heads * self.head_dim, self.heads
        q = kernels.linear(h, self.q_proj)
        if self.map.activation is not None:  # the pre-activations of a learned affine map
            phi_q = activate_learned(q.view(R, H, 1, -1).float(), self.map.activation)  # (R, H, 1, F)
        else:
            phi_q = self.attention.features(q.unsqueeze(0), self.map.random_matrix, is_query=True)  # (R, H, 1, F)
        n = cache.rfa_state.size(0)
        grouped = phi_q.view(n, beam, H, 1, -1).transpose(1, 2).reshape(n, H, beam, -1)  # rows n * beam + b
        out, _ = noncausal_rfa(grouped, None, None, state=cache.rfa_state, eps=self.eps)  # (n, H, beam, d)
        attn = out.transpose(1, 2).reshape(R, C).to(h.dtype)
        return kernels.linear(attn, self.out_proj, residual=residual), None


def _weight_and_bias(linear: nn.Linear) -> Tuple[Tensor, Optional[Tensor]]:
    return linear.weight.detach(), None if linear.bias is None else linear.bias.detach()


def _bias(linear, size) -> Tensor:
    return linear.bias if linear.bias is not None else linear.weight.new_zeros(size)


def _fold(w_phi: Tensor, b_phi: Tensor, w: Tensor, b: Tensor, H: int, d: int) -> Tuple[Tensor, Tensor]:
    """(W_phi (W x + b) + b_phi) per head as one affine map: (H * D, C) weight, (H * D,) bias."""
    C = w.size(1)
    w_heads = w.view(H, d, C)
    folded_w = torch.bmm(w_phi.to(w.dtype), w_heads).reshape(-1, C)  # (H * D, C)
    folded_b = (torch.bmm(w_phi.to(w.dtype), b.view(H, d, 1)).squeeze(-1) + b_phi).reshape(-1)
    return folded_w, folded_b
