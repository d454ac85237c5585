// One causal RFA decoding step on CPU, fused: beam reorder + (gated) state update + read-out
// in a single pass over the state (one read, one write). The unfused torch path
// (index_select, mul_, baddbmm_, bmm) passes over it four to five times, and at MT batch
// sizes this state traffic is a large part of a decoding step.
//
// For every row b and head h (rows and heads in parallel on torch's thread pool):
//   src          = order[b]                 (b when order is empty: no reorder)
//   S'[b, h]     = g[b, h] * S[src, h] + phi_k[b, h] (x) [v[b, h], 1]      (g = 1 when ungated)
//   acc          = phi_q[b, h] . S'[b, h]                                   (d + 1 values)
//   out[b, h]    = acc[:d] / max(acc[d], eps)
// The Python wrapper (fused_step.py) decides when this applies (CPU, fp32, no autograd) and passes
// contiguous inputs; row counts are checked here. Reference: ops/rfa.py
// causal_rfa_recurrent applied to S[order].
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "rfa_kernels.h"

namespace {

// One (row, head): S' = g * S + k (x) [v, 1] over F rows of D1 = d + 1 columns, acc = q . S'.
// Pointers never alias (new_state is always a different buffer), so the inner loop vectorizes;
// RFA_SIMD_CLONES adds an AVX2/FMA build chosen at load time on CPUs that have it.
RFA_SIMD_CLONES
void update_and_read_out(const float* __restrict__ s_in, float* __restrict__ s_out, const float* __restrict__ q,
                         const float* __restrict__ k, const float* __restrict__ v_aug, float g, int64_t F,
                         int64_t D1, float* __restrict__ acc) {
  for (int64_t j = 0; j < D1; ++j) acc[j] = 0.0f;
  for (int64_t f = 0; f < F; ++f) {
    const float kf = k[f], qf = q[f];
    const float* __restrict__ row_in = s_in + f * D1;
    float* __restrict__ row_out = s_out + f * D1;
    for (int64_t j = 0; j < D1; ++j) {
      const float s = g * row_in[j] + kf * v_aug[j];
      row_out[j] = s;
      acc[j] += qf * s;
    }
  }
}

}  // namespace

torch::Tensor decode_step(const torch::Tensor& state,      // (B0, H, F, d + 1) fp32, contiguous
                          const torch::Tensor& order,      // (B,) int64, or empty: row b reads row b
                          const torch::Tensor& phi_q,      // (B, H, F) fp32
                          const torch::Tensor& phi_k,      // (B, H, F) fp32, gate and padding folded in
                          const torch::Tensor& v,          // (B, H, d) fp32
                          const torch::Tensor& decay,      // (B, H) fp32 = exp(log_gate), or empty
                          torch::Tensor& new_state,        // (B, H, F, d + 1) fp32, never `state` itself
                          double eps) {
  const int64_t B0 = state.size(0), H = phi_q.size(1), F = phi_q.size(2), B = phi_q.size(0);
  const int64_t D1 = state.size(3), D = D1 - 1;
  TORCH_CHECK(new_state.data_ptr<float>() != state.data_ptr<float>(), "rfa decode_step: new_state must not be state");
  const bool reorder = order.numel() > 0;
  const int64_t* ord = reorder ? order.data_ptr<int64_t>() : nullptr;
  if (reorder) {
    for (int64_t b = 0; b < B; ++b) {
      TORCH_CHECK(ord[b] >= 0 && ord[b] < B0, "rfa decode_step: order[", b, "] = ", ord[b],
                  " is out of range for a state of ", B0, " rows");
    }
  } else {
    TORCH_CHECK(B0 == B, "rfa decode_step: state has ", B0, " rows for a batch of ", B);
  }
  auto out = torch::empty({B, H, D}, phi_q.options());
  const float* s_in_all = state.data_ptr<float>();
  float* s_out_all = new_state.data_ptr<float>();
  const float* q_all = phi_q.data_ptr<float>();
  const float* k_all = phi_k.data_ptr<float>();
  const float* v_all = v.data_ptr<float>();
  const float* g_all = decay.numel() > 0 ? decay.data_ptr<float>() : nullptr;
  float* o_all = out.data_ptr<float>();
  const float eps_f = static_cast<float>(eps);

  // rows x heads on torch's OpenMP pool (the extension is compiled with -fopenmp and resolves
  // libgomp.so.1 to the copy torch already loaded)
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(D1), v_aug(D1);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / H, h = bh % H;
      const int64_t src = reorder ? ord[b] : b;
      std::copy(v_all + bh * D, v_all + bh * D + D, v_aug.begin());
      v_aug[D] = 1.0f;  // the ones column accumulates z
      update_and_read_out(s_in_all + (src * H + h) * F * D1, s_out_all + bh * F * D1, q_all + bh * F,
                          k_all + bh * F, v_aug.data(), g_all ? g_all[bh] : 1.0f, F, D1, acc.data());
      const float den = std::max(acc[D], eps_f);
      float* o = o_all + bh * D;
      for (int64_t j = 0; j < D; ++j) o[j] = acc[j] / den;
    }
  });
  return out;
}

// Both builds (setup.py ahead of time, torch's JIT load) pass -DRFA_BUILD_HASH=<hash of the sources,
// flags and torch version> as a bare token; rfa_fairseq/ops/extension.py refuses a prebuilt module
// whose build_hash is not that of the current sources (stale).
#ifndef RFA_BUILD_HASH
#error "RFA_BUILD_HASH is not defined: build through setup.py or rfa_fairseq/ops/extension.py"
#endif
#define RFA_STRINGIFY_(x) #x
#define RFA_STRINGIFY(x) RFA_STRINGIFY_(x)

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_step", &decode_step, "fused causal RFA decoding step (reorder + update + read-out)");
  // the static decoding step's kernels (rfa_static_step.cpp)
  m.def("causal_layer_step", &causal_layer_step, "causal RFA layer step: feature map, gate, reorder, update, read-out");
  m.def("softmax_cross_step", &softmax_cross_step, "softmax cross-attention step over per-sentence K, V");
  m.def("add_layer_norm", &add_layer_norm, "out = LayerNorm(x + residual)");
  m.attr("build_hash") = RFA_STRINGIFY(RFA_BUILD_HASH);
}
