// The whole decoding step on the CPU as one native call (decode_program.cpp): the decoder's layers and, for the
// static beam search, the search's step after them.
//
// Declared once: the program is built from the Python records of rfa_fairseq/modules/decoding.py (DecodingRuntime,
// DecoderLayerRecord, CausalRecord, the cross-attention records, FeatureMapRecord, NormRecord, PackedLinear), each
// structure below reading its record's fields by name (records.h); a batch's buffers are read the same way from the
// Python caches and the static beam search's _Search, whose own tensors they are. Nothing here is writable from
// Python. Every tensor a call takes a pointer of is checked (shape, dtype, device, layout) with the GIL held, then the
// GIL is released: threads that decode different parts of a batch run at once.
#pragma once
#include <pybind11/pybind11.h>
#include <torch/extension.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "linear_layers.h"
#include "program_parts.h"
#include "records.h"
#include "step_kernels.h"

enum CrossKind : int64_t { kCrossNone = 0, kCrossSoftmax = 1, kCrossRFA = 2 };
// a feature map as the step applies it (rfa_kernels.h's Activation codes): learned affine maps to the
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
  explicit NativeBatch(const pybind11::list& layer_caches);
};

// The static beam search's buffers for N places of K beams, read from its _Search (generation/static_beam_search.py)
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
  at::Tensor step_rows;           // (L,) int64: the rows step t decoded, written at t (profiles read it)
  at::Tensor prefix;              // (N, P) int64 prefix tokens (pad: none at that step), or undefined
  int64_t no_repeat_ngram = 0;    // --no-repeat-ngram-size (0: off)
  int64_t N = 0, K = 1, eos = 2, pad = 1, unk = 3;
  double unk_penalty = 0.0;
  explicit NativeSearch(const pybind11::object& search);
};

class DecodeProgram {
 public:
  // runtime: a DecodingRuntime (its records); library: the linear layers' library its kernel set picked
  DecodeProgram(const pybind11::object& runtime, std::shared_ptr<LinearLibrary> library);

  // logits (R, V) of one step for tokens (R,) int64 at positions (R, C), (1, C) or undefined; the causal states read
  // parity `read` through `order` (undefined: row r reads row r; ignored when first) and write the other buffer; row
  // r reads source sentence r / beam (or sentences[r / beam]: rfa_kernels.h). weights: (R, S) the last layer's
  // head-averaged softmax cross-attention weights, or undefined (not wanted). The caller has checked the tensors
  // (check_decode).
  at::Tensor decode(const NativeBatch& batch, const at::Tensor& tokens, const at::Tensor& positions,
                    const at::Tensor& order, int64_t read, bool first, bool padded_inputs, const at::Tensor& weights,
                    int64_t beam, const at::Tensor& sentences = at::Tensor()) const;
  void check_decode(const NativeBatch& batch, const at::Tensor& tokens, const at::Tensor& positions,
                    const at::Tensor& order, int64_t read, bool first, const at::Tensor& weights, int64_t beam) const;

  // A batch's start: each softmax cross-attention layer's K and V (batch.keys / values[i], (n, H, S, d)) of the encoder
  // output key (S, n, C), and its padding as the additive bias (batch.key_biases[i], (n, S): 0 or -inf) where the
  // caller gave one, from the (n, S) bool padding mask (undefined: none), in one call over the layers (the RFA
  // cross-attention's states are made in Python). The caller has checked the tensors (check_sources).
  void start_sources(const NativeBatch& batch, const at::Tensor& key, const at::Tensor& padding) const;
  void check_sources(const NativeBatch& batch, const at::Tensor& key, const at::Tensor& padding) const;

  // the static beam search's whole step t, reading its tokens/scores pair `parity` (the causal states: `read`):
  // decode, log-softmax with the masks and the 2K best candidates per place, finalization, and the reorder into
  // the other pair (search.order: the beam order the next step's causal layers apply). Only the places still
  // translating are decoded: their rows packed to the front (the causal states written there, search.order naming
  // them), a finished place's rows left as they are. -> how many places have finished (search.finished).
  int64_t search_step(const NativeBatch& batch, NativeSearch& search, int64_t t, int64_t parity, int64_t read,
                      bool first, bool last) const;
  // the search's part of step t on the logits (live.size() places' rows, packed as search_step packs them) of the
  // places `live`: log-softmax with the masks (min length, unk, prefix, repeated n-grams, EOS alone at the last
  // step), the 2K best candidates per place, finalization and the reorder into the other pair. -> finished places
  int64_t choose(NativeSearch& search, const at::Tensor& logits, const std::vector<int64_t>& live, int64_t t,
                 int64_t parity, bool first, bool last) const;
  // the places a step decodes: every place at the first step, else those not finished
  static std::vector<int64_t> live_places(const NativeSearch& search, bool first);
  // search_step at t = t0, t0 + 1, ... (the first step at t = 0; the last, EOS only, at t = max_len), the buffer
  // pairs and the causal states turning after each, until every place has finished or step `last_step` ran: a
  // batch's whole search in one call, without Python (or the GIL) between its steps (each step decodes only the
  // places still translating, so the batch never halves). -> (the last step run, the places finished after it)
  std::pair<int64_t, int64_t> search_steps(const NativeBatch& batch, NativeSearch& search, int64_t t0, int64_t parity,
                                           int64_t read, int64_t last_step, int64_t max_len) const;
  // the search's buffers are fit for its steps t0 .. t_last (the tokens read at t0 from pair `parity`)
  void check_search(const NativeBatch& batch, const NativeSearch& search, int64_t t0, int64_t t_last, int64_t parity,
                    int64_t read, bool first) const;
  // the search's buffers are fit for steps up to t (check_search_buffers), and `logits` for choose at step t
  void check_search_buffers(const NativeSearch& search, int64_t t, int64_t parity, bool first) const;
  void check_search_logits(const NativeSearch& search, const at::Tensor& logits, int64_t t, int64_t parity,
                           bool first) const;

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

void bind_decode_program(pybind11::module_& m);
