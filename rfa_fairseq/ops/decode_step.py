"""The kernels of one decoding step, chosen once per batch: `step_kernels(decode_kernel, device, dtype, precision,
state=...)`.

Two kinds of kernel set, one choice:

- `TorchKernels`: the step's operations in torch on every device and dtype (states and accumulations in fp32),
  run one by one by the decoding records' `step` methods (modules/decoding.py): the reference, the CUDA path
  (where the static beam search captures them as one graph) and bf16 on the CPU. Their interface:

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
    kernels.pack_linear(weight, bias) -> packed: a (O, I) weight and (O,) bias (or None) prepared once for `linear`
    kernels.linear(x, packed, activation=None, residual=None) -> y = act(x W^T + b) + residual
        x: (R, I)   activation: None or "relu"   residual: (R, O) or None
    kernels.beam_candidates(lprobs, prev_scores, beam, scores_out, indices_out): beam search's candidates
        lprobs: (N * beam, V) fp32   prev_scores: (N * beam,) each row's score so far, or None at the first step
        (a sentence's beams are then one hypothesis: only its first row counts)   scores_out, indices_out: (N, k)
        <- per sentence the k largest prev_scores[row] + lprobs[row, v] (NaN counting as -inf), best first, and
        their flat indices b * V + v (b: the beam within the sentence)

- `TritonKernels` (CUDA, where Triton imports): TorchKernels with the causal layer's step in one Triton launch
  (triton_step.py) instead of 16 torch kernels; the step's CUDA graph has that many fewer nodes per layer.

- `NativeKernels` (the CPU in fp32 weights, where the C++ module loads): the whole step is one native call of the
  decoding program (csrc/decode_program.cpp), built once per runtime from the same records (read by name), with a
  linear-layer library whose weights the records hold packed (`PackedLinear`): `OneDNNLinear` (oneDNN on weights
  packed once, torch's mkldnn ops, 2.05-2.29x torch's MKL addmm on the step's shapes on a 2-core AMD EPYC,
  benchmarks/benchmark_gemm.py), `OneDNNInt8Linear` (oneDNN's int8 product, --rfa-decode-precision int8) or
  `TorchLinear` (a torch without oneDNN). The C++ LinearLibrary runs them all, for the program's steps and for the
  encoder's inference (`NativeKernels.linear`, once per batch from Python). Its kernels run on one instruction-set
  level of the CPU (csrc/cpu_kernels.h: avx2, avx512, avx512_vnni, neon, ...; --rfa-cpu-isa caps it), the oneDNN
  libraries' products of few rows on that level's few-rows kernels up to a number of rows measured on the machine
  (ops/few_rows_limits.py). One NativeKernels per (library, state, level) in a process: the encoder and the decoder
  share it.

No set falls back to another inside a call. The torch operations are what the C++ kernels are tested against,
beside ops/naive.py's recurrence. No kernel reads a value back to the host, so a torch step can be queued (or
captured) as a whole.
"""
import functools
import logging
import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import torch_internals
from . import cpu_isa as cpu_isa_module
from . import few_rows_limits
from .extension import load_fused_extension, require_fused_extension
from .feature_maps import activate_learned_pair
from .triton_support import kernels as triton_kernels
from .triton_support import triton_import_error

DECODE_KERNELS = ("auto", "torch", "cpp")  # --rfa-decode-kernel
DECODE_PRECISIONS = ("fp32", "int8")  # --rfa-decode-precision
DECODE_STATES = ("auto", "fp16", "fp32")  # --rfa-decode-state: the causal layers' state between steps
# --rfa-cpu-isa: the highest instruction-set level of the CPU kernels (csrc/cpu_kernels.h; the names of every
# architecture's levels: a name of another architecture's is an error where the runtime is built)
CPU_ISAS = ("auto", "default", "avx2", "avx512", "avx512_vnni", "neon", "neon_dotprod")

logger = logging.getLogger(__name__)


def cpp_can_run(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the native step serves this device and dtype (the CPU in fp32), built or not."""
    return torch.device(device).type == "cpu" and dtype == torch.float32


def step_kernels(decode_kernel: str, device: torch.device, dtype: torch.dtype, precision: str = "fp32",
                 native_unsupported: Optional[str] = None, state: str = "auto", cpu_isa: str = "auto"):
    """The kernels of the decoding step and of the encoder's inference for --rfa-decode-kernel and
    --rfa-decode-precision (validated by RFAConfig) and the model's device and dtype: auto = the native step on
    the CPU in fp32 when the C++ module loads (linear layers in oneDNN where torch has it), on CUDA the torch step
    with the causal layers' step in Triton (where Triton imports), torch otherwise;
    cpp = the native step, an error where it cannot run; torch = torch. precision int8: the native step with
    int8 linear layers (oneDNN), an error naming why where it cannot run. native_unsupported: what of the model the
    native program cannot run (RFATransformerDecoder._native_unsupported), which makes auto take torch.
    state (--rfa-decode-state): the causal layers' state kept in fp16 (auto: where the native step runs) or fp32.
    cpu_isa (--rfa-cpu-isa): the cap on the native kernels' instruction-set level."""
    kernels = _step_kernels(decode_kernel, device, dtype, precision, native_unsupported,
                            torch.float32 if state == "fp32" else torch.float16, cpu_isa)
    if state == "fp16" and not kernels.native:
        raise ValueError(f"--rfa-decode-state fp16 keeps the state in fp16 in the native step, which does not run here "
                         f"({kernels.name} step on {torch.device(device).type} in {dtype}); use auto or fp32")
    return kernels


def rfa_step_kernels(rfa, device: torch.device, dtype: torch.dtype, native_unsupported: Optional[str] = None):
    """step_kernels for a model's RFAConfig (its decoding options, read whole)."""
    return step_kernels(rfa.rfa_decode_kernel, device, dtype, rfa.rfa_decode_precision, native_unsupported,
                        getattr(rfa, "rfa_decode_state", "auto"), getattr(rfa, "rfa_cpu_isa", "auto"))


def _step_kernels(decode_kernel, device, dtype, precision, native_unsupported, state_dtype, cpu_isa):
    if precision == "int8":
        if native_unsupported is not None:
            raise ValueError(f"--rfa-decode-precision int8 runs the native step, which does not support "
                             f"{native_unsupported}; use fp32")
        return _int8_kernels(decode_kernel, device, dtype, state_dtype, cpu_isa)
    if decode_kernel == "torch":
        return TORCH_KERNELS
    if decode_kernel == "auto" and torch.device(device).type == "cuda" and dtype != torch.float64:
        return TRITON_KERNELS if triton_import_error() is None else TORCH_KERNELS
    if native_unsupported is not None:
        if decode_kernel == "cpp":
            raise ValueError(f"--rfa-decode-kernel cpp: the native decoding step does not support {native_unsupported}; "
                             "use auto or torch")
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
    return native_kernels(ext, OneDNNLinear if torch_internals.onednn_linear_available() else TorchLinear, state_dtype,
                          cpu_isa)


def _int8_kernels(decode_kernel: str, device: torch.device, dtype: torch.dtype, state_dtype: torch.dtype,
                  cpu_isa: str) -> "NativeKernels":
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
    ext = require_fused_extension()
    return native_kernels(ext, OneDNNInt8Linear, state_dtype, cpu_isa)


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
    def pack_linear(weight: Tensor, bias: Optional[Tensor]):
        return TorchLinear.pack_linear(weight, bias)

    @staticmethod
    def linear(x: Tensor, packed, activation: Optional[str] = None, residual: Optional[Tensor] = None) -> Tensor:
        return TorchLinear.linear(x, packed, activation, residual)


class TritonKernels(TorchKernels):
    """TorchKernels whose causal layer step is one Triton launch (triton_step.py): CUDA."""

    name = "triton"

    @staticmethod
    def causal_layer_step(phi_q, phi_k, v, gate_logits, key_pad, state_in, order, state_out, eps, activation=None):
        return triton_kernels("triton_step").causal_layer_step(phi_q, phi_k, v, gate_logits, key_pad, state_in, order,
                                                                state_out, eps, activation)


@dataclass
class PackedLinear:
    """A linear layer prepared once for a library (`pack_linear`); the native program reads these fields by name."""

    weight: Tensor  # torch: (O, I); oneDNN: packed; int8: packed int8 codes
    bias: Optional[Tensor]  # (O,) fp32, or None
    in_features: int
    out_features: int
    w_scales: Optional[Tensor] = None  # int8: per output channel
    w_zero_points: Optional[Tensor] = None
    rows_weight: Optional[Tensor] = None  # the level's few-rows blocks of the weight (oneDNN libraries), or None
    rows_sums: Optional[Tensor] = None  # int8 there: (O rounded up to a block,) int32, zero point x each channel's code sum


class TorchLinear:
    """Linear layers in torch (addmm on the weight's transposed view): any device and dtype. `native`: the C++ library
    that runs them in the native step (unused here: torch's addmm has no other layout)."""

    code = "torch"
    label = "torch addmm"

    def __init__(self, native=None):
        pass

    @staticmethod
    def pack_linear(weight: Tensor, bias: Optional[Tensor]) -> PackedLinear:
        return PackedLinear(weight.detach(), None if bias is None else bias.detach(), weight.size(1), weight.size(0))

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


class OneDNNLinear:
    """Linear layers in oneDNN on weights packed once (torch's mkldnn ops, called by the C++ LinearLibrary `native`):
    the CPU in fp32, where torch has them (torch_internals.onednn_linear_available). Each weight is also kept in the
    blocks of the library level's few-rows kernel, which the library runs for products of few rows (a sentence's beam),
    where oneDNN's call costs more than the arithmetic: up to a number of rows measured per shape (few_rows_limits)."""

    code = "onednn"

    def __init__(self, native):
        self.native = native
        self.label = f"oneDNN (packed weights) + {native.level} few rows"

    def pack_linear(self, weight: Tensor, bias: Optional[Tensor]) -> PackedLinear:
        # the batch size only hints the packed layout; any number of rows runs on it
        w = weight.detach()
        return PackedLinear(torch_internals.onednn_pack_linear_weight(w, ONEDNN_ROWS_HINT),
                            None if bias is None else bias.detach(), w.size(1), w.size(0),
                            rows_weight=self.native.pack_fp32(w))


class OneDNNInt8Linear:
    """Linear layers in int8 (called by the C++ LinearLibrary `native`): each weight row quantized once to int8 codes
    and a scale (symmetric, per output channel); each input row quantized at each call to 7-bit codes and a scale of its
    own (symmetric; 7 bits: x86 without VNNI sums pairs of u8 x s8 products in int16), in C++ (quantize_rows); the
    product accumulated in int32 and written in fp32 with the weights' scales; then, in one C++ pass, each row's own
    scale, the bias, relu and the residual (scale_rows). The product is oneDNN's (torch's x86 int8 ops), and for
    products of few rows the library level's few-rows kernel on the same codes in its own blocks (VNNI vpdpbusd, AVX2 /
    AVX-512 vpmaddubsw, NEON sdot: exact int32 sums, the same results), up to a number of rows measured per shape.
    The CPU in fp32 weights."""

    code = "onednn_int8"

    def __init__(self, native):
        self.native = native
        self.label = f"oneDNN int8 + {native.level} few rows (per-channel weights, per-row 7-bit activations)"

    def pack_linear(self, weight: Tensor, bias: Optional[Tensor]) -> PackedLinear:
        w = weight.detach().float()
        scales = (w.abs().amax(dim=1) / 127.0).clamp_min(torch.finfo(torch.float32).tiny)  # (O,)
        codes = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
        packed = torch_internals.onednn_int8_pack_linear_weight(codes, ONEDNN_ROWS_HINT)
        zero_points = torch.zeros(w.size(0), dtype=torch.int32)  # symmetric
        rows_weight, rows_sums = self.native.pack_int8(codes)
        return PackedLinear(packed, None if bias is None else bias.detach().float().contiguous(), w.size(1), w.size(0),
                            scales, zero_points, rows_weight, rows_sums)


@functools.lru_cache(maxsize=None)
def native_kernels(ext, library_class, state_dtype: torch.dtype, cpu_isa: str) -> "NativeKernels":
    """The native kernel set of a library, state dtype and --rfa-cpu-isa: one per process (the encoder's and the
    decoder's runtimes share its C++ library and the few-rows limits it has measured)."""
    return NativeKernels(ext, library_class, state_dtype, cpu_isa)


class NativeKernels:
    """The native step (csrc/decode_program.cpp) with a linear-layer library: the CPU in fp32 weights. Its C++
    LinearLibrary runs on the instruction-set level --rfa-cpu-isa allows (`level`; oneDNN capped to match where the cap
    is below the CPU's best, ops/cpu_isa.py); `pack_linear` is the library's, with the few-rows limit of
    each new shape measured (or read from the machine's record: few_rows_limits); `linear` (the encoder's inference) and
    the program's steps run the C++ LinearLibrary, the one dispatch of a linear layer by library; `beam_candidates` is
    the C++ kernel (the static beam search's steps that run in Python: prefix tokens, n-gram blocking)."""

    name = "cpp"
    native = True

    def __init__(self, ext, library_class, state_dtype: torch.dtype, cpu_isa: str = "auto"):
        self.ext = ext
        # the causal layers' state between steps: fp16 (read widened, each step's arithmetic in fp32, stored rounded:
        # half the bytes of a batch's largest memory traffic), or fp32 (the torch step's results to the bit)
        self.state_dtype = state_dtype
        self.library = ext.LinearLibrary(library_class.code, torch_internals.onednn_operators(), cpu_isa)
        self.level = self.library.level
        cpu_isa_module.note_runtime_level(self.level, capped=self.level != ext.select_cpu_level("auto"))
        self._packer = library_class(self.library)
        self.gemm = self._packer.label

    def pack_linear(self, weight: Tensor, bias: Optional[Tensor]) -> PackedLinear:
        packed = self._packer.pack_linear(weight, bias)
        if packed.rows_weight is not None:
            few_rows_limits.ensure_limit(self.library, self._packer.code, packed)
        return packed

    def linear(self, x: Tensor, packed: PackedLinear, activation: Optional[str] = None,
               residual: Optional[Tensor] = None) -> Tensor:
        return self.library.linear(packed, x, activation == "relu", residual)

    def new_program(self, runtime):
        """The native program of a DecodingRuntime (modules/decoding.py), read from its records."""
        return self.ext.DecodeProgram(runtime, self.library)

    def beam_candidates(self, lprobs, prev_scores, beam, scores_out, indices_out):
        self.ext.beam_candidates(lprobs, prev_scores, beam, scores_out, indices_out, self.level)


TORCH_KERNELS = TorchKernels()
TRITON_KERNELS = TritonKernels()
ONEDNN_ROWS_HINT = 64  # rows of a typical step (batch x beam) for oneDNN's weight layout
