"""The decoding step's operations in torch, one call each, on every device and dtype (states and accumulations in
fp32): `TorchKernels`, the reference kernel set. The decoding records' `step` methods (modules/decoding.py) run them
one by one: on the CPU as the reference (--rfa-decode-kernel torch, bf16), on CUDA inside the step's graph (with the
causal update in Triton: gpu/step.py). The native CPU step (cpu/native.py) computes the same function. The one choice
of a kernel set is kernel_choice.step_kernels. The interface every kernel set has:

    kernels.causal_layer_step(phi_q, phi_k, v, gate_logits, key_pad, state_in, order, state_out, eps, activation)
        -> out (R, H * d)
        phi_q, phi_k: (R, H * F), or with activation = "hedgehog" / "relu" the map's pre-activations
                      p = W x + b (R, H * D), turned into features in the step (feature_maps.activate_learned)
        v: (R, H * d)   gate_logits: (R, H) or None   key_pad: (R,) bool or None
        state_in: (R0, H, F, d + 1) fp32 or None (first step)   order: (R,) rows of state_in, or None (row r reads row r)
        state_out: (>= R, H, F, d + 1) fp32, not state_in, written
        S' = g * state_in[order] + (1 - g) phi_k (x) [v, 1];  out = (phi_q . S')[:d] / max((phi_q . S')[d], eps)
        (g = sigmoid(gate logit); g = 1 and no new term for a padded key; no gate: g = 1, 1 - g -> 1)
    kernels.softmax_cross_step(q, key, value, key_bias, beam, scaling, need_weights) -> (out (R, H * d), weights)
        q: (R, H * d) rows n * beam .. n * beam + beam - 1 read sentence n   key, value: (N, H, S, d)
        key_bias: (N, S) (0 or -inf) or None   weights: (R, S) head-averaged, or None (not needed)
    kernels.add_layer_norm(x, residual, weight, bias, eps) -> LayerNorm(x + residual) (residual may be None)
    kernels.pack_linear(weight, bias, sources=()) -> packed: a (O, I) weight and (O,) bias (or None) prepared once
        for `linear`; sources: the module's tensors the weight was computed from (a fused or folded projection), which
        a library that keeps its own copy no longer needs resident
    kernels.release_packed_sources(): a runtime's weights are all packed (a library with its own copy gives the
        module's pages back that packing read)
    kernels.linear(x, packed, activation=None, residual=None) -> y = act(x W^T + b) + residual
        x: (R, I)   activation: None or "relu"   residual: (R, O) or None
    kernels.select_outputs(packed, ids, size, take=None) -> packed: the output rows `ids` (U,) of a packed layer as a
        layer of their own (a vocabulary shortlist's output projection, once per batch); rows from `size` on pad it
        (CUDA graphs of nearby sizes) and score -inf. take(name, shape, dtype): buffers to write into, kept at their
        addresses across batches (a graph reads them there), else new tensors
    kernels.beam_candidates(lprobs, prev_scores, beam, scores_out, indices_out): beam search's candidates
        lprobs: (N * beam, V) fp32   prev_scores: (N * beam,) each row's score so far, or None at the first step
        (a sentence's beams are then one hypothesis: only its first row counts)   scores_out, indices_out: (N, k)
        <- per sentence the k largest prev_scores[row] + lprobs[row, v] (NaN counting as -inf), best first, and
        their flat indices b * V + v (b: the beam within the sentence)

Linear layers travel as `PackedLinear`, a layer prepared once for a library (`TorchLinear` here: addmm on the weight's
transposed view). No kernel reads a value back to the host, so a torch step can be queued (or captured) as a whole.
"""
import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .feature_maps import activate_learned_pair


class TorchKernels:
    """The step's operations in torch, one call each: any device and dtype (module docstring)."""

    name = "torch"
    gemm = "torch addmm"
    native = False
    state_dtype = torch.float32  # the causal layers' state

    @staticmethod
    def causal_layer_step(phi_q: Tensor, phi_k: Tensor, v: Tensor, gate_logits: Optional[Tensor],
                          key_pad: Optional[Tensor], state_in: Optional[Tensor], order: Optional[Tensor],
                          state_out: Tensor, eps: float, activation: Optional[str] = None) -> Tensor:
        # few, whole-tensor operations: on a GPU each is a kernel launch (or a node of the step's graph) costing
        # more than its arithmetic at decoding's row counts
        _, H, F_, D1 = state_out.shape
        R = v.size(0)
        d = D1 - 1
        if activation is not None:
            q, k = activate_learned_pair(phi_q.reshape(R, H, -1), phi_k.reshape(R, H, -1), activation)  # (R, H, F) fp32
        else:
            q, k = phi_q.reshape(R, H, F_).float(), phi_k.reshape(R, H, F_).float()
        decay = None
        if gate_logits is not None:
            logits = gate_logits.float()
            decay = torch.sigmoid(logits)  # (R, H)
            k = k * torch.sigmoid(-logits).unsqueeze(-1)
        if key_pad is not None:
            k = k.masked_fill(key_pad.view(R, 1, 1), 0.0)
            if decay is not None:
                decay = decay.masked_fill(key_pad.view(R, 1), 1.0)
        new = state_out[:R]  # (R, H, F, d + 1): the new term k (x) [v, 1], then the state carried over
        torch.mul(k.unsqueeze(-1), v.reshape(R, H, 1, d), out=new[..., :d])
        new[..., d].copy_(k)
        if state_in is not None:
            previous = state_in.index_select(0, order) if order is not None else state_in[:R]
            if decay is None:
                new.add_(previous)
            else:
                new.addcmul_(previous, decay[..., None, None])
        acc = torch.matmul(q.unsqueeze(-2), new).squeeze(-2)  # (R, H, d + 1)
        return (acc[..., :d] / acc[..., d:].clamp_min(eps)).reshape(R, H * d).to(v.dtype)

    @staticmethod
    def softmax_cross_step(q: Tensor, key: Tensor, value: Tensor, key_bias: Optional[Tensor], beam: int,
                           scaling: float, need_weights: bool = False):
        N, H, S, d = key.shape
        R = q.size(0)
        if not need_weights and R % beam == 0 and q.is_cuda:
            # on a GPU, where each operation is a kernel launch: the sentence's beams as one query block, one fused
            # attention over its K/V. Elsewhere the operations below (bf16 on the CPU: SDPA would round otherwise)
            n = R // beam
            query = q.view(n, beam, H, d).transpose(1, 2)  # (n, H, beam, d)
            mask = key_bias[:n].view(n, 1, 1, S) if key_bias is not None else None
            o = F.scaled_dot_product_attention(query, key[:n], value[:n], attn_mask=mask, scale=scaling)
            return o.transpose(1, 2).reshape(R, H * d), None
        rows = torch.arange(R, device=q.device) // beam  # the sentence each row reads
        qh = (q * scaling).view(R, H, 1, d)
        scores = torch.matmul(qh, key[rows].transpose(-1, -2)).squeeze(-2).float()  # (R, H, S)
        if key_bias is not None:
            scores = scores + key_bias[rows].unsqueeze(1)
        probs = torch.softmax(scores, dim=-1)
        out = torch.matmul(probs.to(value.dtype).unsqueeze(-2), value[rows]).squeeze(-2).reshape(R, H * d)
        return out, (probs.mean(dim=1) if need_weights else None)

    @staticmethod
    def add_layer_norm(x: Tensor, residual: Optional[Tensor], weight: Tensor, bias: Tensor, eps: float) -> Tensor:
        y = x if residual is None else x + residual
        return F.layer_norm(y, (y.size(-1),), weight, bias, eps)

    @staticmethod
    def beam_candidates(lprobs: Tensor, prev_scores: Optional[Tensor], beam: int, scores_out: Tensor,
                        indices_out: Tensor) -> None:
        N, k = scores_out.shape
        V = lprobs.size(1)
        lprobs = lprobs.nan_to_num(nan=-math.inf, posinf=math.inf, neginf=-math.inf).view(N, beam, V)
        if prev_scores is None:
            totals = lprobs[:, 0, :]  # (N, V)
        else:
            totals = (lprobs + prev_scores.view(N, beam, 1)).view(N, -1)  # (N, beam * V)
        torch.topk(totals, k=k, out=(scores_out, indices_out))

    @staticmethod
    def pack_linear(weight: Tensor, bias: Optional[Tensor], sources=()):
        return TorchLinear.pack_linear(weight, bias)

    @staticmethod
    def release_packed_sources() -> None:
        """Nothing: the torch step reads the module's own weights (they stay where they are)."""

    @staticmethod
    def select_outputs(packed, ids: Tensor, size: int, take=None):
        return TorchLinear.select_outputs(packed, ids, size, take)

    @staticmethod
    def linear(x: Tensor, packed, activation: Optional[str] = None, residual: Optional[Tensor] = None) -> Tensor:
        return TorchLinear.linear(x, packed, activation, residual)


@dataclass
class PackedLinear:
    """A linear layer prepared once for a library (`pack_linear`); the native program reads these fields by name."""

    weight: Tensor  # torch: (O, I); the native libraries: the level's blocks of the weight (fp32) or of its int8 codes
    bias: Optional[Tensor]  # (O,) fp32, or None
    in_features: int
    out_features: int
    w_scales: Optional[Tensor] = None  # int8: per output channel
    w_sums: Optional[Tensor] = None  # int8: (O rounded up to a block,) the zero point x each channel's code sum


class TorchLinear:
    """Linear layers in torch (addmm on the weight's transposed view, the module's own tensor): any device and dtype."""

    label = "torch addmm"

    @staticmethod
    def pack_linear(weight: Tensor, bias: Optional[Tensor]) -> PackedLinear:
        return PackedLinear(weight.detach(), None if bias is None else bias.detach(), weight.size(1), weight.size(0))

    @staticmethod
    def select_outputs(packed: PackedLinear, ids: Tensor, size: int, take=None) -> PackedLinear:
        """The rows `ids` of the layer's (O, I) weight and bias; rows from `size` on score -inf (a bias of -inf, so
        whether a batch pads or not, layers of one shape compute alike: a bias wherever one pads)."""
        weight = packed.weight
        rows = ids.numel()
        if take is None:
            take = lambda name, shape, dtype: torch.empty(shape, dtype=dtype, device=weight.device)  # noqa: E731
        out = torch.index_select(weight, 0, ids, out=take("output_weight", (rows, weight.size(1)), weight.dtype))
        bias = None
        if packed.bias is not None or size < rows:
            bias = take("output_bias", (rows,), weight.dtype)
            if packed.bias is not None:
                torch.index_select(packed.bias, 0, ids, out=bias)
            else:
                bias.zero_()
            bias[size:] = -math.inf
        return PackedLinear(out, bias, weight.size(1), rows)

    @staticmethod
    def linear(x: Tensor, packed: PackedLinear, activation: Optional[str] = None,
               residual: Optional[Tensor] = None) -> Tensor:
        weight_t = packed.weight.t()
        y = torch.addmm(packed.bias, x, weight_t) if packed.bias is not None else torch.mm(x, weight_t)
        if activation == "relu":
            y.relu_()
        if residual is not None:
            y.add_(residual)
        return y


TORCH_KERNELS = TorchKernels()
