"""The native CPU step's kernel set (`NativeKernels`): the whole step one native call of the decoding program
(cpu/csrc/decode_program.cpp), built once per runtime from the decoding records (read by name), with a linear-layer
library whose weights the records hold packed (`PackedLinear`): `OneDNNLinear` (oneDNN on weights packed once,
torch's mkldnn ops, 2.05-2.29x torch's MKL addmm on the step's shapes on a 2-core AMD EPYC, benchmarks/benchmark_gemm.py),
`OneDNNInt8Linear` (oneDNN's int8 product, --rfa-decode-precision int8) or ops/step.py's `TorchLinear` (a torch without
oneDNN). The C++ LinearLibrary runs them all, for the program's steps and for the encoder's inference
(`NativeKernels.linear`, once per batch from Python). Its kernels run on one instruction-set level of the CPU
(cpu/csrc/cpu_kernels.h: avx2, avx512, avx512_vnni, neon, ...; --rfa-cpu-isa caps it), the oneDNN libraries' products of
few rows on that level's few-rows kernels up to a number of rows measured on the machine (cpu/few_rows_limits.py). One
NativeKernels per (library, state, level) in a process: the encoder and the decoder share it.
"""
import functools
from typing import Optional

import torch
from torch import Tensor

from .. import torch_internals
from ..ops.step import PackedLinear
from . import few_rows_limits
from .isa import note_runtime_level


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
    is below the CPU's best, cpu/isa.py); `pack_linear` is the library's, with the few-rows limit of
    each new shape measured (or read from the machine's record: few_rows_limits); `linear` (the encoder's inference) and
    the program's steps run the C++ LinearLibrary, the one dispatch of a linear layer by library; `beam_candidates` is
    the C++ kernel of the torch search's candidates (the search CUDA runs, here where a test runs it beside the native
    search on the same logits)."""

    name = "cpp"
    native = True

    def __init__(self, ext, library_class, state_dtype: torch.dtype, cpu_isa: str = "auto"):
        self.ext = ext
        # the causal layers' state between steps: fp16 (read widened, each step's arithmetic in fp32, stored rounded:
        # half the bytes of a batch's largest memory traffic), or fp32 (the torch step's results to the bit)
        self.state_dtype = state_dtype
        self.library = ext.LinearLibrary(library_class.code, torch_internals.onednn_operators(), cpu_isa)
        self.level = self.library.level
        note_runtime_level(self.level, capped=self.level != ext.select_cpu_level("auto"))
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


ONEDNN_ROWS_HINT = 64  # rows of a typical step (batch x beam) for oneDNN's weight layout
