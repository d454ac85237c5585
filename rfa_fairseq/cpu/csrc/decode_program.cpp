// The decoder's step on the CPU as one native call (decode_program.h). The step is the same function as the torch
// reference (rfa_fairseq/modules/decoding.py's records): the same kernels (step_kernels.cpp, on the runtime's
// instruction-set level), the same linear layers (linear_layers.h: the level's kernels on the weights kept once); what
// it removes is Python between ~250 operations a step. The static beam search's step around it is native_search.cpp.
//
// The step's parts are named for torch's profiler (RECORD_FUNCTION, free when no profiler runs), each region
// exclusive of the others (none nests in another): rfa::linear, rfa::output_projection, rfa::causal_attention,
// rfa::cross_attention, rfa::layer_norm, rfa::embedding here and rfa::search (candidates, finalization, reorder:
// native_search.cpp); benchmarks/profile_generate.py sums them.
#include "decode_program.h"

#include <ATen/Parallel.h>
#include <ATen/record_function.h>

#include <algorithm>
#include <limits>

#include "tensor_checks.h"

namespace py = pybind11;

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

NativeBatch::NativeBatch(const py::list& layer_caches, const py::object& output_record) {
  if (!output_record.is_none()) output = LinearLayer::from(Record(output_record, "state.output.projection"));
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
  if (batch.output) {
    TORCH_CHECK(batch.output->in_features == C && batch.output->out_features >= 1 &&
                    batch.output->out_features <= output.out_features,
                "rfa decode program: the batch's output projection maps ", batch.output->in_features, " inputs to ",
                batch.output->out_features, " columns, the model's ", C, " to ", output.out_features);
  }
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
                                 const at::Tensor& weights, int64_t beam, const at::Tensor& sentences,
                                 const at::Tensor& state_rows, const at::Tensor& logits) const {
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
                        self_attn.map.matrix, kernels, state_rows, beam);
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
  return lib.linear(batch.output ? *batch.output : output, x, false, at::Tensor(), "rfa::output_projection", logits);
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
