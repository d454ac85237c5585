// The kernels of a decoding step on tensors (step_kernels.cpp), bound in bindings.cpp; each takes the kernels of the
// runtime's instruction-set level (cpu_kernels.h) it runs on.
#pragma once
#include <ATen/ATen.h>

#include "cpu_kernels.h"

#include <algorithm>
#include <limits>
#include <string>
#include <vector>

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
MapParams map_params(int64_t activation, int64_t H, int64_t F, int64_t head_dim, const at::Tensor& sigma,
                     const at::Tensor& matrix);
// phi of head h's row (map.width values): a pointer to the features (the row itself for kFeatures, else `buf`,
// F floats; `scratch` holds max(D, d) floats); is_query: the positive map's per-query shift
const float* head_features(const rfa::cpu::Kernels& kernels, const float* row, const MapParams& map, int64_t h,
                           bool is_query, float* buf, float* scratch);

// The causal layer's step: row r reads the state at row order[r] of state_in (r where order is undefined; none when
// state_in is undefined: the first step) and writes it at row state_rows[r] of state_out (r where undefined: the
// native search's live rows written at their places' rows). state_in may be state_out itself (one buffer: the native
// search's) where the rows come in groups of `group` (a place's beams) that read and write rows of their own group
// only (checked): each group's states are read before any of them is written.
void causal_layer_step(const at::Tensor& phi_q, const at::Tensor& phi_k, const at::Tensor& v,
                       const at::Tensor& gate_logits, const at::Tensor& key_pad, const at::Tensor& state_in,
                       const at::Tensor& order, const at::Tensor& state_out, const at::Tensor& out, double eps,
                       int64_t activation, const at::Tensor& sigma, const at::Tensor& matrix,
                       const rfa::cpu::Kernels& kernels, const at::Tensor& state_rows = at::Tensor(),
                       int64_t group = 0);
// The cross-attention steps: row r reads sentence r / beam, or sentences[r / beam] where `sentences` (int64) is given
// (the native search's rows of the places still translating).
// RFA cross-attention of one step: phi(q) . S over the per-sentence states (N, H, F, d + 1); q (R, H * P): raw
// per-head queries (P = d) or a learned affine map's pre-activations (P = D), the map applied here; out (R, H * d)
void rfa_cross_step(const at::Tensor& q, const at::Tensor& cross_state, int64_t beam, double eps,
                    int64_t activation, const at::Tensor& sigma, const at::Tensor& matrix, const at::Tensor& out,
                    const rfa::cpu::Kernels& kernels, const at::Tensor& sentences = at::Tensor());
void softmax_cross_step(const at::Tensor& q, const at::Tensor& key, const at::Tensor& value,
                        const at::Tensor& key_bias, int64_t beam, double scaling, const at::Tensor& out,
                        const at::Tensor& weights, const rfa::cpu::Kernels& kernels,
                        const at::Tensor& sentences = at::Tensor());
void add_layer_norm(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& gamma,
                    const at::Tensor& beta, double eps, const at::Tensor& out, const rfa::cpu::Kernels& kernels);
void beam_candidates(const at::Tensor& lprobs, const at::Tensor& prev_scores, int64_t beam,
                     const at::Tensor& scores_out, const at::Tensor& indices_out,
                     const rfa::cpu::Kernels& kernels);
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
// The one candidate selection of beam search (beam_candidates; the native search step, which reads log-softmax off
// the logits): the best k of a sentence's beams x V candidates into `best`, value(b, v) each candidate's total (-inf
// when excluded), bound(b, start, len) an upper bound of value over a block of 64 (a level's block_max of its
// values), which is skipped when it cannot beat the k-th best (or counted whole while fewer than k are kept).
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
// int8 linear layers' input: each row's 7-bit codes and scale (cpu_kernels.h's kInt8RowZeroPoint)
void quantize_rows(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                   const rfa::cpu::Kernels& kernels);
// the same on raw rows (x: R rows of C floats, row stride ldx; codes: R x C contiguous), the caller's checks done
void quantize_rows(const float* x, int64_t ldx, int64_t R, int64_t C, uint8_t* codes, float* scales,
                   const rfa::cpu::Kernels& kernels);
