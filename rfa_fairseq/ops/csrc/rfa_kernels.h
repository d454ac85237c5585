// Declarations of the decoding step's kernels (rfa_decode_step.cpp), bound in bindings.cpp: one module.
#pragma once
#include <torch/extension.h>

#include <algorithm>
#include <limits>
#include <string>
#include <vector>

// An AVX2 + FMA build of a hot loop beside the portable one, picked at load time by the CPU's features.
// Not target_clones("arch=haswell"): GCC's resolver for an arch= clone compares the CPU *model*, so any
// CPU but a Haswell (newer Intel, every AMD) would run the SSE2 default.
#define RFA_SIMD_CLONES __attribute__((target_clones("avx2,fma", "default")))

// What turns causal_layer_step's phi_q / phi_k rows into features: the features themselves, a learned map's
// pre-activations W x + b and its activation (hedgehog, relu), or a head's raw input and the map computed here
// (the random maps of sigma-scaled, l2-normalized inputs with their (H, D, d) matrix; elu). Python names them
// ("features" or the map's kind); activation_code is the one table from names to codes.
enum Activation : int64_t { kFeatures = 0, kHedgehog = 1, kReLU = 2, kSinCos = 3, kArcCos = 4, kPositive = 5,
                            kELU = 6 };
int64_t activation_code(const std::string& name);
std::vector<std::string> activation_names();

// Absent tensors are undefined ones (None from Python) throughout; outputs are written through their handles.

// a feature map as the kernels apply it to one head's row of `width` values
struct MapParams {
  int64_t kind = kFeatures;
  int64_t width = 0;     // values per head in the input rows
  int64_t features = 0;  // F
  const float* sigma = nullptr;   // (H, d) random maps
  const float* matrix = nullptr;  // (H, D, d) random maps
};
// MapParams for `activation` over rows of H heads whose state has F features; sigma / matrix empty but for the
// random maps
MapParams map_params(int64_t activation, int64_t H, int64_t F, int64_t head_dim, const torch::Tensor& sigma,
                     const torch::Tensor& matrix);
// phi of head h's row (map.width values): a pointer to the features (the row itself for kFeatures, else `buf`,
// F floats; `scratch` holds max(D, d) floats); is_query: the positive map's per-query shift
const float* head_features(const float* row, const MapParams& map, int64_t h, bool is_query, float* buf,
                           float* scratch);

void causal_layer_step(const torch::Tensor& phi_q, const torch::Tensor& phi_k, const torch::Tensor& v,
                       const torch::Tensor& gate_logits, const torch::Tensor& key_pad, const torch::Tensor& state_in,
                       const torch::Tensor& order, const torch::Tensor& state_out, const torch::Tensor& out, double eps,
                       int64_t activation, const torch::Tensor& sigma, const torch::Tensor& matrix);
// The cross-attention steps: row r reads sentence r / beam, or sentences[r / beam] where `sentences` (int64) is given
// (the native search's rows of the places still translating).
// RFA cross-attention of one step: phi(q) . S over the per-sentence states (N, H, F, d + 1); q (R, H * P): raw
// per-head queries (P = d) or a learned affine map's pre-activations (P = D), the map applied here; out (R, H * d)
void rfa_cross_step(const torch::Tensor& q, const torch::Tensor& cross_state, int64_t beam, double eps,
                    int64_t activation, const torch::Tensor& sigma, const torch::Tensor& matrix, const torch::Tensor& out,
                    const torch::Tensor& sentences = torch::Tensor());
void softmax_cross_step(const torch::Tensor& q, const torch::Tensor& key, const torch::Tensor& value,
                        const torch::Tensor& key_bias, int64_t beam, double scaling, const torch::Tensor& out,
                        const torch::Tensor& weights, const torch::Tensor& sentences = torch::Tensor());
void add_layer_norm(const torch::Tensor& x, const torch::Tensor& residual, const torch::Tensor& gamma,
                    const torch::Tensor& beta, double eps, const torch::Tensor& out);
void beam_candidates(const torch::Tensor& lprobs, const torch::Tensor& prev_scores, int64_t beam,
                     const torch::Tensor& scores_out, const torch::Tensor& indices_out);
// The k best (value, index) so far, best first; among equal values the one seen first stays first.
struct TopK {
  float* value;
  int64_t* index;
  int64_t k, count = 0;
  float worst() const { return count < k ? -std::numeric_limits<float>::infinity() : value[k - 1]; }
  void offer(float v, int64_t i) {
    if (count == k && !(v > value[k - 1])) return;
    int64_t pos = count < k ? count++ : k - 1;
    while (pos > 0 && v > value[pos - 1]) {
      value[pos] = value[pos - 1];
      index[pos] = index[pos - 1];
      --pos;
    }
    value[pos] = v;
    index[pos] = i;
  }
};
// the largest of n floats (NaN ignored; -inf when none)
float block_max(const float* x, int64_t n);
// The one candidate selection of beam search (beam_candidates; the native search step, which reads log-softmax off
// the logits): the best k of a sentence's beams x V candidates into `best`, value(b, v) each candidate's total (-inf
// when excluded), bound(b, start, len) an upper bound of value over a block of 64, which is skipped when it cannot
// beat the k-th best (or counted whole while fewer than k are kept).
template <class Value, class Bound>
void sentence_candidates(TopK& best, int64_t beams, int64_t V, const Value& value, const Bound& bound) {
  constexpr int64_t kBlock = 64;
  for (int64_t b = 0; b < beams; ++b) {
    for (int64_t start = 0; start < V; start += kBlock) {
      const int64_t len = std::min(kBlock, V - start);
      if (best.count == best.k && !(bound(b, start, len) > best.worst())) continue;
      for (int64_t v = start; v < start + len; ++v) best.offer(value(b, v), b * V + v);
    }
  }
}
// exp of n floats in place (AVX2: a polynomial within about 1 ulp of expf on x <= 0, the range used here)
void exp_inplace(float* x, int64_t n);
// max and log(sum(exp(x - max))) of a row: log_softmax(x) = (x - max) - log_sum
void row_log_sum_exp(const float* x, int64_t n, float* max_out, float* log_sum_out);
// int8 linear layers' activations: the zero point of the 7-bit codes (x86 without VNNI sums pairs of u8 x s8
// products in int16, which 8-bit codes times 7-bit weights overflow)
constexpr int64_t kInt8RowZeroPoint = 64;
void quantize_rows(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scales);
void scale_rows(const torch::Tensor& y, const torch::Tensor& scales, const torch::Tensor& bias,
                const torch::Tensor& residual, bool relu);
// Linear layers of few rows on AVX-512 (few_rows.cpp): whether this CPU runs them (int8: with VNNI); a weight in their
// blocks (fp32: (ceil(O / 16), I, 16); int8 codes: {(ceil(O / 16), ceil(I / 4), 16, 4) blocks, per-channel zero-point
// sums}); y = act(x W^T + b) + residual (int8: from quantize_rows' codes and row scales, with the weights' scales)
bool few_rows_available(bool int8);
torch::Tensor few_rows_pack_fp32(const torch::Tensor& weight);
std::vector<torch::Tensor> few_rows_pack_int8(const torch::Tensor& codes);
void few_rows_linear_fp32(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias,
                          const torch::Tensor& residual, bool relu, const torch::Tensor& y);
void few_rows_linear_int8(const torch::Tensor& codes, const torch::Tensor& row_scales, const torch::Tensor& weight,
                          const torch::Tensor& sums, const torch::Tensor& w_scales, const torch::Tensor& bias,
                          const torch::Tensor& residual, bool relu, const torch::Tensor& y);
