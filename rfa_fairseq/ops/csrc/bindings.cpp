// The one C++ module: the decoding step's kernels (rfa_decode_step.cpp) and the activation codes.
#include <pybind11/stl.h>
#include <torch/extension.h>

#include <map>
#include <string>

#include "decode_program.h"
#include "rfa_kernels.h"

// Both builds (setup.py ahead of time, torch's JIT load) pass -DRFA_BUILD_HASH=<hash of the sources,
// flags and torch version> as a bare token; rfa_fairseq/ops/extension.py refuses a prebuilt module
// whose build_hash is not that of the current sources (stale).
#ifndef RFA_BUILD_HASH
#error "RFA_BUILD_HASH is not defined: build through setup.py or rfa_fairseq/ops/extension.py"
#endif
#define RFA_STRINGIFY_(x) #x
#define RFA_STRINGIFY(x) RFA_STRINGIFY_(x)

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("causal_layer_step", &causal_layer_step, "causal RFA layer step: feature map, gate, reorder, update, read-out");
  m.def("softmax_cross_step", &softmax_cross_step, "softmax cross-attention step over per-sentence K, V");
  m.def("add_layer_norm", &add_layer_norm, "out = LayerNorm(x + residual)");
  m.def("beam_candidates", &beam_candidates, "beam search: the k best (score so far + log-probability) per sentence");
  m.def("rfa_cross_step", &rfa_cross_step, "RFA cross-attention step: phi(q) . S over per-sentence states");
  m.def("quantize_rows", &quantize_rows, "int8 linear input: 7-bit codes round(x / s) + 64, s = the row's max |x| / 63");
  m.def("scale_rows", &scale_rows, "int8 linear output, in place: y * the row's scale + bias, relu, + residual");
  m.attr("int8_row_zero_point") = kInt8RowZeroPoint;
  // causal_layer_step's `activation` codes by feature-map activation (None in Python: "features")
  m.attr("activations") = std::map<std::string, int64_t>{
      {"features", kFeatures}, {"hedgehog", kHedgehog}, {"relu", kReLU}, {"sincos", kSinCos}, {"arccos", kArcCos},
      {"positive", kPositive}, {"elu", kELU}};
  m.attr("gemms") = std::map<std::string, int64_t>{{"torch", kGemmTorch}, {"onednn", kGemmOneDNN},
                                                   {"onednn_int8", kGemmOneDNNInt8}};
  m.attr("cross_kinds") = std::map<std::string, int64_t>{{"none", kCrossNone}, {"softmax", kCrossSoftmax},
                                                         {"rfa", kCrossRFA}};
  m.attr("ffn_activations") = std::map<std::string, int64_t>{{"relu", kFFNReLU}, {"gelu", kFFNGELU}};
  bind_decode_program(m);
  m.attr("build_hash") = RFA_STRINGIFY(RFA_BUILD_HASH);
}
