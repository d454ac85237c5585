// The one C++ module: the decoding step's kernels (rfa_decode_step.cpp, bound for the tests that compare them with
// the torch step) and the native program (decode_program.cpp). Absent tensors are None.
#include <pybind11/stl.h>
#include <torch/extension.h>

#include <optional>
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

namespace {

using Optional = std::optional<torch::Tensor>;
torch::Tensor given(const Optional& t) { return t.has_value() ? *t : torch::Tensor(); }

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.def(
      "causal_layer_step",
      [](const torch::Tensor& phi_q, const torch::Tensor& phi_k, const torch::Tensor& v, const Optional& gate_logits,
         const Optional& key_pad, const Optional& state_in, const Optional& order, const torch::Tensor& state_out,
         const torch::Tensor& out, double eps, const std::string& activation, const Optional& sigma,
         const Optional& matrix) {
        causal_layer_step(phi_q, phi_k, v, given(gate_logits), given(key_pad), given(state_in), given(order), state_out,
                          out, eps, activation_code(activation), given(sigma), given(matrix));
      },
      "causal RFA layer step: feature map (activation: 'features' or the map's kind), gate, reorder, update, read-out");
  m.def(
      "softmax_cross_step",
      [](const torch::Tensor& q, const torch::Tensor& key, const torch::Tensor& value, const Optional& key_bias,
         int64_t beam, double scaling, const torch::Tensor& out, const Optional& weights) {
        softmax_cross_step(q, key, value, given(key_bias), beam, scaling, out, given(weights));
      },
      "softmax cross-attention step over per-sentence K, V");
  m.def(
      "add_layer_norm",
      [](const torch::Tensor& x, const Optional& residual, const torch::Tensor& gamma, const torch::Tensor& beta,
         double eps, const torch::Tensor& out) { add_layer_norm(x, given(residual), gamma, beta, eps, out); },
      "out = LayerNorm(x + residual)");
  m.def(
      "beam_candidates",
      [](const torch::Tensor& lprobs, const Optional& prev_scores, int64_t beam, const torch::Tensor& scores_out,
         const torch::Tensor& indices_out) { beam_candidates(lprobs, given(prev_scores), beam, scores_out, indices_out); },
      "beam search: the k best (score so far + log-probability) per sentence");
  m.def(
      "rfa_cross_step",
      [](const torch::Tensor& q, const torch::Tensor& cross_state, int64_t beam, double eps,
         const std::string& activation, const Optional& sigma, const Optional& matrix, const torch::Tensor& out) {
        rfa_cross_step(q, cross_state, beam, eps, activation_code(activation), given(sigma), given(matrix), out);
      },
      "RFA cross-attention step: phi(q) . S over per-sentence states");
  m.def(
      "row_log_sum_exp",
      [](const torch::Tensor& x) {
        TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous(),
                    "row_log_sum_exp: x must be a contiguous (rows, n) fp32 CPU tensor");
        const int64_t rows = x.size(0), n = x.size(1);
        torch::Tensor max = torch::empty({rows}, x.options()), log_sum = torch::empty({rows}, x.options());
        for (int64_t r = 0; r < rows; ++r) {
          row_log_sum_exp(x.data_ptr<float>() + r * n, n, max.data_ptr<float>() + r, log_sum.data_ptr<float>() + r);
        }
        return std::make_tuple(max, log_sum);
      },
      "the search step's log-softmax of each row: (max, log(sum(exp(x - max))))");
  m.def("quantize_rows", &quantize_rows, "int8 linear input: 7-bit codes round(x / s) + 64, s = the row's max |x| / 63");
  m.def(
      "scale_rows",
      [](const torch::Tensor& y, const torch::Tensor& scales, const Optional& bias, const Optional& residual, bool relu) {
        scale_rows(y, scales, given(bias), given(residual), relu);
      },
      "int8 linear output, in place: y * the row's scale + bias, relu, + residual");
  m.def("few_rows_available", &few_rows_available, py::arg("int8"),
        "whether this CPU runs the few-rows linear layers (AVX-512; int8: with VNNI)");
  m.def("few_rows_pack_fp32", &few_rows_pack_fp32, "an fp32 weight (O, I) in the few-rows kernel's blocks");
  m.def("few_rows_pack_int8", &few_rows_pack_int8, "int8 codes (O, I) -> [the few-rows kernel's blocks, zero-point sums]");
  m.def(
      "few_rows_linear_fp32",
      [](const torch::Tensor& x, const torch::Tensor& weight, const Optional& bias, const Optional& residual, bool relu,
         const torch::Tensor& y) { few_rows_linear_fp32(x, weight, given(bias), given(residual), relu, y); },
      "y = act(x W^T + b) + residual on few_rows_pack_fp32's blocks");
  m.def(
      "few_rows_linear_int8",
      [](const torch::Tensor& codes, const torch::Tensor& row_scales, const torch::Tensor& weight,
         const torch::Tensor& sums, const torch::Tensor& w_scales, const Optional& bias, const Optional& residual,
         bool relu, const torch::Tensor& y) {
        few_rows_linear_int8(codes, row_scales, weight, sums, w_scales, given(bias), given(residual), relu, y);
      },
      "int8 y = act(x W^T + b) + residual from quantize_rows' codes on few_rows_pack_int8's blocks");
  m.attr("int8_row_zero_point") = kInt8RowZeroPoint;
  m.attr("activations") = activation_names();  // the names causal_layer_step and rfa_cross_step take
  bind_decode_program(m);
  bind_encoder_program(m);
  m.attr("build_hash") = RFA_STRINGIFY(RFA_BUILD_HASH);
}
