"""The native CPU step's kernel set (`NativeKernels`): the whole step one native call of the decoding program
(cpu/csrc/decode_program.cpp), built once per runtime from the decoding records (read by name), with the C++ linear
layers (cpu/csrc/linear_layers.cpp) in fp32 or int8 (--rfa-decode-precision): each weight kept once, in the blocks of
the CPU kernels' instruction-set level (cpu/csrc/cpu_kernels.h: avx2, avx512, avx512_vnni, neon, ...; --rfa-cpu-isa
caps it), every product on that level's kernels. The C++ LinearLibrary runs them for the program's steps and for the
encoder's inference (`NativeKernels.linear`, once per batch from Python). One NativeKernels per (precision, state,
level) in a process: the encoder and the decoder share it.

A weight mapped from its checkpoint file (fairseq_compat's loading maps it; file_mappings) is packed in chunks, each
chunk's pages given back to the system once packed: the process then holds the packed copy alone, and the module's
parameter stays file-backed for the paths that read it (the torch step, training), which fault in what they read.
"""
import functools
import threading

import torch
from torch import Tensor

from ..file_mappings import FileMappings
from ..ops.step import PackedLinear

PRECISIONS = ("fp32", "int8")


@functools.lru_cache(maxsize=None)
def native_kernels(ext, precision: str, state_dtype: torch.dtype, cpu_isa: str) -> "NativeKernels":
    """The native kernel set of a precision, state dtype and --rfa-cpu-isa: one per process (the encoder's and the
    decoder's runtimes share its C++ library)."""
    return NativeKernels(ext, precision, state_dtype, cpu_isa)


class NativeKernels:
    """The native step (csrc/decode_program.cpp) with the C++ linear layers in `precision` (fp32 weights, or int8
    codes with a scale per output channel, the inputs quantized per row at each product to 7-bit codes with a scale of
    their own): the CPU in fp32 weights. The C++ LinearLibrary runs on the instruction-set level --rfa-cpu-isa allows
    (`level`); `pack_linear` puts a weight in its blocks, `linear` (the encoder's inference) and the program's steps run
    its products, the one dispatch of a linear layer; `beam_candidates` is the C++ kernel of the torch search's
    candidates (the search CUDA runs, here where a test runs it beside the native search on the same logits)."""

    name = "cpp"
    native = True

    def __init__(self, ext, precision: str, state_dtype: torch.dtype, cpu_isa: str = "auto"):
        if precision not in PRECISIONS:
            raise ValueError(f"the native linear layers' precision is one of {PRECISIONS}, got {precision!r}")
        self.ext = ext
        self.precision = precision
        # the causal layers' state between steps: fp16 (read widened, each step's arithmetic in fp32, stored rounded:
        # half the bytes of a batch's largest memory traffic), or fp32 (the torch step's results to the bit)
        self.state_dtype = state_dtype
        self.library = ext.LinearLibrary(precision, cpu_isa)
        self._lock = threading.Lock()
        self._released = []  # the file ranges packed weights were read from, since the last release_packed_sources
        self.level = self.library.level
        self.gemm = (f"fp32 on the {self.level} kernels" if precision == "fp32" else
                     f"int8 on the {self.level} kernels (per-channel weights, per-row 7-bit activations)")

    def pack_linear(self, weight: Tensor, bias, sources=()) -> PackedLinear:
        """`weight` (O, I) and `bias` (O,) or None in the library's blocks. sources: the module's tensors the weight was
        computed from (a fused projection); theirs and the weight's pages are given back once packed where they are
        a file's mapping."""
        mappings = FileMappings.now()
        w = weight.detach().float()
        if w.stride(-1) != 1:
            w = w.contiguous()
        release = mappings.holds(w)
        # the bias copied (read at every product: in a checkpoint's mapping it would map the pages around it again)
        bias = None if bias is None else bias.detach().float().clone()
        if self.precision == "fp32":
            packed = PackedLinear(self.library.pack_fp32(w, release), bias, w.size(1), w.size(0))
        else:
            blocks, sums, scales = self.library.pack_int8(w, release)
            packed = PackedLinear(blocks, bias, w.size(1), w.size(0), w_scales=scales, w_sums=sums)
        # every file page the packed weight was made from, in whole units of the system's cache (the chunks released
        # while packing leave the units they cover in part)
        for source in {id(t): t for t in (w, weight, *sources)}.values():
            span = mappings.release_range(source)
            if span is not None:
                self.ext.release_pages(span[0], span[1] - span[0])
                with self._lock:
                    self._released.append(span)
        return packed

    def release_packed_sources(self) -> None:
        """The file pages of every weight packed since the last call, given back once more: reading a weight maps the
        pages around each page it reads (the system's fault-around), those of the weights packed before it among them.
        A runtime calls this once its weights are packed."""
        with self._lock:
            spans, self._released = self._released, []
        for begin, end in sorted(set(spans)):
            self.ext.release_pages(begin, end - begin)

    def select_outputs(self, packed: PackedLinear, ids: Tensor, size: int, take=None) -> PackedLinear:
        """The output channels `ids` of a packed layer in blocks of their own (the C++ LinearLibrary gathers them:
        fp32 values, or int8 codes, sums and scales), each channel's product the whole layer's. No padding here (the
        native search decodes any number of columns): size is ids' length."""
        if size != ids.numel():
            raise ValueError(f"the native output projection takes no padding columns: {ids.numel()} ids, {size} real")
        weight, bias, scales, sums = self.library.select_outputs(packed, ids.contiguous())
        return PackedLinear(weight, bias, packed.in_features, ids.numel(), w_scales=scales, w_sums=sums)

    def linear(self, x: Tensor, packed: PackedLinear, activation=None, residual=None) -> Tensor:
        return self.library.linear(packed, x, activation == "relu", residual)

    def new_program(self, runtime):
        """The native program of a DecodingRuntime (modules/decoding.py), read from its records."""
        return self.ext.DecodeProgram(runtime, self.library)

    def beam_candidates(self, lprobs, prev_scores, beam, scores_out, indices_out):
        self.ext.beam_candidates(lprobs, prev_scores, beam, scores_out, indices_out, self.level)
