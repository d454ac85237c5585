// The one C++ module: the CPU kernels' levels (cpu_kernels.h), the decoding step's kernels on tensors
// (step_kernels.h, bound with the level they run on for the tests that compare every level with the torch step), the
// linear layers (linear_layers.h), the decoder's and the encoder's programs. Absent tensors are None.
// The sources include ATen and torch's pybind11 casters, never torch/extension.h: the C++ frontend it adds (torch::nn,
// optim, data) is most of a file's compile time, and nothing here uses it.
#include <ATen/ATen.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <optional>
#include <stdexcept>
#include <string>

#include "cpu_kernels.h"
#include "decode_program.h"
#include "encoder_program.h"
#include "linear_layers.h"
#include "step_kernels.h"

// Both builds (setup.py ahead of time, torch's JIT load) pass -DRFA_BUILD_HASH=<hash of the sources,
// flags and torch version> as a bare token; rfa_fairseq/cpu/extension.py refuses a prebuilt module
// whose build_hash is not that of the current sources (stale).
#ifndef RFA_BUILD_HASH
#error "RFA_BUILD_HASH is not defined: build through setup.py or rfa_fairseq/cpu/extension.py"
#endif
#define RFA_STRINGIFY_(x) #x
#define RFA_STRINGIFY(x) RFA_STRINGIFY_(x)

namespace {

using Optional = std::optional<at::Tensor>;

// a level's kernels by name (resolve_level's: "auto", the best this CPU runs), or a ValueError: not a level of this
// architecture, or one this CPU does not run (the tests name a level to run exactly that level's kernels)
const rfa::cpu::Kernels& kernels_named(const std::string& level) {
  try {
    const rfa::cpu::Level resolved = rfa::cpu::resolve_level(level);
    TORCH_CHECK_VALUE(level == "auto" || level == rfa::cpu::level_name(resolved),
                      "rfa cpu kernels: this CPU does not run the '", level, "' level (its best at most that is ",
                      rfa::cpu::level_name(resolved), ")");
    return rfa::cpu::kernels(resolved);
  } catch (const std::invalid_argument& error) {
    TORCH_CHECK_VALUE(false, error.what());
  }
}

std::vector<std::string> names_of(const std::vector<rfa::cpu::Level>& levels) {
  std::vector<std::string> names;
  for (rfa::cpu::Level level : levels) names.emplace_back(rfa::cpu::level_name(level));
  return names;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.def(
      "cpu_levels", []() { return names_of(rfa::cpu::architecture_levels()); },
      "this architecture's instruction-set levels, lowest first (what --rfa-cpu-isa may name)");
  m.def(
      "runnable_cpu_levels", []() { return names_of(rfa::cpu::runnable_levels()); },
      "the levels this CPU runs, lowest first");
  m.def(
      "select_cpu_level",
      [](const std::string& cap) {
        try {
          return std::string(rfa::cpu::level_name(rfa::cpu::resolve_level(cap)));
        } catch (const std::invalid_argument& error) {
          TORCH_CHECK_VALUE(false, error.what());
        }
      },
      py::arg("cap"), "the level a runtime capped at `cap` ('auto' or a level's name) runs on");
  m.def(
      "causal_layer_step",
      [](const at::Tensor& phi_q, const at::Tensor& phi_k, const at::Tensor& v, const Optional& gate_logits,
         const Optional& key_pad, const Optional& state_in, const Optional& order, const at::Tensor& state_out,
         const at::Tensor& out, double eps, const std::string& activation, const Optional& sigma,
         const Optional& matrix, const std::string& level, const Optional& state_rows, int64_t group) {
        causal_layer_step(phi_q, phi_k, v, or_undefined(gate_logits), or_undefined(key_pad), or_undefined(state_in),
                          or_undefined(order), state_out, out, eps, activation_code(activation), or_undefined(sigma),
                          or_undefined(matrix), kernels_named(level), or_undefined(state_rows), group);
      },
      py::arg("phi_q"), py::arg("phi_k"), py::arg("v"), py::arg("gate_logits"), py::arg("key_pad"),
      py::arg("state_in"), py::arg("order"), py::arg("state_out"), py::arg("out"), py::arg("eps"),
      py::arg("activation"), py::arg("sigma"), py::arg("matrix"), py::arg("level") = "auto",
      py::arg("state_rows") = py::none(), py::arg("group") = 0,
      "causal RFA layer step: feature map (activation: 'features' or the map's kind), gate, reorder, update, read-out");
  m.def(
      "softmax_cross_step",
      [](const at::Tensor& q, const at::Tensor& key, const at::Tensor& value, const Optional& key_bias,
         int64_t beam, double scaling, const at::Tensor& out, const Optional& weights, const std::string& level) {
        softmax_cross_step(q, key, value, or_undefined(key_bias), beam, scaling, out, or_undefined(weights),
                           kernels_named(level));
      },
      py::arg("q"), py::arg("key"), py::arg("value"), py::arg("key_bias"), py::arg("beam"), py::arg("scaling"),
      py::arg("out"), py::arg("weights"), py::arg("level") = "auto",
      "softmax cross-attention step over per-sentence K, V");
  m.def(
      "add_layer_norm",
      [](const at::Tensor& x, const Optional& residual, const at::Tensor& gamma, const at::Tensor& beta,
         double eps, const at::Tensor& out, const std::string& level) {
        add_layer_norm(x, or_undefined(residual), gamma, beta, eps, out, kernels_named(level));
      },
      py::arg("x"), py::arg("residual"), py::arg("gamma"), py::arg("beta"), py::arg("eps"), py::arg("out"),
      py::arg("level") = "auto", "out = LayerNorm(x + residual)");
  m.def(
      "beam_candidates",
      [](const at::Tensor& lprobs, const Optional& prev_scores, int64_t beam, const at::Tensor& scores_out,
         const at::Tensor& indices_out, const std::string& level) {
        beam_candidates(lprobs, or_undefined(prev_scores), beam, scores_out, indices_out, kernels_named(level));
      },
      py::arg("lprobs"), py::arg("prev_scores"), py::arg("beam"), py::arg("scores_out"), py::arg("indices_out"),
      py::arg("level") = "auto", "beam search: the k best (score so far + log-probability) per sentence");
  m.def(
      "rfa_cross_step",
      [](const at::Tensor& q, const at::Tensor& cross_state, int64_t beam, double eps,
         const std::string& activation, const Optional& sigma, const Optional& matrix, const at::Tensor& out,
         const std::string& level) {
        rfa_cross_step(q, cross_state, beam, eps, activation_code(activation), or_undefined(sigma),
                       or_undefined(matrix), out, kernels_named(level));
      },
      py::arg("q"), py::arg("cross_state"), py::arg("beam"), py::arg("eps"), py::arg("activation"), py::arg("sigma"),
      py::arg("matrix"), py::arg("out"), py::arg("level") = "auto",
      "RFA cross-attention step: phi(q) . S over per-sentence states");
  m.def(
      "row_log_sum_exp",
      [](const at::Tensor& x, const std::string& level) {
        TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
                    "row_log_sum_exp: x must be a contiguous (rows, n) fp32 CPU tensor");
        const rfa::cpu::Kernels& kernels = kernels_named(level);
        const int64_t rows = x.size(0), n = x.size(1);
        at::Tensor max = at::empty({rows}, x.options()), log_sum = at::empty({rows}, x.options());
        for (int64_t r = 0; r < rows; ++r) {
          kernels.row_log_sum_exp(x.data_ptr<float>() + r * n, n, max.data_ptr<float>() + r,
                                  log_sum.data_ptr<float>() + r);
        }
        return std::make_tuple(max, log_sum);
      },
      py::arg("x"), py::arg("level") = "auto",
      "the search step's log-softmax of each row: (max, log(sum(exp(x - max))))");
  m.def(
      "exp",
      [](const at::Tensor& x, const std::string& level) {
        TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.is_contiguous(),
                    "exp: x must be a contiguous fp32 CPU tensor");
        at::Tensor y = x.clone();
        kernels_named(level).exp_inplace(y.data_ptr<float>(), y.numel());
        return y;
      },
      py::arg("x"), py::arg("level") = "auto", "the kernels' exp of every element (a polynomial, about 1 ulp)");
  m.def(
      "quantize_rows",
      [](const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, const std::string& level) {
        quantize_rows(x, codes, scales, kernels_named(level));
      },
      py::arg("x"), py::arg("codes"), py::arg("scales"), py::arg("level") = "auto",
      "int8 linear input: 7-bit codes round(x / s) + 64, s = the row's max |x| / 63");
  m.attr("int8_row_zero_point") = rfa::cpu::kInt8RowZeroPoint;
  m.attr("activations") = activation_names();  // the names causal_layer_step and rfa_cross_step take
  bind_linear_layers(m);
  bind_decode_program(m);
  bind_encoder_program(m);
  m.attr("build_hash") = RFA_STRINGIFY(RFA_BUILD_HASH);
}
