"""The static decoding step of an rfa_transformer decoder.

Every tensor of an RFA decoding step keeps its shape for the whole batch: the causal state never grows
and the cross-attention reads a source K/V (or an RFA state) fixed per sentence. So a batch's decoding
state is built once, at its first step, and every later step runs in place from those buffers:

- per causal layer, two state buffers (rows, H, F, d + 1) used in turn: a step reads one (through the
  pending beam order, so a reorder costs no pass of its own) and writes the other;
- per cross-attention layer, K and V (or the RFA state) once per source sentence, shared by its beams;
  when sentences finish, the kept ones are compacted into the spare buffers (rows shrink, nothing grows);
- activations, logits and log-probabilities in a workspace that outlives the batch (the decoder keeps
  it for the next one), so steady-state decoding allocates no large tensor.

One decoder step: token embedding + positions, then per layer one fused input projection (q, k, v and
the gate for self-attention, with a learned map's W folded in: x -> W_phi (W_q x + b_q) + b_phi), the
causal step (the learned map's activation, gate, reorder, update, read-out: ops.causal_layer_step; a
random map's features are computed before it), the output
projection, residual + layer norm (ops.add_layer_norm), the cross-attention (ops.softmax_cross_step over
per-sentence K/V, or the RFA read-out), the FFN, and the output projection into the logits buffer.

`StaticDecodeState.supports(decoder)` names what the step cannot do (adaptive softmax, scaled
attention heads, ...); the decoder then runs fairseq's eager path, which stays the reference
(tests/test_static_decoding.py compares the two).
"""
import math
import weakref
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ..ops import add_layer_norm, causal_layer_step, noncausal_rfa, noncausal_rfa_state, softmax_cross_step
from .rfa_attention import RFAAttention


class Workspace:
    """Named flat buffers, grown on demand and reused between steps and batches."""

    def __init__(self):
        self.buffers: Dict[str, Tensor] = {}

    def take(self, name: str, shape: Tuple[int, ...], dtype: torch.dtype, device: torch.device,
             returned: bool = False) -> Tensor:
        """A (shape) view of buffer `name`. returned=True for what a step hands to its caller (logits,
        log-probabilities): two buffers are used in turn (beam search still holds the last step's
        log-probabilities while it asks for the next), and one that a caller still views is never
        overwritten: a new buffer replaces it."""
        numel = math.prod(shape)
        names = (name + ".0", name + ".1") if returned else (name,)
        target = names[0]  # where a new buffer goes when none can be used
        for key in names:
            buf = self.buffers.get(key)
            if returned and buf is not None and _viewed_elsewhere(buf):
                continue
            if buf is not None and buf.numel() >= numel and buf.dtype == dtype and buf.device == device:
                return buf[:numel].view(shape)
            target = key
            break
        buf = self.buffers[target] = torch.empty(max(numel, 1), dtype=dtype, device=device)
        return buf[:numel].view(shape)

    def attention_tensors(self) -> List[Tensor]:
        """The attention state proper: both causal state buffers of every layer (in use: the rows of the
        current batch) and the cross-attention K/V or RFA states."""
        rows = self.rows
        kept = [t[:rows] for pair in self.states for t in pair]
        for entry in self.cross:
            if entry is not None:
                kept += [t for t in entry.values() if isinstance(t, Tensor)]
        return kept

    def tensors(self) -> List[Tensor]:
        return list(self.buffers.values())


def _viewed_elsewhere(buf: Tensor) -> bool:
    """Whether any tensor besides `buf` shares its storage (a view handed out and still alive). Without
    the storage's use count (a torch internal), every handed-out buffer counts as still viewed."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None:
        return True
    return use_count(buf.untyped_storage()._cdata) > 2  # buf itself + the storage object made for the call


class CausalLayerPlan:
    """One decoder layer's weights, arranged for the static step (built per batch from the live modules)."""

    def __init__(self, layer):
        attn: RFAAttention = layer.self_attn
        self.attn = attn
        H, d, C = attn.num_heads, attn.head_dim, attn.embed_dim
        linear = attn.phi.linear_part()
        wq, bq = attn.q_proj.weight, _bias(attn.q_proj, C)
        wk, bk = attn.k_proj.weight, _bias(attn.k_proj, C)
        if linear is not None:
            # p = W_phi (W_q x + b_q) + b_phi per head: fold W_phi into the input projection
            w_phi, b_phi = linear  # (H, D, d), (H, D)
            wq, bq = _fold(w_phi, b_phi, wq, bq, H, d)
            wk, bk = _fold(w_phi, b_phi, wk, bk, H, d)
        pieces_w = [wq, wk, attn.v_proj.weight]
        pieces_b = [bq, bk, _bias(attn.v_proj, C)]
        if attn.gate_proj is not None:
            pieces_w.append(attn.gate_proj.weight)
            pieces_b.append(attn.gate_proj.bias)
        self.weight_t = torch.cat(pieces_w, dim=0).t().contiguous()  # (C, N): x @ weight_t
        self.bias = torch.cat(pieces_b).contiguous()
        self.q_width = wq.size(0)  # H * D (learned linear map) or C
        self.linear_map = linear is not None
        self.v_start = 2 * self.q_width
        self.gate_start = self.v_start + C
        self.num_heads, self.head_dim, self.embed_dim = H, d, C
        self.features = attn.phi.output_dim  # F


def _bias(linear, size) -> Tensor:
    return linear.bias if linear.bias is not None else linear.weight.new_zeros(size)


def _fold(w_phi: Tensor, b_phi: Tensor, w: Tensor, b: Tensor, H: int, d: int) -> Tuple[Tensor, Tensor]:
    """(W_phi (W x + b) + b_phi) per head as one affine map: (H * D, C) weight, (H * D,) bias."""
    C = w.size(1)
    w_heads = w.view(H, d, C)
    folded_w = torch.bmm(w_phi.to(w.dtype), w_heads).reshape(-1, C)  # (H * D, C)
    folded_b = (torch.bmm(w_phi.to(w.dtype), b.view(H, d, 1)).squeeze(-1) + b_phi).reshape(-1)
    return folded_w, folded_b


class StaticDecodeState:
    """One batch's decoding state for the static step; lives in fairseq's incremental_state."""

    KEY = "rfa_static_decoding"

    def __init__(self, decoder, encoder_out: Optional[Dict[str, List[Tensor]]], rows: int, device, dtype):
        self.decoder = decoder
        self.decode_kernel = decoder.layers[0].self_attn.decode_kernel
        self.rows = rows
        self.step_index = 0
        self.order: Optional[Tensor] = None  # pending beam order (rows of the previous step)
        self.device, self.dtype = device, dtype
        self.workspace = decoder.take_static_workspace()
        weakref.finalize(self, decoder.return_static_workspace, self.workspace)
        self.layers = [CausalLayerPlan(layer) for layer in decoder.layers]
        # causal states: two fp32 buffers per layer used in turn, `current` holds the last step's
        self.states = [[self._buffer(f"state{i}.{j}", rows, p.num_heads, p.features, p.head_dim + 1, dtype=torch.float32)
                        for j in range(2)] for i, p in enumerate(self.layers)]
        self.current = [0 for _ in self.layers]
        self.first = True
        self._init_cross(encoder_out)

    # ------------------------------------------------------------ what it supports

    @staticmethod
    def supports(decoder) -> Optional[str]:
        """None when the static step can run this decoder, else why not (the eager path runs instead)."""
        if decoder.adaptive_softmax is not None:
            return "adaptive softmax"
        if decoder.project_in_dim is not None or decoder.project_out_dim is not None:
            return "decoder input/output dimension projections"
        if decoder.quant_noise is not None:
            return "quant noise on the embeddings"
        if getattr(decoder, "cross_self_attention", False):
            return "cross-self-attention"
        for layer in decoder.layers:
            if not isinstance(layer.self_attn, RFAAttention):
                return "a decoder layer without RFA self-attention"
            for name in ("c_attn", "attn_ln", "ffn_layernorm", "w_resid"):
                if getattr(layer, name, None) is not None:
                    return f"decoder layers with {name}"
            cross = layer.encoder_attn
            if cross is not None and not isinstance(cross, RFAAttention):
                if getattr(cross, "bias_k", None) is not None or getattr(cross, "add_zero_attn", False):
                    return "cross-attention with bias_kv / zero attention"
        return None

    # ------------------------------------------------------------ cross-attention, once per sentence

    def _init_cross(self, encoder_out):
        """K, V (softmax) or the RFA state of every cross-attention layer, once per source sentence."""
        self.cross: List[Optional[dict]] = [None] * len(self.layers)
        self.weights_layer = len(self.layers) - 1  # fairseq returns the last layer's head-averaged weights
        layers = self.decoder.layers
        if encoder_out is None or len(encoder_out.get("encoder_out", [])) == 0 or layers[0].encoder_attn is None:
            self.beam, self.sentences = 1, self.rows
            return
        enc = encoder_out["encoder_out"][0]  # (S, rows, C)
        pad = encoder_out["encoder_padding_mask"][0] if len(encoder_out.get("encoder_padding_mask", [])) else None
        self.beam = self._beam_of(enc, pad)
        key = enc[:, :: self.beam]  # (S, n, C): one row per sentence
        pad = pad[:: self.beam] if pad is not None else None
        self.sentences = key.size(1)
        for i, layer in enumerate(layers):
            cross = layer.encoder_attn
            if isinstance(cross, RFAAttention):
                w = cross.random_matrix()
                phi_k = cross._phi(cross.k_proj(key), w, is_query=False)  # (n, H, S, F)
                if pad is not None:
                    phi_k = phi_k.masked_fill(pad[:, None, :, None], 0.0)
                self.cross[i] = {"rfa_state": noncausal_rfa_state(phi_k, cross._heads(cross.v_proj(key)))}
                continue
            H, d = cross.num_heads, cross.head_dim
            k = cross.k_proj(key).view(key.size(0), self.sentences, H, d).permute(1, 2, 0, 3).contiguous()
            v = cross.v_proj(key).view(key.size(0), self.sentences, H, d).permute(1, 2, 0, 3).contiguous()
            bias = None
            if pad is not None and bool(pad.any()):
                bias = torch.zeros(pad.shape, dtype=k.dtype, device=k.device).masked_fill_(pad, float("-inf"))
            self.cross[i] = {"key": k, "value": v, "key_bias": bias, "scaling": cross.scaling}

    def _beam_of(self, enc: Tensor, pad: Optional[Tensor]) -> int:
        """fairseq's beam search feeds each sentence `beam` times in a row; keep K/V once per sentence when
        the rows say so (a mismatch, e.g. a caller that does not lay out beams, keeps one per row)."""
        beam = int(getattr(self.decoder, "_beam_size", 1) or 1)
        if beam <= 1 or self.rows % beam:
            return 1
        grouped = enc.view(enc.size(0), -1, beam, enc.size(2))
        if not torch.equal(grouped, grouped[:, :, :1].expand_as(grouped)):
            return 1
        if pad is not None:
            pad_groups = pad.view(-1, beam, pad.size(1))
            if not torch.equal(pad_groups, pad_groups[:, :1].expand_as(pad_groups)):
                return 1
        return beam

    # ------------------------------------------------------------ reorder

    def reorder_(self, new_order: Tensor) -> None:
        """Beam search: row i continues row new_order[i] (new_order may drop finished sentences).
        The causal states apply it in the next step; K/V move only when sentences leave."""
        new_order = new_order.to(self.device)
        self.order = new_order if self.order is None else self.order.index_select(0, new_order)
        self._reorder_sentences(new_order)
        self.rows = new_order.numel()

    def _reorder_sentences(self, new_order: Tensor) -> None:
        rows = new_order.numel()
        sentence = torch.div(new_order, self.beam, rounding_mode="floor")  # old sentence of each new row
        if self.beam > 1 and rows % self.beam == 0:
            groups = sentence.view(-1, self.beam)
            grouped = bool((groups == groups[:, :1]).all())
        else:
            grouped = self.beam == 1
        if grouped:
            kept = sentence.view(-1, self.beam)[:, 0] if self.beam > 1 else sentence
        else:  # rows of one sentence went apart: keep K/V once per row from now on
            kept, self.beam = sentence, 1
        if kept.numel() == self.sentences and torch.equal(kept, torch.arange(self.sentences, device=kept.device)):
            return
        for entry in self.cross:
            if entry is None:
                continue
            for name in ("key", "value", "key_bias", "rfa_state"):
                if entry.get(name) is not None:
                    entry[name] = entry[name].index_select(0, kept)
        self.sentences = kept.numel()

    # ------------------------------------------------------------ the step

    def attention_tensors(self) -> List[Tensor]:
        """The attention state proper: both causal state buffers of every layer (in use: the rows of the
        current batch) and the cross-attention K/V or RFA states."""
        rows = self.rows
        kept = [t[:rows] for pair in self.states for t in pair]
        for entry in self.cross:
            if entry is not None:
                kept += [t for t in entry.values() if isinstance(t, Tensor)]
        return kept

    def tensors(self) -> List[Tensor]:
        """Every tensor the batch keeps between steps: K/V and the workspace (the causal states are in it)."""
        kept = []
        for entry in self.cross:
            if entry is not None:
                kept += [t for t in entry.values() if isinstance(t, Tensor)]
        return kept + self.workspace.tensors()

    def _buffer(self, name: str, *shape: int, dtype=None, returned: bool = False) -> Tensor:
        return self.workspace.take(name, shape, dtype or self.dtype, self.device, returned=returned)

    def step(self, prev_output_tokens: Tensor, incremental_state) -> Tuple[Tensor, dict]:
        decoder = self.decoder
        R = prev_output_tokens.size(0)
        if R != self.rows:
            raise RuntimeError(f"static decoding: {R} rows for a state of {self.rows} (reorder missing?)")
        C = decoder.embed_dim
        tokens = prev_output_tokens[:, -1]
        x = torch.index_select(decoder.embed_tokens.weight, 0, tokens, out=self._buffer("x", R, C))
        if decoder.embed_scale != 1.0:
            x.mul_(decoder.embed_scale)
        if decoder.embed_positions is not None:
            x.add_(decoder.embed_positions(prev_output_tokens, incremental_state=incremental_state)[:, -1])
        if decoder.layernorm_embedding is not None:
            _layer_norm(decoder.layernorm_embedding, x, None, x, self.decode_kernel)
        key_pad = tokens.eq(decoder.padding_idx)
        key_pad = key_pad if bool(key_pad.any()) else None

        attn_weights = None
        for i, (layer, plan) in enumerate(zip(decoder.layers, self.layers)):
            self._self_attention(i, layer, plan, x, key_pad)
            if layer.encoder_attn is not None and self.cross[i] is not None:
                weights = self._cross_attention(i, layer, x, need_weights=i == self.weights_layer)
                attn_weights = weights if weights is not None else attn_weights
            self._feed_forward(layer, x)
        self.order = None
        self.first = False
        self.step_index += 1

        if decoder.layer_norm is not None:
            _layer_norm(decoder.layer_norm, x, None, x, self.decode_kernel)
        out = decoder.output_projection
        logits = self._buffer("logits", R, out.weight.size(0), returned=True)
        if out.bias is not None:
            torch.addmm(out.bias, x, out.weight.t(), out=logits)
        else:
            torch.mm(x, out.weight.t(), out=logits)
        extra = {"attn": [attn_weights.unsqueeze(1) if attn_weights is not None else None], "inner_states": None,
                 "rfa_static": self}
        return logits.unsqueeze(1), extra

    def log_probs(self, logits: Tensor) -> Tensor:
        """log_softmax of this step's logits into the workspace (fairseq's get_normalized_probs)."""
        out = self._buffer("log_probs", *logits.shape, dtype=torch.float32, returned=True)
        return torch.log_softmax(logits, dim=-1, out=out)

    def _self_attention(self, i, layer, plan: CausalLayerPlan, x: Tensor, key_pad: Optional[Tensor]) -> None:
        R, C, H, d, F_ = x.size(0), plan.embed_dim, plan.num_heads, plan.head_dim, plan.features
        h = x if not layer.normalize_before else _layer_norm(layer.self_attn_layer_norm, x, None, self._buffer("h", R, C),
                                                            self.decode_kernel)
        proj = torch.addmm(plan.bias, h, plan.weight_t, out=self._buffer("proj", R, plan.bias.numel()))
        width = plan.q_width
        q, k = proj[:, :width], proj[:, width: 2 * width]
        if plan.linear_map:  # pre-activations W_phi (W x + b) + b_phi: the step applies the map's activation
            phi_q, phi_k, activation = q, k, plan.attn.phi.kind
        else:
            phi_q, phi_k, activation = *self._random_features(plan, q, k), None
        v = proj[:, plan.v_start: plan.v_start + C]
        gate = proj[:, plan.gate_start: plan.gate_start + H] if plan.attn.gate_proj is not None else None
        pair = self.states[i]  # rows only shrink: the first step's rows fit every later step
        state_in, order = (None, None) if self.first else (pair[self.current[i]], self.order)
        target = 1 - self.current[i]
        state_out = pair[target]
        attn = self._buffer("attn", R, C)
        causal_layer_step(phi_q, phi_k, v, gate, key_pad, state_in, order, state_out, attn, plan.attn.eps,
                          decode_kernel=self.decode_kernel, activation=activation)
        self.current[i] = target
        y = torch.addmm(_bias(plan.attn.out_proj, C), attn, plan.attn.out_proj.weight.t(), out=self._buffer("y", R, C))
        self._residual(layer, layer.self_attn_layer_norm, y, x)

    def _random_features(self, plan: CausalLayerPlan, q: Tensor, k: Tensor) -> Tuple[Tensor, Tensor]:
        """phi(q), phi(k) as (R, H * F) of a map without an affine first stage (random maps, elu)."""
        attn, R, H = plan.attn, q.size(0), plan.num_heads
        w = attn.random_matrix()
        heads = lambda t: t.reshape(R, H, 1, plan.head_dim)  # noqa: E731  (B, H, T = 1, d)
        return (attn.phi(heads(q), w, is_query=True).reshape(R, -1), attn.phi(heads(k), w, is_query=False).reshape(R, -1))

    def _cross_attention(self, i, layer, x: Tensor, need_weights: bool) -> Optional[Tensor]:
        R, C = x.shape
        cross, entry = layer.encoder_attn, self.cross[i]
        h = x if not layer.normalize_before else _layer_norm(layer.encoder_attn_layer_norm, x, None,
                                                            self._buffer("h", R, C), self.decode_kernel)
        q = torch.addmm(_bias(cross.q_proj, C), h, cross.q_proj.weight.t(), out=self._buffer("q", R, C))
        attn = self._buffer("attn", R, C)
        weights = None
        if "rfa_state" in entry:
            H = cross.num_heads
            state = entry["rfa_state"]  # (n, H, F, d + 1)
            phi_q = cross._phi(q.unsqueeze(0), cross.random_matrix(), is_query=True)  # (R, H, 1, F)
            n, beam = state.size(0), self.beam
            grouped = phi_q.view(n, beam, H, 1, -1).transpose(1, 2).reshape(n, H, beam, -1)
            out, _ = noncausal_rfa(grouped, None, None, state=state, eps=cross.eps)  # (n, H, beam, d)
            attn.view(n, beam, H, -1).copy_(out.transpose(1, 2))
        else:
            if need_weights:
                weights = self._buffer("cross_weights", R, entry["key"].size(2))
            softmax_cross_step(q, entry["key"], entry["value"], entry["key_bias"], self.beam, entry["scaling"], attn,
                               weights, decode_kernel=self.decode_kernel)
        y = torch.addmm(_bias(cross.out_proj, C), attn, cross.out_proj.weight.t(), out=self._buffer("y", R, C))
        self._residual(layer, layer.encoder_attn_layer_norm, y, x)
        return weights

    def _feed_forward(self, layer, x: Tensor) -> None:
        R, C = x.shape
        h = x if not layer.normalize_before else _layer_norm(layer.final_layer_norm, x, None, self._buffer("h", R, C),
                                                            self.decode_kernel)
        hidden = torch.addmm(layer.fc1.bias, h, layer.fc1.weight.t(), out=self._buffer("ffn", R, layer.fc1.out_features))
        if layer.activation_fn is F.relu:
            hidden.relu_()
        else:
            hidden.copy_(layer.activation_fn(hidden))
        y = torch.addmm(layer.fc2.bias, hidden, layer.fc2.weight.t(), out=self._buffer("y", R, C))
        self._residual(layer, layer.final_layer_norm, y, x)

    def _residual(self, layer, norm, y: Tensor, x: Tensor) -> None:
        """x <- x + y, then the layer norm when the layer normalizes after (post-norm)."""
        if layer.normalize_before:
            x.add_(y)
        else:
            _layer_norm(norm, y, x, x, self.decode_kernel)


def _layer_norm(norm, x: Tensor, residual: Optional[Tensor], out: Tensor, decode_kernel: str) -> Tensor:
    return add_layer_norm(x, residual, norm.weight, norm.bias, norm.eps, out, decode_kernel=decode_kernel)
