// The whole decoding step on the CPU as one native call (decode_program.h). The step is the same function as the
// torch reference (rfa_fairseq/modules/decoding.py's records and generation/static_beam_search.py's _step): the same
// kernels (step_kernels.cpp, on the runtime's instruction-set level), the same linear layers (linear_layers.h: the
// level's kernels on the weights kept once), the same search arithmetic; what it removes is Python between ~250
// operations a step. It also fuses the log-softmax into the choice of the candidates: the log-probabilities are never written,
// each row's log-sum-exp is taken in one vectorized pass and the candidates are read off the logits.
//
// The step's parts are named for torch's profiler (RECORD_FUNCTION, free when no profiler runs), each region
// exclusive of the others (none nests in another): rfa::linear, rfa::output_projection, rfa::causal_attention,
// rfa::cross_attention, rfa::layer_norm, rfa::embedding and rfa::search (candidates, finalization, reorder);
// benchmarks/profile_generate.py sums them.
#include "decode_program.h"

#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <omp.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>


namespace py = pybind11;

// MKL's per-thread thread count, its C interface (mkl_service.h's mkl_set_num_threads_local; the lower-case symbol is
// the Fortran one, which takes a pointer), exported by torch's x86 builds, which link MKL; absent elsewhere: weak
extern "C" int MKL_Set_Num_Threads_Local(int) __attribute__((weak));

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

}  // namespace

// ------------------------------------------------------------------------------------------------ records

FeatureMapSpec FeatureMapSpec::from(const Record& r) {
  FeatureMapSpec spec;
  spec.kind = activation_code(r.text("kind"));
  spec.width = r.integer("width");
  spec.features = r.integer("features");
  if (!r.has("activation")) {  // a map computed in the step from raw inputs: the random maps take their matrix
    spec.sigma = r.optional_tensor("sigma");
    spec.matrix = r.optional_tensor("random_matrix");
  }
  return spec;
}

namespace {

// what every attention record has: its output projection and its heads' shape
void read_heads(const Record& r, LinearLayer& out_proj, int64_t& heads, int64_t& head_dim) {
  out_proj = LinearLayer::from(r.sub("out_proj"));
  heads = r.integer("heads");
  head_dim = r.integer("head_dim");
}

}  // namespace

CausalAttention CausalAttention::from(const Record& r) {
  CausalAttention a;
  a.proj = LinearLayer::from(r.sub("proj"));
  read_heads(r, a.out_proj, a.heads, a.head_dim);
  a.map = FeatureMapSpec::from(r.sub("map"));
  a.features = r.integer("features");
  a.gated = r.flag("gated");
  a.eps = r.number("eps");
  TORCH_CHECK(a.map.features == a.features, "rfa decode program: ", r.path(), " has ", a.features,
              " features, its map ", a.map.features);
  return a;
}

CrossAttention CrossAttention::from(const std::optional<Record>& r) {
  CrossAttention a;
  if (!r) return a;
  a.kind = code_of({{"softmax", kCrossSoftmax}, {"rfa", kCrossRFA}}, r->text("kind"),
                   r->path() + " kind");
  a.q_proj = LinearLayer::from(r->sub("q_proj"));
  read_heads(*r, a.out_proj, a.heads, a.head_dim);
  if (a.kind == kCrossSoftmax) {
    a.scaling = r->number("scaling");
    a.kv_proj = LinearLayer::from(r->sub("kv_proj"));
  } else {
    a.eps = r->number("eps");
    a.map = FeatureMapSpec::from(r->sub("map"));
  }
  return a;
}

DecoderLayerProgram DecoderLayerProgram::from(const Record& r) {
  DecoderLayerProgram layer;
  layer.self_attn = CausalAttention::from(r.sub("self_attn"));
  layer.self_attn_norm = Norm::from(r.optional_sub("self_attn_norm"));
  layer.cross = CrossAttention::from(r.optional_sub("cross"));
  layer.cross_norm = Norm::from(r.optional_sub("cross_norm"));
  layer.ffn = FeedForward::from(r);
  return layer;
}

NativeBatch::NativeBatch(const py::list& layer_caches) {
  int64_t i = 0;
  for (py::handle item : layer_caches) {
    Record cache(item, "state.layers[" + std::to_string(i++) + "]");
    std::vector<at::Tensor> states = cache.sub("self_attn").tensors("states");
    TORCH_CHECK(states.size() == 2, "rfa decode program: ", cache.path(), ".self_attn has ", states.size(),
                " state buffers, 2 are used in turn");
    states0.push_back(states[0]);
    states1.push_back(states[1]);
    std::optional<Record> cross = cache.optional_sub("cross");
    auto field = [&](const char* name) {
      return cross && py::hasattr(cross->object(), name) ? cross->optional_tensor(name) : at::Tensor();
    };
    keys.push_back(field("key"));
    values.push_back(field("value"));
    key_biases.push_back(field("key_bias"));
    cross_states.push_back(field("rfa_state"));
  }
}

NativeSearch::NativeSearch(const py::object& object) {
  Record s(object, "search");
  Record views = s.sub("views"), rows = s.sub("rows");
  std::vector<at::Tensor> tokens = views.tensors("token_pair"), scores = views.tensors("score_pair");
  TORCH_CHECK(tokens.size() == 2 && scores.size() == 2, "rfa search step: two token and two score buffers");
  tokens0 = tokens[0];
  tokens1 = tokens[1];
  scores0 = scores[0];
  scores1 = scores[1];
  cand_scores = views.tensor("cand_scores");
  cand_indices = views.tensor("cand_indices");
  cands_to_ignore = views.tensor("cands_to_ignore");
  finished = views.tensor("finished");
  fin_count = views.tensor("fin_count");
  fin_tokens = views.tensor("fin_tokens");
  fin_scores = views.tensor("fin_scores");
  fin_steps = views.tensor("fin_steps");
  order = views.tensor("order");
  step = views.tensor("step");
  step_rows = views.tensor("step_rows");
  eos_bias = s.tensor("eos_bias");
  positions = s.optional_tensor("positions");
  prefix = s.optional_tensor("prefix_tokens");
  no_repeat_ngram = s.integer("no_repeat_ngram_size");
  N = rows.integer("sentences");
  K = rows.integer("beam");
  TORCH_CHECK(K == s.integer("K"), "rfa search step: the rows' beam ", K, " is not the search's ", s.integer("K"));
  eos = s.integer("eos");
  pad = s.integer("pad");
  unk = s.integer("unk");
  unk_penalty = s.number("unk_penalty");
}

// ------------------------------------------------------------------------------------------------ the program

DecodeProgram::DecodeProgram(const py::object& runtime, std::shared_ptr<LinearLibrary> library)
    : library_(std::move(library)) {
  Record r(runtime, "runtime");
  embed = r.tensor("embed").contiguous();
  embed_scale = r.number("embed_scale");
  embed_norm = Norm::from(r.optional_sub("embed_norm"));
  final_norm = Norm::from(r.optional_sub("final_norm"));
  padding_idx = r.integer("padding_idx");
  output = LinearLayer::from(r.sub("output"));
  for (const Record& layer : r.items("layers")) layers.push_back(DecoderLayerProgram::from(layer));
  TORCH_CHECK(embed.dim() == 2 && embed.scalar_type() == at::kFloat && embed.device().is_cpu(),
              "rfa decode program: runtime.embed must be a (vocabulary, C) fp32 CPU tensor");
}

namespace {

// LayerNorm(x) into a new tensor, or into x itself (in_place)
at::Tensor layer_norm(const Norm& norm, at::Tensor x, bool in_place, const rfa::cpu::Kernels& kernels) {
  RECORD_FUNCTION("rfa::layer_norm", std::vector<c10::IValue>());
  at::Tensor out = in_place ? x : at::empty_like(x);
  add_layer_norm(x, at::Tensor(), norm.weight, norm.bias, norm.eps, out, kernels);
  return out;
}

// `t` is a CPU tensor of `dtype`, contiguous (or with unit last stride), of `sizes` (-1: any; `at_least`: the first
// size may be larger) -> or a RuntimeError naming it
void expect(const at::Tensor& t, const std::string& name, at::ScalarType dtype, std::vector<int64_t> sizes,
            bool at_least = false, bool contiguous = true) {
  TORCH_CHECK(t.defined(), "rfa decode program: ", name, " is missing");
  TORCH_CHECK(t.device().is_cpu(), "rfa decode program: ", name, " is on ", t.device(), ", not the CPU");
  TORCH_CHECK(t.scalar_type() == dtype, "rfa decode program: ", name, " is ", t.scalar_type(), ", not ", dtype);
  bool ok = t.dim() == static_cast<int64_t>(sizes.size());
  for (size_t i = 0; ok && i < sizes.size(); ++i) {
    ok = sizes[i] < 0 || t.size(i) == sizes[i] || (i == 0 && at_least && t.size(0) >= sizes[0]);
  }
  TORCH_CHECK(ok, "rfa decode program: ", name, " has shape ", t.sizes(), ", expected ", c10::IntArrayRef(sizes),
              at_least ? " (first size or more)" : "", " (-1: any)");
  TORCH_CHECK(contiguous ? t.is_contiguous() : t.stride(-1) == 1, "rfa decode program: ", name,
              contiguous ? " is not contiguous" : " has no unit last stride");
}

void expect_indices(const at::Tensor& t, const std::string& name, int64_t rows, int64_t bound) {
  expect(t, name, at::kLong, {rows}, true);
  const int64_t* p = t.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(p[r] >= 0 && p[r] < bound, "rfa decode program: ", name, "[", r, "] = ", p[r], " is not a row of ",
                bound);
  }
}

}  // namespace

void DecodeProgram::check_decode(const NativeBatch& batch, const at::Tensor& tokens, const at::Tensor& positions,
                                 const at::Tensor& order, int64_t read, bool first, const at::Tensor& weights,
                                 int64_t beam) const {
  TORCH_CHECK(read == 0 || read == 1, "rfa decode program: read must be 0 or 1, got ", read);
  const size_t L = layers.size();
  TORCH_CHECK(batch.states0.size() == L && batch.keys.size() == L, "rfa decode program: the batch has ",
              batch.states0.size(), " layers' caches for ", L, " layers");
  TORCH_CHECK(tokens.defined() && tokens.device().is_cpu() && tokens.scalar_type() == at::kLong && tokens.dim() == 1,
              "rfa decode program: tokens must be a (rows,) int64 CPU tensor");
  const int64_t R = tokens.size(0), C = embed.size(1), V = embed.size(0);
  TORCH_CHECK(beam >= 1, "rfa decode program: beam must be positive, got ", beam);
  for (int64_t r = 0; r < R; ++r) {
    const int64_t token = tokens.data_ptr<int64_t>()[r * tokens.stride(0)];
    TORCH_CHECK(token >= 0 && token < V, "rfa decode program: tokens[", r, "] = ", token, " is not in the vocabulary (",
                V, ")");
  }
  if (positions.defined() && positions.numel() > 0) {
    expect(positions, "positions", at::kFloat, {-1, C}, false, false);
    TORCH_CHECK(positions.size(0) == R || positions.size(0) == 1, "rfa decode program: positions has ",
                positions.size(0), " rows for ", R);
  }
  if (weights.defined()) expect(weights, "weights", at::kFloat, {R, -1}, false, false);
  for (size_t i = 0; i < L; ++i) {
    const DecoderLayerProgram& layer = layers[i];
    const std::string at = "state.layers[" + std::to_string(i) + "]";
    const int64_t H = layer.self_attn.heads, F = layer.self_attn.features, d = layer.self_attn.head_dim;
    // the state's dtype is the runtime's (fp32; fp16 in int8 decoding): both buffers of a layer alike
    const at::ScalarType state_type = batch.states0[i].scalar_type() == at::kHalf ? at::kHalf : at::kFloat;
    expect(batch.states0[i], at + ".self_attn.states[0]", state_type, {R, H, F, d + 1}, true);
    expect(batch.states1[i], at + ".self_attn.states[1]", state_type, {R, H, F, d + 1}, true);
    if (!first) {
      const at::Tensor& state_in = read == 0 ? batch.states0[i] : batch.states1[i];
      if (order.defined()) {
        if (i == 0) expect_indices(order, "order", R, state_in.size(0));
      }
    }
    const int64_t sentences = (R + beam - 1) / beam;
    if (layer.cross.kind == kCrossSoftmax) {
      const at::Tensor& key = batch.keys[i];
      expect(key, at + ".cross.key", at::kFloat, {sentences, layer.cross.heads, -1, layer.cross.head_dim}, true);
      expect(batch.values[i], at + ".cross.value", at::kFloat, key.sizes().vec());
      if (batch.key_biases[i].defined()) {
        expect(batch.key_biases[i], at + ".cross.key_bias", at::kFloat, {key.size(0), key.size(2)});
      }
    } else if (layer.cross.kind == kCrossRFA) {
      expect(batch.cross_states[i], at + ".cross.rfa_state", at::kFloat,
             {sentences, layer.cross.heads, layer.cross.map.features, layer.cross.head_dim + 1}, true);
    }
  }
}

at::Tensor DecodeProgram::decode(const NativeBatch& batch, const at::Tensor& tokens, const at::Tensor& positions,
                                 const at::Tensor& order, int64_t read, bool first, bool padded_inputs,
                                 const at::Tensor& weights, int64_t beam, const at::Tensor& sentences) const {
  const int64_t R = tokens.size(0);
  const rfa::cpu::Kernels& kernels = library_->kernels();
  at::Tensor x = at::empty({R, embed.size(1)}, embed.options());  // (R, C)
  {
    // the rows of the table, scaled, plus the positions: torch's index_select, mul_ and add_ in one pass (the same
    // two roundings: the scale converted to fp32 as mul_ converts it), without three operators' calls a step
    RECORD_FUNCTION("rfa::embedding", std::vector<c10::IValue>());
    const int64_t C = embed.size(1), token_stride = tokens.stride(0);
    const bool scaled = embed_scale != 1.0, positioned = positions.defined() && positions.numel() > 0;
    const float scale = static_cast<float>(embed_scale);
    const float* table = embed.data_ptr<float>();
    const int64_t* token = tokens.data_ptr<int64_t>();
    const float* pos = positioned ? positions.data_ptr<float>() : nullptr;
    const int64_t pos_stride = positioned && positions.size(0) > 1 ? positions.stride(0) : 0;
    float* out = x.data_ptr<float>();
    for (int64_t r = 0; r < R; ++r) {
      const float* e = table + token[r * token_stride] * C;
      float* o = out + r * C;
      if (scaled) {
        for (int64_t c = 0; c < C; ++c) o[c] = e[c] * scale;
      } else {
        std::copy(e, e + C, o);
      }
      if (positioned) {
        const float* p = pos + r * pos_stride;
        for (int64_t c = 0; c < C; ++c) o[c] += p[c];
      }
    }
  }
  if (embed_norm.defined()) x = layer_norm(embed_norm, x, true, kernels);
  const at::Tensor key_pad = padded_inputs ? tokens.eq(padding_idx) : at::Tensor();
  const at::Tensor state_order = first ? at::Tensor() : order;
  const LinearLibrary& lib = *library_;
  for (size_t i = 0; i < layers.size(); ++i) {
    const DecoderLayerProgram& layer = layers[i];
    const bool pre = layer.ffn.normalize_before;
    // causal self-attention: one fused input projection [q | k | v | gate logits], the kernel, the output projection
    const CausalAttention& self_attn = layer.self_attn;
    const int64_t H = self_attn.heads, d = self_attn.head_dim, C = H * d, width = H * self_attn.map.width;
    at::Tensor h = pre ? layer_norm(layer.self_attn_norm, x, false, kernels) : x;
    at::Tensor proj = lib.linear(self_attn.proj, h, false, at::Tensor());
    at::Tensor attn = at::empty({R, C}, x.options());
    at::Tensor state_out = read == 0 ? batch.states1[i] : batch.states0[i];
    at::Tensor state_in = first ? at::Tensor() : (read == 0 ? batch.states0[i] : batch.states1[i]);
    {
      RECORD_FUNCTION("rfa::causal_attention", std::vector<c10::IValue>());
      causal_layer_step(proj.narrow(1, 0, width), proj.narrow(1, width, width), proj.narrow(1, 2 * width, C),
                        self_attn.gated ? proj.narrow(1, 2 * width + C, H) : at::Tensor(), key_pad, state_in,
                        state_order, state_out, attn, self_attn.eps, self_attn.map.kind, self_attn.map.sigma,
                        self_attn.map.matrix, kernels);
    }
    at::Tensor y = lib.linear(self_attn.out_proj, attn, false, x);
    x = pre ? y : layer_norm(layer.self_attn_norm, y, true, kernels);
    // cross-attention over the per-sentence K / V (or RFA state)
    const CrossAttention& cross = layer.cross;
    if (cross.kind != kCrossNone) {
      h = pre ? layer_norm(layer.cross_norm, x, false, kernels) : x;
      at::Tensor q = lib.linear(cross.q_proj, h, false, at::Tensor());
      at::Tensor out = at::empty({R, C}, x.options());
      {
        RECORD_FUNCTION("rfa::cross_attention", std::vector<c10::IValue>());
        if (cross.kind == kCrossSoftmax) {
          const bool last = i + 1 == layers.size();
          softmax_cross_step(q, batch.keys[i], batch.values[i], batch.key_biases[i], beam, cross.scaling, out,
                             last ? weights : at::Tensor(), kernels, sentences);
        } else {
          rfa_cross_step(q, batch.cross_states[i], beam, cross.eps, cross.map.kind, cross.map.sigma, cross.map.matrix,
                         out, kernels, sentences);
        }
      }
      y = lib.linear(cross.out_proj, out, false, x);
      x = pre ? y : layer_norm(layer.cross_norm, y, true, kernels);
    }
    // feed-forward: relu fused into the first product, the residual into the second
    const FeedForward& ffn = layer.ffn;
    h = pre ? layer_norm(ffn.final_norm, x, false, kernels) : x;
    const bool relu = ffn.activation == kFFNReLU;
    at::Tensor hidden = lib.linear(ffn.fc1, h, relu, at::Tensor());
    if (!relu) hidden = at::gelu(hidden);
    y = lib.linear(ffn.fc2, hidden, false, x);
    x = pre ? y : layer_norm(ffn.final_norm, y, true, kernels);
  }
  if (final_norm.defined()) x = layer_norm(final_norm, x, true, kernels);
  return lib.linear(output, x, false, at::Tensor(), "rfa::output_projection");
}

void DecodeProgram::check_search_buffers(const NativeSearch& s, int64_t t, int64_t parity, bool first) const {
  TORCH_CHECK(parity == 0 || parity == 1, "rfa search step: parity must be 0 or 1, got ", parity);
  const int64_t N = s.N, K = s.K, R = N * K, V = embed.size(0);
  TORCH_CHECK(N >= 1 && K >= 1, "rfa search step: ", N, " places x ", K, " beams");
  expect(s.tokens0, "search.token_pair[0]", at::kLong, {R, -1});
  const int64_t L = s.tokens0.size(1);
  TORCH_CHECK(t >= 0 && t + 1 < L, "rfa search step: step ", t, " of a token buffer of length ", L);
  expect(s.tokens1, "search.token_pair[1]", at::kLong, {R, L});
  expect(s.scores0, "search.score_pair[0]", at::kFloat, {R, L - 1});
  expect(s.scores1, "search.score_pair[1]", at::kFloat, {R, L - 1});
  const int64_t k = std::min(2 * K, (first ? V : K * V) - 1);
  TORCH_CHECK(k >= K, "rfa search step: ", k, " candidates for ", K, " beams (the vocabulary is too small)");
  expect(s.cand_scores, "search.cand_scores", at::kFloat, {N * k}, true);
  expect(s.cand_indices, "search.cand_indices", at::kLong, {N * k}, true);
  expect(s.cands_to_ignore, "search.cands_to_ignore", at::kBool, {N, K});
  expect(s.finished, "search.finished", at::kBool, {N});
  expect(s.fin_count, "search.fin_count", at::kLong, {N});
  expect(s.fin_tokens, "search.fin_tokens", at::kLong, {R, L}, true);
  expect(s.fin_scores, "search.fin_scores", at::kFloat, {R, L - 1}, true);
  expect(s.fin_steps, "search.fin_steps", at::kLong, {R}, true);
  expect(s.eos_bias, "search.eos_bias", at::kFloat, {t + 1}, true);
  expect(s.step, "search.step", at::kLong, {1});
  expect(s.step_rows, "search.step_rows", at::kLong, {L});
  if (s.positions.defined()) expect(s.positions, "search.positions", at::kFloat, {t + 1, embed.size(1)}, true);
  for (const int64_t token : {s.eos, s.pad, s.unk}) {
    TORCH_CHECK(token >= 0 && token < V, "rfa search step: the special token ", token, " is not in the vocabulary");
  }
  const int64_t* fin = s.fin_count.data_ptr<int64_t>();
  for (int64_t n = 0; n < N; ++n) {
    TORCH_CHECK(fin[n] >= 0 && fin[n] <= K, "rfa search step: search.fin_count[", n, "] = ", fin[n], " of ", K);
  }
  expect(s.order, "search.order", at::kLong, {R}, true);
  if (s.prefix.defined()) expect(s.prefix, "search.prefix_tokens", at::kLong, {N, -1});
  TORCH_CHECK(s.no_repeat_ngram >= 0, "rfa search step: search.no_repeat_ngram_size = ", s.no_repeat_ngram,
              " is negative");
}

void DecodeProgram::check_search_logits(const NativeSearch& s, const at::Tensor& logits, int64_t t, int64_t parity,
                                        bool first) const {
  check_search_buffers(s, t, parity, first);
  expect(logits, "logits", at::kFloat, {-1, embed.size(0)}, false, false);
}

void DecodeProgram::check_search(const NativeBatch& batch, const NativeSearch& s, int64_t t0, int64_t t_last,
                                 int64_t parity, int64_t read, bool first) const {
  TORCH_CHECK(0 <= t0 && t0 <= t_last, "rfa search step: steps ", t0, " to ", t_last);
  check_search_buffers(s, t_last, parity, first);  // the sizes must hold up to the last step
  // the first step decodes one row per sentence (its beams are one hypothesis), with no state to reorder; later
  // steps read tokens and an order the steps before wrote
  const int64_t K = s.K, R = s.N * K;
  const at::Tensor column = (parity == 0 ? s.tokens0 : s.tokens1).select(1, t0);
  check_decode(batch, first ? column.slice(0, 0, R, K).contiguous() : column.contiguous(), at::Tensor(),
               first ? at::Tensor() : s.order.narrow(0, 0, R), read, first, at::Tensor(), first ? 1 : K);
}

void DecodeProgram::check_sources(const NativeBatch& batch, const at::Tensor& key, const at::Tensor& padding) const {
  TORCH_CHECK(batch.keys.size() == layers.size(), "rfa decode program: the batch has ", batch.keys.size(),
              " layers' caches for ", layers.size(), " layers");
  expect(key, "key", at::kFloat, {-1, -1, embed.size(1)}, false, false);
  const int64_t S = key.size(0), n = key.size(1);
  if (padding.defined()) expect(padding, "key_padding_mask", at::kBool, {n, S});
  for (size_t i = 0; i < layers.size(); ++i) {
    const CrossAttention& cross = layers[i].cross;
    if (cross.kind != kCrossSoftmax) continue;
    const std::string at = "state.layers[" + std::to_string(i) + "].cross";
    TORCH_CHECK(cross.kv_proj.in_features == embed.size(1) && cross.kv_proj.out_features == 2 * cross.heads * cross.head_dim,
                "rfa decode program: ", at, ": kv_proj of ", cross.kv_proj.in_features, " -> ",
                cross.kv_proj.out_features, " for ", cross.heads, " heads of ", cross.head_dim);
    expect(batch.keys[i], at + ".key", at::kFloat, {n, cross.heads, S, cross.head_dim});
    expect(batch.values[i], at + ".value", at::kFloat, {n, cross.heads, S, cross.head_dim});
    if (batch.key_biases[i].defined()) expect(batch.key_biases[i], at + ".key_bias", at::kFloat, {n, S});
  }
}

void DecodeProgram::start_sources(const NativeBatch& batch, const at::Tensor& key, const at::Tensor& padding) const {
  const int64_t S = key.size(0), n = key.size(1), C = key.size(2);
  const at::Tensor rows = key.reshape({S * n, C});  // row s * n + b: sentence b's position s
  for (size_t i = 0; i < layers.size(); ++i) {
    const CrossAttention& cross = layers[i].cross;
    if (cross.kind != kCrossSoftmax) continue;
    const int64_t H = cross.heads, d = cross.head_dim, HD = H * d;
    const at::Tensor kv = library_->unrecorded_linear(cross.kv_proj, rows, false, at::Tensor());  // (S * n, 2 HD)
    const float* src = kv.data_ptr<float>();
    const int64_t ld = kv.stride(0);
    float* keys = batch.keys[i].data_ptr<float>();
    float* values = batch.values[i].data_ptr<float>();
    at::parallel_for(0, n * H, 1, [&](int64_t begin, int64_t end) {  // K[b, h, s, :] = kv[s * n + b, h * d:]
      for (int64_t bh = begin; bh < end; ++bh) {
        const int64_t b = bh / H, h = bh % H;
        for (int64_t s = 0; s < S; ++s) {
          const float* row = src + (s * n + b) * ld + h * d;
          std::copy(row, row + d, keys + (bh * S + s) * d);
          std::copy(row + HD, row + HD + d, values + (bh * S + s) * d);
        }
      }
    });
    if (batch.key_biases[i].defined()) {  // the padding as an additive bias: -inf where padded
      float* bias = batch.key_biases[i].data_ptr<float>();
      const bool* padded = padding.defined() ? padding.data_ptr<bool>() : nullptr;
      for (int64_t j = 0; j < n * S; ++j) bias[j] = padded != nullptr && padded[j] ? kNegInf : 0.0f;
    }
  }
}

std::vector<int64_t> DecodeProgram::live_places(const NativeSearch& s, bool first) {
  // the places still translating: a finished place finalizes nothing more, and its rows cost nothing (the batch keeps
  // its places to its end: no halving needed); the first step decodes every place (its rows are one per sentence)
  std::vector<int64_t> live;
  const bool* finished = s.finished.data_ptr<bool>();
  for (int64_t n = 0; n < s.N; ++n) {
    if (first || !finished[n]) live.push_back(n);
  }
  return live;
}

int64_t DecodeProgram::search_step(const NativeBatch& batch, NativeSearch& s, int64_t t, int64_t parity, int64_t read,
                                   bool first, bool last) const {
  const int64_t N = s.N, K = s.K, R = N * K;
  const at::Tensor& tokens = parity == 0 ? s.tokens0 : s.tokens1;
  at::Tensor position = s.positions.defined() ? s.positions.narrow(0, t, 1) : at::Tensor();
  // each live place decoded at its place among them (p)
  const std::vector<int64_t> live = live_places(s, first);
  const int64_t live_count = static_cast<int64_t>(live.size());
  if (live_count == 0) {
    s.step_rows.data_ptr<int64_t>()[t] = 0;
    s.step.fill_(t + 1);
    return N;
  }
  at::Tensor last_tokens, state_order, sentences;
  if (first) {
    // the first step decodes one row per sentence: its beams are copies of one hypothesis (BOS, no state), and only
    // the first beam's candidates count; those rows' states go to rows 0 .. N - 1, which the reorder names
    last_tokens = tokens.select(1, t).slice(0, 0, R, K).contiguous();
  } else if (live_count == N) {
    last_tokens = tokens.select(1, t).contiguous();
    state_order = s.order.narrow(0, 0, R);
  } else {  // the live places' rows, packed: row p * K + b is place live[p]'s beam b
    sentences = at::tensor(live, s.order.options());
    const at::Tensor rows = (sentences.unsqueeze(1) * K + at::arange(K, s.order.options())).view(-1);
    last_tokens = tokens.select(1, t).index_select(0, rows);
    state_order = s.order.index_select(0, rows);
  }
  const at::Tensor logits = decode(batch, last_tokens, position, state_order, read, first, false, at::Tensor(),
                                   first ? 1 : K, sentences);
  s.step_rows.data_ptr<int64_t>()[t] = logits.size(0);
  return choose(s, logits, live, t, parity, first, last);
}

int64_t DecodeProgram::choose(NativeSearch& s, const at::Tensor& logits, const std::vector<int64_t>& live, int64_t t,
                              int64_t parity, bool first, bool last) const {
  const int64_t N = s.N, K = s.K, live_count = static_cast<int64_t>(live.size());
  at::Tensor& tokens = parity == 0 ? s.tokens0 : s.tokens1;
  at::Tensor& scores = parity == 0 ? s.scores0 : s.scores1;
  at::Tensor& next_tokens = parity == 0 ? s.tokens1 : s.tokens0;
  at::Tensor& next_scores = parity == 0 ? s.scores1 : s.scores0;
  const int64_t L = tokens.size(1);
  bool* finished = s.finished.data_ptr<bool>();
  const int64_t V = logits.size(1);
  const int64_t k = std::min(2 * K, (first ? V : K * V) - 1);  // -1: never pad (SequenceGenerator)
  const int64_t beams = first ? 1 : K;  // the first step: a sentence's beams are one hypothesis
  const float* lg = logits.data_ptr<float>();
  const int64_t ldl = logits.stride(0);
  int64_t* tok = tokens.data_ptr<int64_t>();
  float* sc = scores.data_ptr<float>();
  int64_t* next_tok = next_tokens.data_ptr<int64_t>();
  float* next_sc = next_scores.data_ptr<float>();
  float* cand_scores = s.cand_scores.data_ptr<float>();
  int64_t* cand_indices = s.cand_indices.data_ptr<int64_t>();
  bool* ignore = s.cands_to_ignore.data_ptr<bool>();
  int64_t* fin_count = s.fin_count.data_ptr<int64_t>();
  int64_t* fin_tok = s.fin_tokens.data_ptr<int64_t>();
  float* fin_sc = s.fin_scores.data_ptr<float>();
  int64_t* fin_steps = s.fin_steps.data_ptr<int64_t>();
  int64_t* order = s.order.data_ptr<int64_t>();
  const float eos_bias = s.eos_bias.data_ptr<float>()[t];
  const float unk_penalty = static_cast<float>(s.unk_penalty);
  const int64_t eos = s.eos, pad = s.pad, unk = s.unk, Ls = L - 1;
  // prefix tokens (fairseq's --prefix-size, SequenceGenerator._prefix_tokens): at a step inside the prefix a place's
  // beams may only take its token there (none where the place's prefix has pad), and the minimum length's EOS mask is
  // off; a prefix that ends in EOS makes every beam of its place a copy of the first
  const bool prefix_step = s.prefix.defined() && t < s.prefix.size(1) && !last;
  const int64_t* prefix = prefix_step ? s.prefix.data_ptr<int64_t>() : nullptr;
  const int64_t prefix_len = prefix_step ? s.prefix.size(1) : 0;
  // --no-repeat-ngram-size n: a beam never takes a token that would repeat one of its n-grams (the n - 1 tokens it
  // ends with, followed by the token that followed them before), over its tokens so far, BOS included
  const int64_t ngram = s.no_repeat_ngram, check_from = t + 2 - ngram;

  const rfa::cpu::Kernels& kernels = library_->kernels();
  RECORD_FUNCTION("rfa::search", std::vector<c10::IValue>());
  at::parallel_for(0, live_count, 1, [&](int64_t begin, int64_t end) {
    std::vector<char> eos_mask(k), ended(k);
    std::vector<int64_t> active(K);
    std::vector<float> row_max(beams), row_log_sum(beams), row_add(beams);
    std::vector<std::vector<int64_t>> banned(beams);
    for (int64_t p = begin; p < end; ++p) {
      const int64_t n = live[p];
      const int64_t forced = prefix_step ? prefix[n * prefix_len + t] : pad;
      const bool copy_first_beam = forced == eos && !first;
      if (copy_first_beam) {  // the place's beams become copies of its first: tokens and scores so far, logits
        for (int64_t b = 1; b < K; ++b) {
          std::copy(tok + n * K * L, tok + n * K * L + t + 1, tok + (n * K + b) * L);
          std::copy(sc + n * K * Ls, sc + n * K * Ls + t, sc + (n * K + b) * Ls);
        }
      }
      // the logits of place p's beam b
      auto row = [&](int64_t b) { return lg + (first ? p : p * K + (copy_first_beam ? 0 : b)) * ldl; };
      // candidates: per beam, log_softmax(logits) with the masks (pad never, unk penalized, EOS only from the
      // minimum length and alone at the last step, the prefix's token alone, no repeated n-gram) plus the beam's
      // score so far; the k best over the beams
      for (int64_t b = 0; b < beams; ++b) {
        kernels.row_log_sum_exp(row(b), V, &row_max[b], &row_log_sum[b]);
        row_add[b] = first ? 0.0f : sc[(n * K + b) * Ls + t - 1];
        banned[b].clear();
        if (ngram > 0 && check_from >= 0) {
          const int64_t* history = tok + (n * K + b) * L;  // tokens 0 .. t
          const int64_t* tail = history + t + 2 - ngram;   // the last n - 1
          for (int64_t i = 0; i < check_from; ++i) {
            if (std::equal(tail, tail + ngram - 1, history + i)) banned[b].push_back(history[i + ngram - 1]);
          }
        }
      }
      auto value = [&](int64_t b, int64_t v) {
        if (v == pad || (last && v != eos) || (forced != pad && v != forced)) return kNegInf;
        float lp = (row(b)[v] - row_max[b]) - row_log_sum[b];
        if (!last) {
          if (v == unk) lp -= unk_penalty;
          if (v == eos && !prefix_step) lp += eos_bias;
        }
        if (!banned[b].empty() && std::find(banned[b].begin(), banned[b].end(), v) != banned[b].end()) return kNegInf;
        return std::isnan(lp) ? kNegInf : lp + row_add[b];
      };
      // the block's largest logit bounds its candidates: the masks only lower a value, but for a negative unk
      // penalty (which raises <unk>)
      auto bound = [&](int64_t b, int64_t start, int64_t len) {
        const bool raises_unk = !last && unk_penalty < 0.0f && unk >= start && unk < start + len;
        return (kernels.block_max(row(b) + start, len) - row_max[b]) - row_log_sum[b] + row_add[b] -
               (raises_unk ? unk_penalty : 0.0f);
      };
      TopK best{cand_scores + n * k, cand_indices + n * k, k};
      sentence_candidates(best, beams, V, value, bound);
      const float* cs = cand_scores + n * k;
      const int64_t* ci = cand_indices + n * k;
      // EOS candidates (finite) end a hypothesis, but not those the last step's advance ignored, nor in a
      // sentence already finished
      for (int64_t j = 0; j < k; ++j) {
        const bool is_eos = ci[j] % V == eos && cs[j] != kNegInf;
        eos_mask[j] = is_eos && !(j < K && ignore[n * K + j]) && !finished[n];
        ended[j] = eos_mask[j] || (j < K && ignore[n * K + j]);
      }
      // finalize: the EOS hypotheses among the top K take the sentence's free slots (at most K), in order
      int64_t count = fin_count[n];
      bool any_eos = false;
      for (int64_t j = 0; j < K; ++j) {
        if (!eos_mask[j]) continue;
        any_eos = true;
        if (count >= K) continue;
        const int64_t slot = n * K + count++;
        const int64_t source = n * K + ci[j] / V;
        std::copy(tok + source * L, tok + source * L + t + 1, fin_tok + slot * L);
        fin_tok[slot * L + t + 1] = eos;
        std::copy(sc + source * Ls, sc + source * Ls + t, fin_sc + slot * Ls);
        fin_sc[slot * Ls + t] = cs[j];
        fin_steps[slot] = t;
      }
      fin_count[n] = count;
      if (count == K || (last && any_eos)) finished[n] = true;
      // advance: each beam continues with the next best candidate that does not end in EOS (EOS ones, and those
      // ignored, only when fewer than K remain: then ignored at the next step)
      int64_t taken = 0;
      for (int pass = 0; pass < 2 && taken < K; ++pass) {
        for (int64_t j = 0; j < k && taken < K; ++j) {
          if (static_cast<bool>(ended[j]) == (pass == 1)) active[taken++] = j;
        }
      }
      for (int64_t j = 0; j < K; ++j) {
        const int64_t c = active[j], row_j = n * K + j;
        ignore[row_j] = ended[c];
        const int64_t source = n * K + ci[c] / V;
        // the state row to continue: the first step wrote one per sentence, later steps one per live row
        order[row_j] = first ? p : p * K + ci[c] / V;
        std::copy(tok + source * L, tok + source * L + t + 1, next_tok + row_j * L);
        next_tok[row_j * L + t + 1] = ci[c] % V;
        std::copy(sc + source * Ls, sc + source * Ls + t, next_sc + row_j * Ls);
        next_sc[row_j * Ls + t] = cs[c];
      }
    }
  });
  s.step.fill_(t + 1);
  return std::count(finished, finished + N, true);
}

std::pair<int64_t, int64_t> DecodeProgram::search_steps(const NativeBatch& batch, NativeSearch& s, int64_t t0,
                                                        int64_t parity, int64_t read, int64_t last_step,
                                                        int64_t max_len) const {
  const int64_t N = s.N;
  for (int64_t t = t0;; ++t) {
    const int64_t finished = search_step(batch, s, t, parity, read, t == 0, t >= max_len);
    parity ^= 1;
    read ^= 1;
    if (t >= last_step || finished == N) return {t, finished};
  }
}

// ------------------------------------------------------------------------------------------------ bindings


void bind_decode_program(py::module_& m) {
  m.def(
      "limit_this_thread",
      [](int64_t threads) {
        TORCH_CHECK(threads > 0, "limit_this_thread: threads must be positive, got ", threads);
        // torch applies its global thread count to a thread on its first parallel call, once per library (the flag is
        // an inline function's thread_local: libtorch's copy and this module's): take both first, so that neither
        // undoes the limit later
        at::get_num_threads();
        at::internal::lazy_init_num_threads();
        omp_set_num_threads(static_cast<int>(threads));
        if (MKL_Set_Num_Threads_Local != nullptr) MKL_Set_Num_Threads_Local(static_cast<int>(threads));
      },
      py::arg("threads"),
      "the calling thread's OpenMP and MKL teams (torch's ops, the native step, its GEMMs) from now on: per-thread "
      "settings (the OpenMP ICV, MKL's local count), other threads keep theirs");
  py::class_<NativeBatch>(m, "NativeBatch").def(py::init<const py::list&>(), py::arg("layer_caches"));
  py::class_<NativeSearch>(m, "NativeSearch").def(py::init<const py::object&>(), py::arg("search"));
  py::class_<DecodeProgram>(m, "DecodeProgram")
      .def(py::init<const py::object&, std::shared_ptr<LinearLibrary>>(), py::arg("runtime"), py::arg("library"))
      .def(
          "decode",
          [](const DecodeProgram& program, const NativeBatch& batch, const at::Tensor& tokens,
             const std::optional<at::Tensor>& positions, const std::optional<at::Tensor>& order, int64_t read,
             bool first, bool padded_inputs, const std::optional<at::Tensor>& weights, int64_t beam) {
            program.check_decode(batch, tokens, or_undefined(positions), or_undefined(order), read, first,
                                 or_undefined(weights), beam);
            py::gil_scoped_release release;
            at::NoGradGuard no_grad;
            return program.decode(batch, tokens, or_undefined(positions), or_undefined(order), read, first,
                                  padded_inputs, or_undefined(weights), beam);
          },
          py::arg("batch"), py::arg("tokens"), py::arg("positions"), py::arg("order"), py::arg("read"),
          py::arg("first"), py::arg("padded_inputs"), py::arg("weights"), py::arg("beam"),
          "logits of one decoding step (decode_program.h)")
      .def(
          "search_step",
          [](const DecodeProgram& program, const NativeBatch& batch, NativeSearch& search, int64_t t, int64_t parity,
             int64_t read, bool first, bool last) {
            program.check_search(batch, search, t, t, parity, read, first);
            py::gil_scoped_release release;
            at::NoGradGuard no_grad;
            return program.search_step(batch, search, t, parity, read, first, last);
          },
          py::arg("batch"), py::arg("search"), py::arg("t"), py::arg("parity"), py::arg("read"), py::arg("first"),
          py::arg("last"), "the static beam search's whole step (decode_program.h)")
      .def(
          "start_sources",
          [](const DecodeProgram& program, const NativeBatch& batch, const at::Tensor& key,
             const std::optional<at::Tensor>& padding) {
            const at::Tensor mask = padding.has_value() ? padding->contiguous() : at::Tensor();
            program.check_sources(batch, key, mask);
            py::gil_scoped_release release;
            at::NoGradGuard no_grad;
            program.start_sources(batch, key, mask);
          },
          py::arg("batch"), py::arg("key"), py::arg("key_padding_mask"),
          "a batch's start: every softmax cross-attention layer's K, V and padding bias of the encoder output "
          "(decode_program.h)")
      .def(
          "search_choose",
          [](const DecodeProgram& program, NativeSearch& search, const at::Tensor& logits, int64_t t, int64_t parity,
             bool first, bool last) {
            program.check_search_logits(search, logits, t, parity, first);
            const std::vector<int64_t> live = DecodeProgram::live_places(search, first);
            TORCH_CHECK(logits.size(0) == static_cast<int64_t>(live.size()) * (first ? 1 : search.K),
                        "rfa search choose: ", logits.size(0), " rows of logits for ", live.size(), " live places");
            py::gil_scoped_release release;
            return program.choose(search, logits, live, t, parity, first, last);
          },
          py::arg("search"), py::arg("logits"), py::arg("t"), py::arg("parity"), py::arg("first"), py::arg("last"),
          "the search's part of step t on given logits of the live places' rows (tests compare it with the torch "
          "search on the same logits)")
      .def(
          "search_steps",
          [](const DecodeProgram& program, const NativeBatch& batch, NativeSearch& search, py::object rows, int64_t t0,
             int64_t last_step, int64_t max_len) {
            TORCH_CHECK(last_step <= max_len, "rfa search steps: the last step ", last_step, " is past max_len ",
                        max_len);
            Record account(rows, "rows");
            const int64_t parity = account.integer("parity");
            TORCH_CHECK(account.flag("first") == (t0 == 0), "rfa search steps: step ", t0, " of a batch whose rows ",
                        account.flag("first") ? "start at step 0" : "have run steps");
            program.check_search(batch, search, t0, last_step, parity, parity, t0 == 0);
            std::pair<int64_t, int64_t> result;
            {
              py::gil_scoped_release release;
              at::NoGradGuard no_grad;
              result = program.search_steps(batch, search, t0, parity, parity, last_step, max_len);
            }
            // the rows' account follows: the buffer pairs turned once per step run
            rows.attr("parity") = (parity + result.first - t0 + 1) % 2;
            rows.attr("first") = false;
            return result;
          },
          py::arg("batch"), py::arg("search"), py::arg("rows"), py::arg("t0"), py::arg("last_step"),
          py::arg("max_len"),
          "the static beam search's steps from t0 until every place has finished or the last step, in one call; the "
          "rows' account (BatchRows: its parity, first) is read and updated (decode_program.h)");
}
