// The decoder's step on the CPU as one native call (decode_program.cpp); the static beam search's step around it is
// native_search.h, their Python face program_bindings.cpp.
//
// Declared once: the program is built from the Python records of rfa_fairseq/modules/decoding.py (DecodingRuntime,
// DecoderLayerRecord, CausalRecord, the cross-attention records, FeatureMapRecord, NormRecord, PackedLinear), each
// structure below reading its record's fields by name (records.h); a batch's caches are read the same way from the
// Python caches, whose own tensors they are. Nothing here is writable from Python. Every tensor a call takes a pointer
// of is checked (shape, dtype, device, layout) with the GIL held, then the GIL is released: threads that decode
// different parts of a batch run at once.
#pragma once
#include <pybind11/pybind11.h>
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "linear_layers.h"
#include "program_parts.h"
#include "records.h"
#include "step_kernels.h"

enum CrossKind : int64_t { kCrossNone = 0, kCrossSoftmax = 1, kCrossRFA = 2 };
// a feature map as the step applies it (step_kernels.h's Activation codes): learned affine maps to the
// pre-activations that the fused projection gives (hedgehog, relu), the others to raw per-head inputs
struct FeatureMapSpec {  // FeatureMapRecord
  int64_t kind = kFeatures;
  int64_t width = 0;     // values per head in the projection's q / k columns (D for affine maps, d otherwise)
  int64_t features = 0;  // F
  at::Tensor sigma;      // (H, d) random maps
  at::Tensor matrix;     // (H, D, d) random maps
  static FeatureMapSpec from(const Record& record);
};

struct CausalAttention {  // CausalRecord
  LinearLayer proj;  // [q | k | v | gate logits]
  LinearLayer out_proj;
  FeatureMapSpec map;
  int64_t heads = 0, head_dim = 0, features = 0;
  bool gated = false;
  double eps = 1e-3;
  static CausalAttention from(const Record& record);
};

struct CrossAttention {  // SoftmaxCrossRecord or RFACrossRecord (their `kind`), or none
  int64_t kind = kCrossNone;
  LinearLayer q_proj, out_proj;
  LinearLayer kv_proj;  // softmax cross-attention: [k | v] of the encoder output, at a batch's start
  FeatureMapSpec map;  // RFA cross-attention
  int64_t heads = 0, head_dim = 0;
  double scaling = 1.0, eps = 1e-3;
  static CrossAttention from(const std::optional<Record>& record);
};

struct DecoderLayerProgram {  // DecoderLayerRecord
  CausalAttention self_attn;
  Norm self_attn_norm;
  CrossAttention cross;
  Norm cross_norm;
  FeedForward ffn;
  static DecoderLayerProgram from(const Record& record);
};

// One batch's tensors the step reads and writes, owned by the Python caches (modules/decoding.py's LayerCache: the
// causal states, the cross-attention's per-sentence tensors), read from them by name.
struct NativeBatch {
  std::vector<at::Tensor> states0, states1;           // per layer (>= rows, H, F, d + 1) fp32
  std::vector<at::Tensor> keys, values, key_biases;   // softmax cross-attention, per layer (or undefined)
  std::vector<at::Tensor> cross_states;               // RFA cross-attention, per layer (or undefined)
  // the batch's own output projection (a vocabulary shortlist: modules/decoding.py's OutputColumns.projection, the
  // runtime's output rows of the batch's target ids, LinearLibrary::select_outputs), or none: the runtime's
  std::optional<LinearLayer> output;
  explicit NativeBatch(const pybind11::list& layer_caches, const pybind11::object& output = pybind11::none());
};

class DecodeProgram {
 public:
  // runtime: a DecodingRuntime (its records); library: the linear layers' library its kernel set picked
  DecodeProgram(const pybind11::object& runtime, std::shared_ptr<LinearLibrary> library);

  // logits (R, V) of one step (V: the batch's output columns where it has its own output projection) for tokens (R,) int64 at positions (R, C), (1, C) or undefined; the causal states read
  // buffer `read` through `order` (undefined: row r reads row r; ignored when first) and write the other buffer at
  // rows `state_rows` (undefined: row r at row r; the native search's live rows at their places' rows); row r reads
  // source sentence r / beam (or sentences[r / beam]: step_kernels.h). weights: (R, S) the last layer's head-averaged
  // softmax cross-attention weights, or undefined (not wanted). logits: a contiguous (R, V) fp32 buffer the logits
  // are written into (the native search's, reused every step), or undefined: a new tensor. The caller has checked
  // the tensors (check_decode).
  at::Tensor decode(const NativeBatch& batch, const at::Tensor& tokens, const at::Tensor& positions,
                    const at::Tensor& order, int64_t read, bool first, bool padded_inputs, const at::Tensor& weights,
                    int64_t beam, const at::Tensor& sentences = at::Tensor(),
                    const at::Tensor& state_rows = at::Tensor(), const at::Tensor& logits = at::Tensor()) const;
  void check_decode(const NativeBatch& batch, const at::Tensor& tokens, const at::Tensor& positions,
                    const at::Tensor& order, int64_t read, bool first, const at::Tensor& weights, int64_t beam) const;

  // A batch's start: each softmax cross-attention layer's K and V (batch.keys / values[i], (n, H, S, d)) of the encoder
  // output key (S, n, C), and its padding as the additive bias (batch.key_biases[i], (n, S): 0 or -inf) where the
  // caller gave one, from the (n, S) bool padding mask (undefined: none), in one call over the layers (the RFA
  // cross-attention's states are made in Python). The caller has checked the tensors (check_sources).
  void start_sources(const NativeBatch& batch, const at::Tensor& key, const at::Tensor& padding) const;
  void check_sources(const NativeBatch& batch, const at::Tensor& key, const at::Tensor& padding) const;

  int64_t vocab_size() const { return embed.size(0); }
  int64_t model_dim() const { return embed.size(1); }
  const rfa::cpu::Kernels& kernels() const { return library_->kernels(); }
  const LinearLibrary& library() const { return *library_; }

 private:
  std::shared_ptr<LinearLibrary> library_;
  at::Tensor embed;  // (V, C)
  double embed_scale = 1.0;
  Norm embed_norm, final_norm;
  std::vector<DecoderLayerProgram> layers;
  LinearLayer output;
  int64_t padding_idx = 1;
};

// the program's and the native search's Python face (program_bindings.cpp)
void bind_decode_program(pybind11::module_& m);
