// The whole decoding step on the CPU as one native call (decode_program.h). The step is the same function as the
// torch reference (rfa_fairseq/modules/decoding.py's records and generation/static_beam_search.py's _step): the same
// kernels (rfa_decode_step.cpp), the same linear layers (oneDNN through torch's operators, named by
// rfa_fairseq/torch_internals.py), the same search arithmetic; what it removes is Python between ~250 operations a
// step. It also fuses the log-softmax into the choice of the candidates: the log-probabilities are never written,
// each row's log-sum-exp is taken in one vectorized pass and the candidates are read off the logits.
//
// The step's parts are named for torch's profiler (RECORD_FUNCTION, free when no profiler runs): rfa::linear,
// rfa::output_projection, rfa::causal_attention, rfa::cross_attention, rfa::layer_norm, rfa::embedding and
// rfa::search (candidates, finalization, reorder); benchmarks/profile_generate.py sums them.
#include "decode_program.h"

#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <omp.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "rfa_kernels.h"

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// The calling thread's OpenMP team size for the duration of a call (threads <= 0: unchanged): a thread that decodes
// its own part of a batch runs every kernel and GEMM of its step on itself alone. OpenMP's thread count is a
// per-thread setting, so other threads keep theirs.
class ThreadScope {
 public:
  explicit ThreadScope(int64_t threads) : saved_(at::get_num_threads()) {
    if (threads > 0 && threads != saved_) omp_set_num_threads(static_cast<int>(threads));
  }
  ~ThreadScope() { omp_set_num_threads(saved_); }

 private:
  int saved_;
};

at::Tensor or_empty(const at::Tensor& t) { return t.defined() ? t : at::Tensor(); }
at::Tensor empty_if_undefined(const at::Tensor& t) { return t.defined() ? t : at::empty({0}); }

c10::IValue optional_tensor(const at::Tensor& t) { return t.defined() ? c10::IValue(t) : c10::IValue(); }

c10::IValue empty_scalar_list() {
  return c10::IValue(c10::impl::GenericList(c10::OptionalType::create(c10::NumberType::get())));
}

}  // namespace

DecodeProgram::DecodeProgram(int64_t gemm, std::vector<std::string> onednn_ops) : gemm_(gemm) {
  TORCH_CHECK(gemm == kGemmTorch || gemm == kGemmOneDNN || gemm == kGemmOneDNNInt8, "rfa decode program: unknown gemm ",
              gemm);
  // onednn_ops: (name, overload) pairs of torch's oneDNN linear, its residual-add form and its int8 linear
  TORCH_CHECK(gemm == kGemmTorch || onednn_ops.size() == 6, "rfa decode program: the oneDNN operators' names are missing");
  auto& dispatcher = c10::Dispatcher::singleton();
  if (gemm == kGemmOneDNN) {
    linear_op_ = dispatcher.findSchemaOrThrow(onednn_ops[0].c_str(), onednn_ops[1].c_str());
    linear_add_op_ = dispatcher.findSchemaOrThrow(onednn_ops[2].c_str(), onednn_ops[3].c_str());
  } else if (gemm == kGemmOneDNNInt8) {
    qlinear_op_ = dispatcher.findSchemaOrThrow(onednn_ops[4].c_str(), onednn_ops[5].c_str());
  }
}

at::Tensor DecodeProgram::linear(const LinearLayer& layer, const at::Tensor& x, bool relu, const at::Tensor& residual,
                                 const char* part) const {
  RECORD_FUNCTION(part, std::vector<c10::IValue>());
  switch (gemm_) {
    case kGemmOneDNN: {
      torch::jit::Stack stack;
      if (residual.defined() && !relu) {  // y = x W^T + b + residual, the add fused into the product
        stack = {x, residual, layer.weight, optional_tensor(layer.bias), std::string("add")};
        linear_add_op_->callBoxed(&stack);
        return stack[0].toTensor();
      }
      stack = {x, layer.weight, optional_tensor(layer.bias), std::string(relu ? "relu" : "none"), empty_scalar_list(),
               std::string("")};
      linear_op_->callBoxed(&stack);
      at::Tensor y = stack[0].toTensor();
      if (residual.defined()) y.add_(residual);
      return y;
    }
    case kGemmOneDNNInt8: {
      // each row quantized with its own scale, oneDNN's int8 product with the weights' per-channel scales, then
      // the row scales, bias, relu and residual in one pass
      const at::Tensor input = x.is_contiguous() ? x : x.contiguous();
      at::Tensor codes = at::empty(input.sizes(), input.options().dtype(at::kByte));
      at::Tensor row_scales = at::empty({input.size(0)}, input.options());
      quantize_rows(input, codes, row_scales);
      torch::jit::Stack stack = {codes, 1.0, kInt8RowZeroPoint, layer.weight, layer.w_scales, layer.w_zero_points,
                                 c10::IValue(), 1.0, int64_t{0}, c10::IValue(at::kFloat), std::string("none"),
                                 empty_scalar_list(), std::string("")};
      qlinear_op_->callBoxed(&stack);
      at::Tensor y = stack[0].toTensor();
      scale_rows(y, row_scales, empty_if_undefined(layer.bias), empty_if_undefined(residual), relu);
      return y;
    }
    default: {
      at::Tensor y = layer.bias.defined() ? at::addmm(layer.bias, x, layer.weight.t()) : at::mm(x, layer.weight.t());
      if (relu) y.relu_();
      if (residual.defined()) y.add_(residual);
      return y;
    }
  }
}

namespace {

// LayerNorm(x) into a new tensor, or into x itself (in_place)
at::Tensor layer_norm(const Norm& norm, at::Tensor x, bool in_place) {
  RECORD_FUNCTION("rfa::layer_norm", std::vector<c10::IValue>());
  at::Tensor out = in_place ? x : at::empty_like(x);
  at::Tensor none = at::empty({0});
  add_layer_norm(x, none, norm.weight, norm.bias, norm.eps, out);
  return out;
}

at::Tensor map_tensor(const at::Tensor& t) { return t.defined() ? t : at::empty({0}); }

}  // namespace

at::Tensor DecodeProgram::decode_rows(const NativeBatch& batch, const at::Tensor& tokens, const at::Tensor& positions,
                                      const at::Tensor& order, int64_t read, bool first, bool padded_inputs,
                                      at::Tensor weights, int64_t beam) {
  TORCH_CHECK(read == 0 || read == 1, "rfa decode program: read must be 0 or 1");
  TORCH_CHECK(batch.states0.size() == layers.size() && batch.states1.size() == layers.size(),
              "rfa decode program: the batch has ", batch.states0.size(), " layers' states for ", layers.size(),
              " layers");
  const int64_t R = tokens.size(0);
  at::Tensor x;
  {
    RECORD_FUNCTION("rfa::embedding", std::vector<c10::IValue>());
    x = at::index_select(embed, 0, tokens);  // (R, C)
    if (embed_scale != 1.0) x.mul_(embed_scale);
    if (positions.defined() && positions.numel() > 0) x.add_(positions);
  }
  if (embed_norm.defined()) x = layer_norm(embed_norm, x, true);
  at::Tensor none = at::empty({0});
  at::Tensor key_pad = padded_inputs ? tokens.eq(padding_idx) : none;
  const at::Tensor& state_order = first || !order.defined() ? none : order;
  for (size_t i = 0; i < layers.size(); ++i) {
    const DecoderLayerProgram& layer = layers[i];
    const bool pre = layer.normalize_before;
    // causal self-attention: one fused input projection [q | k | v | gate logits], the kernel, the output projection
    const CausalAttention& self_attn = layer.self_attn;
    const int64_t H = self_attn.heads, d = self_attn.head_dim, C = H * d, width = H * self_attn.map.width;
    at::Tensor h = pre ? layer_norm(layer.self_attn_norm, x, false) : x;
    at::Tensor proj = linear(self_attn.proj, h, false, at::Tensor());
    at::Tensor attn = at::empty({R, C}, x.options());
    at::Tensor state_out = read == 0 ? batch.states1[i] : batch.states0[i];
    at::Tensor state_in = first ? none : (read == 0 ? batch.states0[i] : batch.states1[i]);
    {
      RECORD_FUNCTION("rfa::causal_attention", std::vector<c10::IValue>());
      causal_layer_step(proj.narrow(1, 0, width), proj.narrow(1, width, width), proj.narrow(1, 2 * width, C),
                      self_attn.gated ? proj.narrow(1, 2 * width + C, H) : none, key_pad, state_in, state_order,
                        state_out, attn, self_attn.eps, self_attn.map.kind, map_tensor(self_attn.map.sigma),
                        map_tensor(self_attn.map.matrix));
    }
    at::Tensor y = linear(self_attn.out_proj, attn, false, x);
    x = pre ? y : layer_norm(layer.self_attn_norm, y, true);
    // cross-attention over the per-sentence K / V (or RFA state)
    const CrossAttention& cross = layer.cross;
    if (cross.kind != kCrossNone) {
      h = pre ? layer_norm(layer.cross_norm, x, false) : x;
      at::Tensor q = linear(cross.q_proj, h, false, at::Tensor());
      at::Tensor out = at::empty({R, C}, x.options());
      RECORD_FUNCTION("rfa::cross_attention", std::vector<c10::IValue>());
      if (cross.kind == kCrossSoftmax) {
        const bool last = i + 1 == layers.size();
        at::Tensor w = last && weights.defined() && weights.numel() > 0 ? weights : none;
        softmax_cross_step(q, batch.keys[i], batch.values[i], map_tensor(batch.key_biases[i]), beam,
                           cross.scaling, out, w);
      } else {
        rfa_cross_step(q, batch.cross_states[i], beam, cross.eps, cross.map.kind, map_tensor(cross.map.sigma),
                       map_tensor(cross.map.matrix), out);
      }
      y = linear(cross.out_proj, out, false, x);
      x = pre ? y : layer_norm(layer.cross_norm, y, true);
    }
    // feed-forward: relu fused into the first product, the residual into the second
    h = pre ? layer_norm(layer.final_norm, x, false) : x;
    const bool relu = layer.ffn_activation == kFFNReLU;
    at::Tensor hidden = linear(layer.fc1, h, relu, at::Tensor());
    if (!relu) hidden = at::gelu(hidden);
    y = linear(layer.fc2, hidden, false, x);
    x = pre ? y : layer_norm(layer.final_norm, y, true);
  }
  if (final_norm.defined()) x = layer_norm(final_norm, x, true);
  return linear(output, x, false, at::Tensor(), "rfa::output_projection");
}

at::Tensor DecodeProgram::decode(const NativeBatch& batch, const at::Tensor& tokens, const at::Tensor& positions,
                                 const at::Tensor& order, int64_t read, bool first, bool padded_inputs,
                                 at::Tensor weights, int64_t threads) {
  ThreadScope scope(threads);
  at::NoGradGuard no_grad;
  return decode_rows(batch, tokens, positions, order, read, first, padded_inputs, weights, batch.beam);
}

int64_t DecodeProgram::search_step(const NativeBatch& batch, NativeSearch& s, int64_t t, int64_t parity, int64_t read,
                                   bool first, bool last, int64_t threads) {
  ThreadScope scope(threads);
  at::NoGradGuard no_grad;
  const int64_t N = s.N, K = s.K, R = N * K;
  TORCH_CHECK(parity == 0 || parity == 1, "rfa search step: parity must be 0 or 1");
  const at::Tensor& tokens = parity == 0 ? s.tokens0 : s.tokens1;
  const at::Tensor& scores = parity == 0 ? s.scores0 : s.scores1;
  at::Tensor& next_tokens = parity == 0 ? s.tokens1 : s.tokens0;
  at::Tensor& next_scores = parity == 0 ? s.scores1 : s.scores0;
  const int64_t L = tokens.size(1);
  TORCH_CHECK(tokens.size(0) == R && t + 1 < L, "rfa search step: step ", t, " of a (", tokens.size(0), ", ", L,
              ") token buffer for ", N, " places x ", K, " beams");
  at::Tensor position = s.positions.defined() ? s.positions.narrow(0, t, 1) : at::Tensor();
  // the first step decodes one row per sentence: its beams are copies of one hypothesis (BOS, no state), and only
  // the first beam's candidates count; those rows' states go to rows 0 .. N - 1, which the reorder below names
  at::Tensor last_tokens = first ? tokens.select(1, t).slice(0, 0, R, K).contiguous() : tokens.select(1, t).contiguous();
  at::Tensor logits = decode_rows(batch, last_tokens, position, s.order, read, first, false, at::Tensor(),
                                  first ? 1 : batch.beam);
  const int64_t V = logits.size(1);
  const int64_t k = std::min(2 * K, (first ? V : K * V) - 1);  // -1: never pad (SequenceGenerator)
  TORCH_CHECK(k >= K, "rfa search step: ", k, " candidates for ", K, " beams (the vocabulary is too small)");
  const int64_t beams = first ? 1 : K;  // the first step: a sentence's beams are one hypothesis
  const float* lg = logits.data_ptr<float>();
  const int64_t ldl = logits.stride(0);
  const int64_t* tok = tokens.data_ptr<int64_t>();
  const float* sc = scores.data_ptr<float>();
  int64_t* next_tok = next_tokens.data_ptr<int64_t>();
  float* next_sc = next_scores.data_ptr<float>();
  float* cand_scores = s.cand_scores.data_ptr<float>();
  int64_t* cand_indices = s.cand_indices.data_ptr<int64_t>();
  bool* ignore = s.cands_to_ignore.data_ptr<bool>();
  bool* finished = s.finished.data_ptr<bool>();
  int64_t* fin_count = s.fin_count.data_ptr<int64_t>();
  int64_t* fin_tok = s.fin_tokens.data_ptr<int64_t>();
  float* fin_sc = s.fin_scores.data_ptr<float>();
  int64_t* fin_steps = s.fin_steps.data_ptr<int64_t>();
  int64_t* order = s.order.data_ptr<int64_t>();
  const float eos_bias = s.eos_bias.data_ptr<float>()[t];
  const float unk_penalty = static_cast<float>(s.unk_penalty);
  const int64_t eos = s.eos, pad = s.pad, unk = s.unk, Ls = L - 1;
  TORCH_CHECK(s.cand_scores.numel() >= N * k && s.cand_indices.numel() >= N * k && s.order.numel() >= R &&
                  s.fin_tokens.size(0) >= R && s.fin_tokens.size(1) == L && s.fin_scores.size(1) == Ls,
              "rfa search step: the search's buffers are too small for ", N, " places x ", K, " beams");
  constexpr int64_t kBlock = 64;

  RECORD_FUNCTION("rfa::search", std::vector<c10::IValue>());
  at::parallel_for(0, N, 1, [&](int64_t begin, int64_t end) {
    std::vector<char> eos_mask(k), ended(k);
    std::vector<int64_t> active(K);
    for (int64_t n = begin; n < end; ++n) {
      // candidates: per beam, log_softmax(logits) with the masks (pad never, unk penalized, EOS only from the
      // minimum length and alone at the last step) plus the beam's score so far; the k best over the beams
      TopK best{cand_scores + n * k, cand_indices + n * k, k};
      for (int64_t b = 0; b < beams; ++b) {
        const int64_t row = n * K + b;
        const float* x = lg + (first ? n : row) * ldl;
        float m, log_sum;
        row_log_sum_exp(x, V, &m, &log_sum);
        const float add = first ? 0.0f : sc[row * Ls + t - 1];
        auto value = [&](int64_t v) {
          if (v == pad || (last && v != eos)) return kNegInf;
          float lp = (x[v] - m) - log_sum;
          if (!last) {
            if (v == unk) lp -= unk_penalty;
            if (v == eos) lp += eos_bias;
          }
          return std::isnan(lp) ? kNegInf : lp + add;
        };
        for (int64_t start = 0; start < V; start += kBlock) {
          const int64_t len = std::min(kBlock, V - start);
          // the block's largest logit bounds its candidates: the masks only lower a value, but for a negative
          // unk penalty (which raises <unk>)
          const bool raises_unk = !last && unk_penalty < 0.0f && unk >= start && unk < start + len;
          const float bound = (block_max(x + start, len) - m) - log_sum + add - (raises_unk ? unk_penalty : 0.0f);
          if (best.count == k && !(bound > best.worst())) continue;
          for (int64_t v = start; v < start + len; ++v) best.offer(value(v), b * V + v);
        }
      }
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
        const int64_t c = active[j], row = n * K + j;
        ignore[row] = ended[c];
        const int64_t source = n * K + ci[c] / V;
        order[row] = first ? n : source;  // the state row to continue (the first step wrote one per sentence)
        std::copy(tok + source * L, tok + source * L + t + 1, next_tok + row * L);
        next_tok[row * L + t + 1] = ci[c] % V;
        std::copy(sc + source * Ls, sc + source * Ls + t, next_sc + row * Ls);
        next_sc[row * Ls + t] = cs[c];
      }
    }
  });
  if (s.step.defined()) s.step.fill_(t + 1);
  return std::count(finished, finished + N, true);
}

void bind_decode_program(pybind11::module_& m) {
  namespace py = pybind11;
  py::class_<LinearLayer>(m, "LinearLayer")
      .def(py::init<>())
      .def_readwrite("weight", &LinearLayer::weight)
      .def_readwrite("bias", &LinearLayer::bias)
      .def_readwrite("w_scales", &LinearLayer::w_scales)
      .def_readwrite("w_zero_points", &LinearLayer::w_zero_points)
      .def_readwrite("out_features", &LinearLayer::out_features);
  py::class_<Norm>(m, "Norm")
      .def(py::init<>())
      .def_readwrite("weight", &Norm::weight)
      .def_readwrite("bias", &Norm::bias)
      .def_readwrite("eps", &Norm::eps);
  py::class_<FeatureMapSpec>(m, "FeatureMapSpec")
      .def(py::init<>())
      .def_readwrite("kind", &FeatureMapSpec::kind)
      .def_readwrite("width", &FeatureMapSpec::width)
      .def_readwrite("features", &FeatureMapSpec::features)
      .def_readwrite("sigma", &FeatureMapSpec::sigma)
      .def_readwrite("matrix", &FeatureMapSpec::matrix);
  py::class_<CausalAttention>(m, "CausalAttention")
      .def(py::init<>())
      .def_readwrite("proj", &CausalAttention::proj)
      .def_readwrite("out_proj", &CausalAttention::out_proj)
      .def_readwrite("map", &CausalAttention::map)
      .def_readwrite("heads", &CausalAttention::heads)
      .def_readwrite("head_dim", &CausalAttention::head_dim)
      .def_readwrite("gated", &CausalAttention::gated)
      .def_readwrite("eps", &CausalAttention::eps);
  py::class_<CrossAttention>(m, "CrossAttention")
      .def(py::init<>())
      .def_readwrite("kind", &CrossAttention::kind)
      .def_readwrite("q_proj", &CrossAttention::q_proj)
      .def_readwrite("out_proj", &CrossAttention::out_proj)
      .def_readwrite("map", &CrossAttention::map)
      .def_readwrite("heads", &CrossAttention::heads)
      .def_readwrite("head_dim", &CrossAttention::head_dim)
      .def_readwrite("scaling", &CrossAttention::scaling)
      .def_readwrite("eps", &CrossAttention::eps);
  py::class_<DecoderLayerProgram>(m, "DecoderLayerProgram")
      .def(py::init<>())
      .def_readwrite("self_attn", &DecoderLayerProgram::self_attn)
      .def_readwrite("self_attn_norm", &DecoderLayerProgram::self_attn_norm)
      .def_readwrite("cross", &DecoderLayerProgram::cross)
      .def_readwrite("cross_norm", &DecoderLayerProgram::cross_norm)
      .def_readwrite("fc1", &DecoderLayerProgram::fc1)
      .def_readwrite("fc2", &DecoderLayerProgram::fc2)
      .def_readwrite("ffn_activation", &DecoderLayerProgram::ffn_activation)
      .def_readwrite("final_norm", &DecoderLayerProgram::final_norm)
      .def_readwrite("normalize_before", &DecoderLayerProgram::normalize_before);
  py::class_<NativeBatch>(m, "NativeBatch")
      .def(py::init<>())
      .def_readwrite("states0", &NativeBatch::states0)
      .def_readwrite("states1", &NativeBatch::states1)
      .def_readwrite("keys", &NativeBatch::keys)
      .def_readwrite("values", &NativeBatch::values)
      .def_readwrite("key_biases", &NativeBatch::key_biases)
      .def_readwrite("cross_states", &NativeBatch::cross_states)
      .def_readwrite("beam", &NativeBatch::beam);
  py::class_<NativeSearch>(m, "NativeSearch")
      .def(py::init<>())
      .def_readwrite("tokens0", &NativeSearch::tokens0)
      .def_readwrite("tokens1", &NativeSearch::tokens1)
      .def_readwrite("scores0", &NativeSearch::scores0)
      .def_readwrite("scores1", &NativeSearch::scores1)
      .def_readwrite("cand_scores", &NativeSearch::cand_scores)
      .def_readwrite("cand_indices", &NativeSearch::cand_indices)
      .def_readwrite("cands_to_ignore", &NativeSearch::cands_to_ignore)
      .def_readwrite("finished", &NativeSearch::finished)
      .def_readwrite("fin_count", &NativeSearch::fin_count)
      .def_readwrite("fin_tokens", &NativeSearch::fin_tokens)
      .def_readwrite("fin_scores", &NativeSearch::fin_scores)
      .def_readwrite("fin_steps", &NativeSearch::fin_steps)
      .def_readwrite("order", &NativeSearch::order)
      .def_readwrite("eos_bias", &NativeSearch::eos_bias)
      .def_readwrite("positions", &NativeSearch::positions)
      .def_readwrite("step", &NativeSearch::step)
      .def_readwrite("N", &NativeSearch::N)
      .def_readwrite("K", &NativeSearch::K)
      .def_readwrite("eos", &NativeSearch::eos)
      .def_readwrite("pad", &NativeSearch::pad)
      .def_readwrite("unk", &NativeSearch::unk)
      .def_readwrite("unk_penalty", &NativeSearch::unk_penalty);
  py::class_<DecodeProgram>(m, "DecodeProgram")
      .def(py::init<int64_t, std::vector<std::string>>())
      .def_readwrite("embed", &DecodeProgram::embed)
      .def_readwrite("embed_scale", &DecodeProgram::embed_scale)
      .def_readwrite("embed_norm", &DecodeProgram::embed_norm)
      .def_readwrite("final_norm", &DecodeProgram::final_norm)
      .def_readwrite("layers", &DecodeProgram::layers)
      .def_readwrite("output", &DecodeProgram::output)
      .def_readwrite("padding_idx", &DecodeProgram::padding_idx)
      .def("decode", &DecodeProgram::decode, py::call_guard<py::gil_scoped_release>(),
           "logits of one decoding step (decode_program.h)")
      .def("search_step", &DecodeProgram::search_step, py::call_guard<py::gil_scoped_release>(),
           "the static beam search's whole step (decode_program.h)");
}
