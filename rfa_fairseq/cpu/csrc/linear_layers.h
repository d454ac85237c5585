// The native runtime's linear layers (linear_layers.cpp): one dispatch of a linear layer for the decoding program's
// steps and the encoder program, on the library Python picked (cpu/native.py) and the runtime's instruction-set
// level (cpu_kernels.h).
//
// A oneDNN library's weights are also kept in the blocks of its level's few-rows kernels, which it runs for products of
// few rows (a sentence's beam), where oneDNN's call costs more than the arithmetic: how many rows is measured on the
// machine, per level and product shape (time_products; cpu/few_rows_limits.py decides and keeps the
// limits), never taken from one machine's table.
#pragma once
#include <ATen/core/dispatch/Dispatcher.h>
#include <pybind11/pybind11.h>
#include <torch/extension.h>

#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "cpu_kernels.h"
#include "records.h"

// The linear layers' library, decided in Python (kernel_choice.step_kernels): torch's addmm, oneDNN on packed
// fp32 weights, oneDNN's int8 product.
enum Gemm : int64_t { kGemmTorch = 0, kGemmOneDNN = 1, kGemmOneDNNInt8 = 2 };

struct LinearLayer {  // ops/step.py's PackedLinear
  at::Tensor weight;                   // torch: (O, I); oneDNN: packed; int8: packed int8 codes
  at::Tensor bias;                     // (O,) or undefined
  at::Tensor w_scales, w_zero_points;  // int8: per output channel
  at::Tensor rows_weight, rows_sums;   // the few-rows kernel's blocks (pack_fp32 / pack_int8), or undefined
  int64_t in_features = 0, out_features = 0;
  static LinearLayer from(const Record& record);
};

class LinearLibrary {
 public:
  // gemm: "torch", "onednn" or "onednn_int8"; operators: torch_internals.onednn_operators() ({"linear": (name,
  // overload), "linear_add": ..., "qlinear": ...}), the torch operators a oneDNN library calls; cpu_isa: the cap on
  // the instruction-set level (cpu_kernels.h's resolve_level: "auto" or a level's name)
  LinearLibrary(const std::string& gemm, const pybind11::dict& operators, const std::string& cpu_isa);
  // act(x W^T + b) + residual (residual undefined: none), `part` naming it for torch's profiler (a region of the
  // step's profile); unrecorded: the same outside the step (the encoder's inference, a batch's start)
  at::Tensor linear(const LinearLayer& layer, const at::Tensor& x, bool relu, const at::Tensor& residual,
                    const char* part = "rfa::linear") const;
  at::Tensor unrecorded_linear(const LinearLayer& layer, const at::Tensor& x, bool relu,
                               const at::Tensor& residual) const;
  Gemm gemm() const { return gemm_; }
  const rfa::cpu::Kernels& kernels() const { return *kernels_; }

  // a weight in the level's few-rows blocks: fp32 (O, I) -> (ceil(O / block), I, block); int8 codes (O, I) ->
  // {(ceil(O / block), ceil(I / 4), block, 4) blocks, per-channel zero point x code sums}
  at::Tensor pack_fp32(const at::Tensor& weight) const;
  std::vector<at::Tensor> pack_int8(const at::Tensor& codes) const;
  // the few-rows kernel itself (tests, benchmarks): y = act(x W^T + b) + residual on the layer's blocks; int8 from
  // quantize_rows' codes and row scales
  void few_rows_fp32(const LinearLayer& layer, const at::Tensor& x, const at::Tensor& residual, bool relu,
                     const at::Tensor& y) const;
  void few_rows_int8(const LinearLayer& layer, const at::Tensor& codes, const at::Tensor& row_scales,
                     const at::Tensor& residual, bool relu, const at::Tensor& y) const;

  // the most rows the few-rows kernel takes on products of in_features -> out_features (none until set)
  void set_few_rows_limit(int64_t in_features, int64_t out_features, int64_t rows);
  std::optional<int64_t> few_rows_limit(int64_t in_features, int64_t out_features) const;
  // microseconds of one product of `rows` rows on the layer by the few-rows kernel and by the library's other path
  // (oneDNN), the best of `repeats` each after a warm-up, on one thread (the calling thread's teams restored after)
  std::pair<double, double> time_products(const LinearLayer& layer, int64_t rows, int64_t repeats) const;

 private:
  // the layer's int8 blocks, sums and scales are this level's for in_features inputs (else an error naming them)
  void check_int8_blocks(const LinearLayer& layer, int64_t in_features) const;
  // whether the few-rows kernel takes this product of rows x in_features (its measured limit)
  bool few_rows(const LinearLayer& layer, int64_t rows, int64_t in_features) const;
  // the few-rows int8 product of fp32 rows x, quantized into the calling thread's scratch
  at::Tensor few_rows_int8_of(const LinearLayer& layer, const at::Tensor& x, const at::Tensor& residual,
                              bool relu) const;
  // the product on a chosen path: the few-rows kernel (use_few_rows) or the library's other
  at::Tensor product(const LinearLayer& layer, const at::Tensor& x, bool relu, const at::Tensor& residual,
                     bool use_few_rows) const;
  Gemm gemm_;
  const rfa::cpu::Kernels* kernels_;
  std::optional<c10::OperatorHandle> linear_op_, linear_add_op_, qlinear_op_;
  mutable std::mutex limits_mutex_;
  std::map<std::pair<int64_t, int64_t>, int64_t> few_rows_limits_;  // (in, out) -> rows
};

void bind_linear_layers(pybind11::module_& m);
