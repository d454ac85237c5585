// The native runtime's linear layers (linear_layers.cpp): one dispatch of a linear layer for the decoding program's
// steps and the encoder program, in fp32 or int8 (Python picks: cpu/native.py), on the runtime's instruction-set level
// (cpu_kernels.h).
//
// Each weight is kept once, in the level's blocks (levels/level_kernels.cpp: blocks of the level's vector width of
// output channels, all of a block's inputs contiguous; int8 as codes with a scale per output channel), and every product
// runs on the level's kernels, a sentence's beam (a few rows) and a batch (hundreds) alike. Packing reads the module's
// weight once, in chunks, and can give each chunk's pages back to the system as it goes (release_source: a weight mapped
// from its checkpoint file, which only a fallback path reads again).
#pragma once
#include <pybind11/pybind11.h>
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

#include <string>
#include <vector>

#include "cpu_kernels.h"
#include "records.h"

// The linear layers' precision, decided in Python (kernel_choice.step_kernels): fp32 weights, or int8 codes (the
// inputs quantized per row at each product).
enum Precision : int64_t { kPrecisionFp32 = 0, kPrecisionInt8 = 1 };

struct LinearLayer {  // ops/step.py's PackedLinear
  at::Tensor weight;    // fp32: (blocks, I, block); int8: (blocks, ceil(I / 4), block, 4) codes
  at::Tensor bias;      // (O,) fp32 or undefined
  at::Tensor w_scales;  // int8: (O,) each output channel's scale
  at::Tensor w_sums;    // int8: (blocks * block,) the activations' zero point x each channel's sum of codes
  int64_t in_features = 0, out_features = 0;
  static LinearLayer from(const Record& record);
};

class LinearLibrary {
 public:
  // precision: "fp32" or "int8"; cpu_isa: the cap on the instruction-set level (cpu_kernels.h's resolve_level: "auto" or
  // a level's name)
  LinearLibrary(const std::string& precision, const std::string& cpu_isa);
  // act(x W^T + b) + residual (residual undefined: none), `part` naming it for torch's profiler (a region of the
  // step's profile); unrecorded: the same outside the step (the encoder's inference, a batch's start). out: a
  // contiguous (R, O) fp32 tensor the result is written into (the caller's reused buffer), or undefined: a new one
  at::Tensor linear(const LinearLayer& layer, const at::Tensor& x, bool relu, const at::Tensor& residual,
                    const char* part = "rfa::linear", const at::Tensor& out = at::Tensor()) const;
  at::Tensor unrecorded_linear(const LinearLayer& layer, const at::Tensor& x, bool relu,
                               const at::Tensor& residual, const at::Tensor& out = at::Tensor()) const;
  Precision precision() const { return precision_; }
  const rfa::cpu::Kernels& kernels() const { return *kernels_; }

  // A weight (O, I) fp32 in the level's blocks -> (ceil(O / block), I, block). int8: the weight quantized per output
  // channel (scale = max |w| / 127, codes round(w / scale), half to even, as torch.round) -> {the codes' blocks
  // (ceil(O / block), ceil(I / 4), block, 4), zero point x each channel's code sum, the scales (O,)}. release_source:
  // each chunk of the weight's rows is given back to the system once packed (madvise MADV_PAGEOUT: a file-backed
  // page is dropped, a written one kept), for a weight mapped from a file.
  at::Tensor pack_fp32(const at::Tensor& weight, bool release_source) const;
  std::vector<at::Tensor> pack_int8(const at::Tensor& weight, bool release_source) const;
  // The output channels `ids` (U,) int64 of a layer packed by this library, as a layer of U outputs of its own (a
  // vocabulary shortlist's output projection, made once per batch): each channel's inputs copied from its block into
  // the new blocks (fp32 values; int8 codes, zero point x code sums and scales), its bias entry. A channel's products
  // are computed as in the whole layer (the same inputs in the same order): the same values.
  LinearLayer select_outputs(const LinearLayer& layer, const at::Tensor& ids) const;
  // the product itself (tests, benchmarks): y = act(x W^T + b) + residual on the layer's fp32 blocks, or on its int8
  // blocks from quantize_rows' codes and row scales
  void linear_fp32(const LinearLayer& layer, const at::Tensor& x, const at::Tensor& residual, bool relu,
                   const at::Tensor& y) const;
  void linear_int8(const LinearLayer& layer, const at::Tensor& codes, const at::Tensor& row_scales,
                   const at::Tensor& residual, bool relu, const at::Tensor& y) const;

 private:
  // the layer's blocks are this level's for in_features inputs and this precision (else an error naming them)
  void check_blocks(const LinearLayer& layer, int64_t in_features) const;
  // the int8 product of fp32 rows x, quantized into the calling thread's scratch
  at::Tensor linear_int8_of(const LinearLayer& layer, const at::Tensor& x, const at::Tensor& residual, bool relu,
                            const at::Tensor& out) const;
  Precision precision_;
  const rfa::cpu::Kernels* kernels_;
};

void bind_linear_layers(pybind11::module_& m);
