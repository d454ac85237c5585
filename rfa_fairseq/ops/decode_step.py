"""The kernels of one decoding step, chosen once per batch: `step_kernels(decode_kernel, device, dtype)`.

    kernels.causal_layer_step(phi_q, phi_k, v, gate_logits, key_pad, state_in, order, state_out, out, eps, activation)
        phi_q, phi_k: (R, H * F), or with activation = "hedgehog" / "relu" the map's pre-activations
                      p = W x + b (R, H * D), turned into features in the step (feature_maps.activate_learned)
        v: (R, H * d)   gate_logits: (R, H) or None   key_pad: (R,) bool or None
        state_in: (R0, H, F, d + 1) fp32 or None (first step)   order: (R,) rows of state_in, or None (row r reads row r)
        state_out: (>= R, H, F, d + 1) fp32, not state_in   out: (R, H * d)
        S' = g * state_in[order] + (1 - g) phi_k (x) [v, 1];  out = (phi_q . S')[:d] / max((phi_q . S')[d], eps)
        (g = sigmoid(gate logit); g = 1 and no new term for a padded key; no gate: g = 1, 1 - g -> 1)
    kernels.softmax_cross_step(q, key, value, key_bias, beam, scaling, out, weights)
        q: (R, H * d) rows n * beam .. n * beam + beam - 1 read sentence n   key, value: (N, H, S, d)
        key_bias: (N, S) (0 or -inf) or None   out: (R, H * d)   weights: (R, S) head-averaged, or None
    kernels.add_layer_norm(x, residual, weight, bias, eps, out) -> LayerNorm(x + residual) (residual may be
        None): in out (the C++ kernels; out may be x or residual) or a tensor of its own (torch): use what it returns
    kernels.pack_linear(weight, bias) -> packed: a (O, I) weight and (O,) bias (or None) prepared once for `linear`
    kernels.linear(x, packed, out, activation=None, residual=None) -> y = act(x W^T + b) + residual
        x: (R, I)   out: (R, O), where the torch kernel writes y (oneDNN returns y in a tensor of its own)
        activation: None or "relu"   residual: (R, O) or None
    kernels.beam_candidates(lprobs, prev_scores, beam, scores_out, indices_out): beam search's candidates
        lprobs: (N * beam, V) fp32   prev_scores: (N * beam,) each row's score so far, or None at the first step
        (a sentence's beams are then one hypothesis: only its first row counts)   scores_out, indices_out: (N, k)
        <- per sentence the k largest prev_scores[row] + lprobs[row, v] (NaN counting as -inf), best first, and
        their flat indices b * V + v (b: the beam within the sentence)

`StepKernels` declares that interface; a kernel set is the step's own operations (`TorchStepOps` on every
device and dtype, states and accumulations in fp32; `CppStepOps`, the C++ kernels of csrc/, on the CPU in fp32)
joined with a linear-layer library (`TorchLinear`: torch's addmm; `OneDNNLinear`: oneDNN on weights packed
once, torch's mkldnn ops, 2.05-2.29x torch's MKL addmm on the step's shapes on a 2-core AMD EPYC,
benchmarks/benchmark_gemm.py; `OneDNNInt8Linear`: oneDNN's int8 product, --rfa-decode-precision int8). `step_kernels` is the one choice of a set, for the decoder's step and the
encoder's inference alike; no set falls back to another inside a call. The torch operations are what the C++
kernels are tested against, beside ops/naive.py's recurrence. No kernel reads a value back to the host, so a step
can be queued (or captured) as a whole; the kernels write into buffers their caller allocated once (the int8
linear layers also allocate their quantized input at each call).
"""
import math
from typing import Optional, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import torch_internals
from .extension import load_fused_extension, require_fused_extension
from .feature_maps import activate_learned_pair

DECODE_KERNELS = ("auto", "torch", "cpp")  # --rfa-decode-kernel
DECODE_PRECISIONS = ("fp32", "int8")  # --rfa-decode-precision


def cpp_can_run(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the C++ kernels serve this device and dtype (the CPU in fp32), built or not."""
    return torch.device(device).type == "cpu" and dtype == torch.float32


def step_kernels(decode_kernel: str, device: torch.device, dtype: torch.dtype, precision: str = "fp32") -> "StepKernels":
    """The kernels of the decoding step and of the encoder's inference for --rfa-decode-kernel and
    --rfa-decode-precision (validated by RFAConfig) and the model's device and dtype: auto = the C++ kernels on
    the CPU in fp32 when their module loads (linear layers in oneDNN where torch has it), torch otherwise;
    cpp = the C++ kernels, an error where they cannot run; torch = torch. precision int8: the C++ kernels with
    int8 linear layers (oneDNN), an error naming why where they cannot run."""
    if precision == "int8":
        return _int8_kernels(decode_kernel, device, dtype)
    if decode_kernel == "torch":
        return TORCH_KERNELS
    native = cpp_can_run(device, dtype)
    if decode_kernel == "cpp":
        if not native:
            raise ValueError(f"--rfa-decode-kernel cpp: the C++ decoding step runs on the CPU in fp32, not on "
                             f"{torch.device(device).type} in {dtype}; use auto or torch")
        ext = require_fused_extension()
    else:
        ext = load_fused_extension() if native else None
        if ext is None:
            return TORCH_KERNELS
    return CppOneDNNKernels(ext) if torch_internals.onednn_linear_available() else CppKernels(ext)


def _int8_kernels(decode_kernel: str, device: torch.device, dtype: torch.dtype) -> "CppOneDNNInt8Kernels":
    where = f"{torch.device(device).type} in {dtype}"
    if not cpp_can_run(device, dtype):
        raise ValueError(f"--rfa-decode-precision int8: the int8 decoding step runs on the CPU in fp32 weights, not on "
                         f"{where}; use fp32 there")
    if decode_kernel == "torch":
        raise ValueError("--rfa-decode-precision int8 needs the C++ kernels (they quantize the activations): drop "
                         "--rfa-decode-kernel torch")
    if not torch_internals.onednn_int8_linear_available():
        raise ValueError(f"--rfa-decode-precision int8: torch {torch.__version__} has no oneDNN int8 linear ops "
                         f"(torch.ops.onednn.qlinear_*); use fp32")
    return CppOneDNNInt8Kernels(require_fused_extension())


class StepKernels(Protocol):
    """The interface of a kernel set (module docstring); one instance serves a batch's steps."""

    name: str  # the step's own operations: "cpp" or "torch"
    gemm: str  # the linear layers' library, as the log names it

    def causal_layer_step(self, phi_q: Tensor, phi_k: Tensor, v: Tensor, gate_logits: Optional[Tensor],
                          key_pad: Optional[Tensor], state_in: Optional[Tensor], order: Optional[Tensor],
                          state_out: Tensor, out: Tensor, eps: float, activation: Optional[str] = None) -> Tensor: ...

    def softmax_cross_step(self, q: Tensor, key: Tensor, value: Tensor, key_bias: Optional[Tensor], beam: int,
                           scaling: float, out: Tensor, weights: Optional[Tensor] = None) -> Tensor: ...

    def add_layer_norm(self, x: Tensor, residual: Optional[Tensor], weight: Tensor, bias: Tensor, eps: float,
                       out: Tensor) -> Tensor: ...

    def beam_candidates(self, lprobs: Tensor, prev_scores: Optional[Tensor], beam: int, scores_out: Tensor,
                        indices_out: Tensor) -> None: ...

    def pack_linear(self, weight: Tensor, bias: Optional[Tensor]): ...

    def linear(self, x: Tensor, packed, out: Tensor, activation: Optional[str] = None,
               residual: Optional[Tensor] = None) -> Tensor: ...


class TorchStepOps:
    """The step's own operations in torch: any device and dtype."""

    @staticmethod
    def causal_layer_step(phi_q: Tensor, phi_k: Tensor, v: Tensor, gate_logits: Optional[Tensor],
                          key_pad: Optional[Tensor], state_in: Optional[Tensor], order: Optional[Tensor],
                          state_out: Tensor, out: Tensor, eps: float, activation: Optional[str] = None) -> Tensor:
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
        torch.div(acc[..., :d], acc[..., d:].clamp_min(eps), out=out.view(R, H, d))
        return out

    @staticmethod
    def softmax_cross_step(q: Tensor, key: Tensor, value: Tensor, key_bias: Optional[Tensor], beam: int,
                           scaling: float, out: Tensor, weights: Optional[Tensor] = None) -> Tensor:
        N, H, S, d = key.shape
        R = q.size(0)
        if weights is None and R % beam == 0 and q.is_cuda:
            # on a GPU, where each operation is a kernel launch: the sentence's beams as one query block, one fused
            # attention over its K/V. Elsewhere the operations below (bf16 on the CPU: SDPA would round otherwise)
            n = R // beam
            query = q.view(n, beam, H, d).transpose(1, 2)  # (n, H, beam, d)
            mask = key_bias[:n].view(n, 1, 1, S) if key_bias is not None else None
            o = F.scaled_dot_product_attention(query, key[:n], value[:n], attn_mask=mask, scale=scaling)
            out.view(n, beam, H, d).copy_(o.transpose(1, 2))
            return out
        rows = torch.arange(R, device=q.device) // beam  # the sentence each row reads
        qh = (q * scaling).view(R, H, 1, d)
        scores = torch.matmul(qh, key[rows].transpose(-1, -2)).squeeze(-2).float()  # (R, H, S)
        if key_bias is not None:
            scores = scores + key_bias[rows].unsqueeze(1)
        probs = torch.softmax(scores, dim=-1)
        out.view(R, H, d).copy_(torch.matmul(probs.to(value.dtype).unsqueeze(-2), value[rows]).squeeze(-2))
        if weights is not None:
            weights.copy_(probs.mean(dim=1))
        return out

    @staticmethod
    def add_layer_norm(x: Tensor, residual: Optional[Tensor], weight: Tensor, bias: Tensor, eps: float,
                       out: Tensor) -> Tensor:
        y = x if residual is None else x + residual
        return F.layer_norm(y, (y.size(-1),), weight, bias, eps)  # not copied into out: a kernel less

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


class TorchLinear:
    """Linear layers in torch (addmm on the weight's transposed view): any device and dtype."""

    @staticmethod
    def pack_linear(weight: Tensor, bias: Optional[Tensor]):
        return weight.t(), bias  # addmm reads the transposed view in place

    @staticmethod
    def linear(x: Tensor, packed, out: Tensor, activation: Optional[str] = None,
               residual: Optional[Tensor] = None) -> Tensor:
        weight_t, bias = packed
        if bias is not None:
            torch.addmm(bias, x, weight_t, out=out)
        else:
            torch.mm(x, weight_t, out=out)
        if activation == "relu":
            out.relu_()
        if residual is not None:
            out.add_(residual)
        return out


class TorchKernels(TorchStepOps, TorchLinear):
    """Everything in torch: any device and dtype (CUDA's kernels)."""

    name = "torch"
    gemm = "torch addmm"


TORCH_KERNELS = TorchKernels()
_NONE = torch.empty(0)  # the C++ kernels' "absent" argument


class CppStepOps:
    """The step's own operations in C++ (csrc/rfa_decode_step.cpp, one module): the CPU in fp32."""

    name = "cpp"

    def __init__(self, ext):
        self.ext = ext

    def causal_layer_step(self, phi_q, phi_k, v, gate_logits, key_pad, state_in, order, state_out, out, eps,
                          activation=None):
        self.ext.causal_layer_step(phi_q, phi_k, v, _or_none(gate_logits), _or_none(key_pad), _or_none(state_in),
                                   _or_none(order), state_out, out, eps, self.ext.activations[activation or "features"])
        return out

    def softmax_cross_step(self, q, key, value, key_bias, beam, scaling, out, weights=None):
        self.ext.softmax_cross_step(q, key, value, _or_none(key_bias), beam, scaling, out, _or_none(weights))
        return out

    def add_layer_norm(self, x, residual, weight, bias, eps, out):
        self.ext.add_layer_norm(x, _or_none(residual), weight, bias, eps, out)
        return out

    def beam_candidates(self, lprobs, prev_scores, beam, scores_out, indices_out):
        self.ext.beam_candidates(lprobs, _or_none(prev_scores), beam, scores_out, indices_out)


class OneDNNLinear:
    """Linear layers in oneDNN on weights packed once (torch's mkldnn ops, through torch_internals): the CPU
    in fp32, where torch has them (torch_internals.onednn_linear_available)."""

    @staticmethod
    def pack_linear(weight, bias):
        # the batch size only hints the packed layout; any number of rows runs on it
        return torch_internals.onednn_pack_linear_weight(weight, ONEDNN_ROWS_HINT), bias

    @staticmethod
    def linear(x, packed, out, activation=None, residual=None):
        weight, bias = packed  # oneDNN returns y in a tensor of its own: `out` is not written
        if residual is not None and activation is None:
            return torch_internals.onednn_linear_add(x, residual, weight, bias)
        y = torch_internals.onednn_linear(x, weight, bias, activation)
        return y if residual is None else y.add_(residual)


class OneDNNInt8Linear:
    """Linear layers in int8 on oneDNN (torch's x86 int8 ops, through torch_internals): each weight row quantized
    once to int8 codes and a scale (symmetric, per output channel); each input row quantized at each call to
    7-bit codes and a scale of its own (symmetric; 7 bits: x86 without VNNI sums pairs of u8 x s8 products in
    int16), in C++ (quantize_rows); oneDNN's product accumulated in int32 and written in fp32 with the weights'
    scales; then, in one C++ pass, each row's own scale, the bias, relu and the residual (scale_rows). The CPU
    in fp32 weights."""

    @staticmethod
    def pack_linear(weight, bias):
        w = weight.detach().float()
        scales = (w.abs().amax(dim=1) / 127.0).clamp_min(torch.finfo(torch.float32).tiny)  # (O,)
        codes = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
        packed = torch_internals.onednn_int8_pack_linear_weight(codes, ONEDNN_ROWS_HINT)
        zero_points = torch.zeros(w.size(0), dtype=torch.int32)  # symmetric
        return packed, scales, zero_points, _NONE if bias is None else bias.detach().float().contiguous()

    def linear(self, x, packed, out, activation=None, residual=None):
        weight, scales, zero_points, bias = packed  # `out` is not written: the product comes in a tensor of its own
        codes = torch.empty(x.shape, dtype=torch.uint8)
        row_scales = torch.empty(x.size(0))
        self.ext.quantize_rows(x, codes, row_scales)
        y = torch_internals.onednn_int8_linear(codes, 1.0, self.ext.int8_row_zero_point, weight, scales, zero_points)
        self.ext.scale_rows(y, row_scales, bias, _or_none(residual), activation == "relu")
        return y


class CppKernels(CppStepOps, TorchLinear):
    """The C++ step with torch's linear layers (a torch without oneDNN)."""

    gemm = "torch addmm"


class CppOneDNNKernels(CppStepOps, OneDNNLinear):
    """The C++ step with oneDNN's linear layers: the CPU's fastest fp32 set."""

    gemm = "oneDNN (packed weights)"


class CppOneDNNInt8Kernels(CppStepOps, OneDNNInt8Linear):
    """The C++ step with oneDNN's int8 linear layers (--rfa-decode-precision int8)."""

    gemm = "oneDNN int8 (per-channel weights, per-row 7-bit activations)"


ONEDNN_ROWS_HINT = 64  # rows of a typical step (batch x beam) for oneDNN's weight layout


def _or_none(t: Optional[Tensor]) -> Tensor:
    return _NONE if t is None else t
