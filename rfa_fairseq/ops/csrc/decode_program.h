// The whole decoding step on the CPU as one native call (decode_program.cpp): the decoder's layers and, for the
// static beam search, the search's step after them. Built once per (weights, linear-layer library) from the
// records that rfa_fairseq/modules/decoding.py makes; the per-batch buffers are the Python caches' own tensors,
// handed over once per batch (NativeBatch, NativeSearch). Every call releases the GIL: threads that decode
// different parts of a batch run at once.
#pragma once
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/extension.h>

#include <optional>
#include <string>
#include <vector>

#include "rfa_kernels.h"

// The linear layers' library, decided in Python (ops/decode_step.py's step_kernels): torch's addmm, oneDNN on
// packed fp32 weights, oneDNN's int8 product.
enum Gemm : int64_t { kGemmTorch = 0, kGemmOneDNN = 1, kGemmOneDNNInt8 = 2 };

enum CrossKind : int64_t { kCrossNone = 0, kCrossSoftmax = 1, kCrossRFA = 2 };
enum FFNActivation : int64_t { kFFNReLU = 0, kFFNGELU = 1 };

struct LinearLayer {
  at::Tensor weight;                 // torch: (O, I); oneDNN: packed; int8: packed int8 codes
  at::Tensor bias;                   // (O,) or undefined
  at::Tensor w_scales, w_zero_points;  // int8: per output channel
  int64_t out_features = 0;
};

struct Norm {
  at::Tensor weight, bias;  // undefined: no norm
  double eps = 1e-5;
  bool defined() const { return weight.defined(); }
};

// a feature map as the step applies it (rfa_kernels.h's Activation codes): learned affine maps to the
// pre-activations that the fused projection gives (hedgehog, relu), the others to raw per-head inputs
struct FeatureMapSpec {
  int64_t kind = kFeatures;
  int64_t width = 0;     // values per head in the projection's q / k columns (D for affine maps, d otherwise)
  int64_t features = 0;  // F
  at::Tensor sigma;      // (H, d) random maps
  at::Tensor matrix;     // (H, D, d) random maps
};

struct CausalAttention {
  LinearLayer proj;  // [q | k | v | gate logits]
  LinearLayer out_proj;
  FeatureMapSpec map;
  int64_t heads = 0, head_dim = 0;
  bool gated = false;
  double eps = 1e-3;
};

struct CrossAttention {
  int64_t kind = kCrossNone;
  LinearLayer q_proj, out_proj;
  FeatureMapSpec map;  // RFA cross-attention
  int64_t heads = 0, head_dim = 0;
  double scaling = 1.0, eps = 1e-3;
};

struct DecoderLayerProgram {
  CausalAttention self_attn;
  Norm self_attn_norm;
  CrossAttention cross;
  Norm cross_norm;
  LinearLayer fc1, fc2;
  int64_t ffn_activation = kFFNReLU;
  Norm final_norm;
  bool normalize_before = false;
};

// One batch's tensors the step reads and writes, owned by the Python caches (shared storage): per layer the two
// causal state buffers and the cross-attention's per-sentence tensors; the beam (rows n * beam .. read sentence n).
struct NativeBatch {
  std::vector<at::Tensor> states0, states1;           // per layer (>= rows, H, F, d + 1) fp32
  std::vector<at::Tensor> keys, values, key_biases;   // softmax cross-attention, per layer (or undefined)
  std::vector<at::Tensor> cross_states;               // RFA cross-attention, per layer (or undefined)
  int64_t beam = 1;
};

// The static beam search's buffers for N places of K beams (generation/static_beam_search.py's _Search owns them)
struct NativeSearch {
  at::Tensor tokens0, tokens1;    // (R, L) int64, used in turn
  at::Tensor scores0, scores1;    // (R, L - 1) fp32, used in turn
  at::Tensor cand_scores, cand_indices;  // (>= N * 2K)
  at::Tensor cands_to_ignore;     // (N, K) bool
  at::Tensor finished;            // (N,) bool
  at::Tensor fin_count;           // (N,) int64
  at::Tensor fin_tokens, fin_scores, fin_steps;  // (>= N * K, L), (>= N * K, L - 1), (>= N * K,)
  at::Tensor order;               // (R,) int64: the beam order the next step's causal layers apply
  at::Tensor eos_bias;            // (>= max_len + 1,) fp32: -inf before the minimum length
  at::Tensor positions;           // (>= max_len + 1, C) or undefined
  at::Tensor step;                // (1,) int64: the step number, set to t + 1 after step t (the torch steps read it)
  int64_t N = 0, K = 1, eos = 2, pad = 1, unk = 3;
  double unk_penalty = 0.0;
};

class DecodeProgram {
 public:
  DecodeProgram(int64_t gemm, std::vector<std::string> onednn_ops);

  // the model's pieces, set once by Python (modules/decoding.py's native_program)
  at::Tensor embed;  // (V, C)
  double embed_scale = 1.0;
  Norm embed_norm, final_norm;
  std::vector<DecoderLayerProgram> layers;
  LinearLayer output;
  int64_t padding_idx = 1;

  // logits (R, V) of one step for tokens (R,) int64 at positions (R, C), (1, C) or empty; the causal states read
  // parity `read` through `order` (empty: row r reads row r; ignored when first) and write the other buffer.
  // weights: (R, S) the last layer's head-averaged softmax cross-attention weights, or empty (not wanted).
  at::Tensor decode(const NativeBatch& batch, const at::Tensor& tokens, const at::Tensor& positions,
                    const at::Tensor& order, int64_t read, bool first, bool padded_inputs, at::Tensor weights,
                    int64_t threads);

  // the static beam search's whole step t, reading its tokens/scores pair `parity` (the causal states: `read`):
  // decode, log-softmax with the masks and the 2K best candidates per place, finalization, and the reorder into
  // the other pair (search.order: the beam order the next step's causal layers apply). -> how many places have
  // finished (search.finished), so that the host reads no buffer at a step that halves nothing.
  int64_t search_step(const NativeBatch& batch, NativeSearch& search, int64_t t, int64_t parity, int64_t read,
                   bool first, bool last, int64_t threads);

  // one linear layer on this program's library: act(x W^T + b) + residual; `part` names it for torch's profiler
  at::Tensor linear(const LinearLayer& layer, const at::Tensor& x, bool relu, const at::Tensor& residual,
                    const char* part = "rfa::linear") const;

 private:
  int64_t gemm_;
  std::optional<c10::OperatorHandle> linear_op_, linear_add_op_, qlinear_op_;
  // decode() for rows reading sentence r / beam (the batch's beam; 1 at the search's first step, one row per sentence)
  at::Tensor decode_rows(const NativeBatch& batch, const at::Tensor& tokens, const at::Tensor& positions,
                         const at::Tensor& order, int64_t read, bool first, bool padded_inputs, at::Tensor weights,
                         int64_t beam);
};

void bind_decode_program(pybind11::module_& m);
