// The kernels of a decoding step on the CPU in fp32, on tensors (the native program, decode_program.cpp, calls them;
// bindings.cpp binds them for the tests): each checks its tensors, then runs a level's kernels (cpu_kernels.h) on their
// data, writing its outputs into buffers the caller passes; absent inputs are undefined tensors.
//
//   causal_layer_step   one decoder self-attention step of a causal RFA layer, all heads, from phi(q),
//                       phi(k) (or a learned map's pre-activations W x + b, activated here: hedgehog,
//                       relu), v and the gate logits: the feature map, the gate, the beam reorder, the
//                       state update and the read-out in one pass over the state, written in (rows, heads x d)
//   softmax_cross_step  softmax cross-attention of one step over K, V kept once per source sentence
//                       (a sentence's beams share them), with the head-averaged weights on request
//   add_layer_norm      out = LayerNorm(x + residual) (residual optional), one pass per row
//   beam_candidates     beam search's candidates: per sentence, the k best of its beams' log-probabilities
//                       plus each beam's score so far (NaN counts as -inf), in one pass, without writing
//                       the (sentences, beam x V) sums that torch.topk would read
//   quantize_rows       an int8 linear layer's input, quantized per row at each call: 7-bit codes
//                       round(x / s) + 64 with s = the row's max |x| / 63 (symmetric)
//
// References (tests/test_decoding_step.py, tests/test_cpu_levels.py compare against them): ops/naive.py's
// causal_rfa_recurrent, ops/feature_maps.py's activate_learned, fairseq's MultiheadAttention,
// torch.nn.functional.layer_norm, ops/naive.py's quantize_rows_reference.
#include "step_kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <string>
#include <type_traits>
#include <vector>

using rfa::cpu::Kernels;
using rfa::cpu::kInt8RowZeroPoint;

namespace {

const std::map<std::string, int64_t>& activation_codes() {
  static const std::map<std::string, int64_t> codes = {{"features", kFeatures}, {"hedgehog", kHedgehog},
                                                       {"relu", kReLU}, {"sincos", kSinCos}, {"arccos", kArcCos},
                                                       {"positive", kPositive}, {"elu", kELU}};
  return codes;
}

}  // namespace

int64_t activation_code(const std::string& name) {
  auto found = activation_codes().find(name);
  TORCH_CHECK(found != activation_codes().end(), "rfa decoding step: no feature-map activation named '", name, "'");
  return found->second;
}

std::vector<std::string> activation_names() {
  std::vector<std::string> names;
  for (const auto& entry : activation_codes()) names.push_back(entry.first);
  return names;
}

MapParams map_params(int64_t activation, int64_t H, int64_t F, int64_t head_dim, const at::Tensor& sigma,
                     const at::Tensor& matrix) {
  TORCH_CHECK(activation >= kFeatures && activation <= kELU, "rfa static step: unknown feature-map activation ",
              activation);
  MapParams map;
  map.kind = activation;
  map.features = F;
  switch (activation) {
    case kHedgehog:
      TORCH_CHECK(F % 2 == 0, "rfa static step: the hedgehog map has an even number of features");
      map.width = F / 2;
      break;
    case kFeatures:
    case kReLU:
      map.width = F;
      break;
    case kELU:
      TORCH_CHECK(F == head_dim, "rfa static step: the elu map has F = head_dim");
      map.width = head_dim;
      break;
    default: {  // random maps: raw per-head inputs, projected on (H, D, d)
      const int64_t D = activation == kSinCos ? F / 2 : F;
      TORCH_CHECK(activation != kSinCos || F % 2 == 0, "rfa static step: the sincos map has an even number of features");
      TORCH_CHECK(sigma.defined() && sigma.device().is_cpu() && sigma.scalar_type() == at::kFloat &&
                      sigma.is_contiguous() && sigma.numel() == H * head_dim,
                  "rfa static step: a random map needs sigma as a contiguous fp32 (heads, head_dim) tensor");
      TORCH_CHECK(matrix.defined() && matrix.device().is_cpu() && matrix.scalar_type() == at::kFloat &&
                      matrix.is_contiguous() && matrix.numel() == H * D * head_dim,
                  "rfa static step: a random map needs its matrix as a contiguous fp32 (heads, D, head_dim) tensor");
      map.width = head_dim;
      map.sigma = sigma.data_ptr<float>();
      map.matrix = matrix.data_ptr<float>();
    }
  }
  return map;
}

const float* head_features(const Kernels& kernels, const float* row, const MapParams& map, int64_t h, bool is_query,
                           float* buf, float* scratch) {
  const int64_t F = map.features;
  switch (map.kind) {
    case kFeatures:
      return row;
    case kHedgehog:
      kernels.hedgehog(row, F / 2, buf);
      return buf;
    case kReLU: {  // relu(p) / sqrt(D), D = F
      const float scale = 1.0f / std::sqrt(static_cast<float>(F));
      for (int64_t i = 0; i < F; ++i) buf[i] = std::max(row[i], 0.0f) * scale;
      return buf;
    }
    case kELU:  // elu(x) + 1
      for (int64_t i = 0; i < F; ++i) buf[i] = row[i] > 0.0f ? row[i] + 1.0f : std::exp(row[i]);
      return buf;
    default:
      break;
  }
  // random maps (ops/feature_maps.py): x' = sigma * x / max(|x|, 1e-6), p = W x', then sin/cos, relu or exp
  const int64_t d = map.width, D = map.kind == kSinCos ? F / 2 : F;
  const float norm = std::max(std::sqrt(kernels.dot(row, row, d)), 1e-6f);
  const float* sigma = map.sigma + h * d;
  float* xs = scratch;
  float sq = 0.0f;
  for (int64_t i = 0; i < d; ++i) {
    xs[i] = row[i] / norm * sigma[i];
    sq += xs[i] * xs[i];
  }
  const float* w = map.matrix + h * D * d;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  for (int64_t j = 0; j < D; ++j) buf[j] = kernels.dot(w + j * d, xs, d);
  if (map.kind == kSinCos) {
    for (int64_t j = 0; j < D; ++j) {
      const float p = buf[j];
      buf[j] = std::sin(p) * scale;
      buf[D + j] = std::cos(p) * scale;
    }
  } else if (map.kind == kArcCos) {
    for (int64_t j = 0; j < D; ++j) buf[j] = std::max(buf[j], 0.0f) * scale;
  } else {  // positive: exp(p - |x'|^2 / 2), queries shifted by their largest p (it cancels in the ratio)
    float shift = 0.5f * sq;
    if (is_query) {
      float hi = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < D; ++j) hi = std::max(hi, buf[j] - 0.5f * sq);
      shift += hi;
    }
    for (int64_t j = 0; j < D; ++j) buf[j] = std::exp(buf[j] - shift) * scale;
  }
  return buf;
}

namespace {

void check_rows(const at::Tensor& t, int64_t rows, int64_t cols, const char* name) {
  TORCH_CHECK(t.defined() && t.device().is_cpu() && t.dim() == 2 && t.size(0) >= rows && t.size(1) == cols &&
                  t.stride(1) == 1 && t.scalar_type() == at::kFloat,
              "rfa static step: ", name, " must be a (", rows, ", ", cols,
              ") fp32 CPU matrix with unit column stride");
}

// `index` (rows,) names a row of a state buffer of `bound` rows for each of the step's rows
void check_state_rows(const at::Tensor& index, int64_t rows, int64_t bound, const char* name) {
  TORCH_CHECK(index.device().is_cpu() && index.is_contiguous() && index.numel() == rows &&
                  index.scalar_type() == at::kLong,
              "rfa static step: ", name, " must be a contiguous (rows,) int64 CPU tensor");
  const int64_t* p = index.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r)
    TORCH_CHECK(p[r] >= 0 && p[r] < bound, "rfa static step: ", name, "[", r, "] = ", p[r], " is out of range for ",
                bound, " rows");
}

}  // namespace

void causal_layer_step(const at::Tensor& phi_q, const at::Tensor& phi_k, const at::Tensor& v,
                       const at::Tensor& gate_logits, const at::Tensor& key_pad, const at::Tensor& state_in,
                       const at::Tensor& order, const at::Tensor& state_out, const at::Tensor& out, double eps,
                       int64_t activation, const at::Tensor& sigma, const at::Tensor& matrix,
                       const Kernels& kernels, const at::Tensor& state_rows, int64_t group) {
  const int64_t R = v.size(0), H = state_out.size(1), F = state_out.size(2), D1 = state_out.size(3), d = D1 - 1;
  const MapParams map = map_params(activation, H, F, d, sigma, matrix);
  const int64_t P = map.width;  // values per head in phi_q / phi_k rows
  check_rows(phi_q, R, H * P, "phi_q");
  check_rows(phi_k, R, H * P, "phi_k");
  check_rows(v, R, H * d, "v");
  check_rows(out, R, H * d, "out");
  const auto state_type = state_out.scalar_type();
  const bool placed = state_rows.defined();
  TORCH_CHECK(state_out.device().is_cpu() && state_out.is_contiguous() && (placed || state_out.size(0) >= R) &&
                  (state_type == at::kFloat || state_type == at::kHalf),
              "rfa static step: state_out must be a contiguous fp32 or fp16 CPU (rows, heads, F, head_dim + 1) buffer");
  if (placed) check_state_rows(state_rows, R, state_out.size(0), "state_rows");
  const bool first = !state_in.defined();
  const bool reorder = order.defined();
  TORCH_CHECK(!(first && reorder), "rfa static step: a reorder needs a state");
  if (!first) {
    TORCH_CHECK(state_in.device().is_cpu() && state_in.is_contiguous() &&
                    state_in.sizes().slice(1) == state_out.sizes().slice(1) && state_in.scalar_type() == state_type,
                "rfa static step: state_in and state_out differ in layout or dtype");
    const int64_t R0 = state_in.size(0);
    if (reorder) {
      check_state_rows(order, R, R0, "order");
    } else {
      TORCH_CHECK(R0 >= R, "rfa static step: state has ", R0, " rows for ", R);
    }
    if (state_in.data_ptr() == state_out.data_ptr()) {  // one buffer: each group's rows read their own group only
      TORCH_CHECK(group >= 1 && R % group == 0, "rfa static step: state_out is state_in, which needs the rows in groups "
                  "(the native search's places) that read only their own group's states, got groups of ", group,
                  " for ", R, " rows");
      const int64_t* ord = reorder ? order.data_ptr<int64_t>() : nullptr;
      const int64_t* dst = placed ? state_rows.data_ptr<int64_t>() : nullptr;
      for (int64_t r = 0; r < R; ++r) {
        const int64_t from = ord ? ord[r] : r, to = dst ? dst[r] : r, first_row = r - r % group;
        const int64_t place = (dst ? dst[first_row] : first_row) / group;
        TORCH_CHECK(from / group == place && to / group == place, "rfa static step: in one state buffer, row ", r,
                    " reads row ", from, " and writes row ", to, ", outside its group of ", group, " rows (place ",
                    place, ")");
      }
    }
  }
  const bool gated = gate_logits.defined();
  if (gated) check_rows(gate_logits, R, H, "gate_logits");
  const bool padded = key_pad.defined();
  if (padded) {
    TORCH_CHECK(key_pad.device().is_cpu() && key_pad.is_contiguous() && key_pad.numel() == R &&
                    key_pad.scalar_type() == at::kBool,
                "rfa static step: key_pad must be a contiguous (rows,) bool CPU tensor");
  }

  const float* pq = phi_q.data_ptr<float>();
  const float* pk = phi_k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const float* gp = gated ? gate_logits.data_ptr<float>() : nullptr;
  const bool* padp = padded ? key_pad.data_ptr<bool>() : nullptr;
  const int64_t* ord = reorder ? order.data_ptr<int64_t>() : nullptr;
  const int64_t* dst_rows = placed ? state_rows.data_ptr<int64_t>() : nullptr;
  float* op = out.data_ptr<float>();
  const int64_t ldq = phi_q.stride(0), ldk = phi_k.stride(0), ldv = v.stride(0), ldo = out.stride(0);
  const int64_t ldg = gated ? gate_logits.stride(0) : 0;
  const float eps_f = static_cast<float>(eps);

  // the state in fp32, or fp16 (its IEEE bits): the kernels' update of one head
  const bool in_place = !first && state_in.data_ptr() == state_out.data_ptr();
  auto run = [&](auto* s_in, auto* s_out, auto update) {
  using State = std::remove_const_t<std::remove_pointer_t<decltype(s_out)>>;
  const int64_t head_size = F * D1;
  // row r's step of head h, reading its state at `from` (none: the first step)
  auto row_head = [&](int64_t r, int64_t h, const State* from, std::vector<float>& v_aug, std::vector<float>& acc,
                      std::vector<float>& q_buf, std::vector<float>& k_buf, std::vector<float>& scratch) {
      float decay = 1.0f, k_scale = 1.0f;
      if (padded && padp[r]) {  // a padded key adds nothing and decays nothing
        k_scale = 0.0f;
      } else if (gated) {
        const float logit = gp[r * ldg + h];
        decay = 1.0f / (1.0f + std::exp(-logit));    // g = sigmoid(logit)
        k_scale = 1.0f / (1.0f + std::exp(logit));   // the new term's 1 - g
      }
      std::copy(vp + r * ldv + h * d, vp + r * ldv + h * d + d, v_aug.begin());
      v_aug[d] = 1.0f;  // the ones column accumulates z
      const int64_t dst = placed ? dst_rows[r] : r;
      const float* q = head_features(kernels, pq + r * ldq + h * P, map, h, true, q_buf.data(), scratch.data());
      const float* k = head_features(kernels, pk + r * ldk + h * P, map, h, false, k_buf.data(), scratch.data());
      update(from, s_out + (dst * H + h) * head_size, q, k, v_aug.data(), decay, k_scale, F, D1, acc.data());
      const float den = std::max(acc[d], eps_f);
      float* o = op + r * ldo + h * d;
      for (int64_t j = 0; j < d; ++j) o[j] = acc[j] / den;
  };
  if (!in_place) {
    at::parallel_for(0, R * H, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> v_aug(D1), acc(D1), q_buf(F), k_buf(F), scratch(std::max(F, d));
      for (int64_t rh = begin; rh < end; ++rh) {
        const int64_t r = rh / H, h = rh % H, src = reorder ? ord[r] : r;
        row_head(r, h, first ? nullptr : s_in + (src * H + h) * head_size, v_aug, acc, q_buf, k_buf, scratch);
      }
    });
    return;
  }
  // one buffer (the native search): each group's (place's) head-h states, the rows it reads, copied aside before its
  // rows write theirs; the copies stay in the core's cache, so the memory traffic is a double buffer's
  at::parallel_for(0, (R / group) * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> v_aug(D1), acc(D1), q_buf(F), k_buf(F), scratch(std::max(F, d));
    std::vector<State> read(static_cast<size_t>(group * head_size));
    for (int64_t gh = begin; gh < end; ++gh) {
      const int64_t g = gh / H, h = gh % H;
      for (int64_t b = 0; b < group; ++b) {
        const int64_t r = g * group + b, src = reorder ? ord[r] : r;
        const State* from = s_in + (src * H + h) * head_size;
        std::copy(from, from + head_size, read.data() + b * head_size);
      }
      for (int64_t b = 0; b < group; ++b)
        row_head(g * group + b, h, read.data() + b * head_size, v_aug, acc, q_buf, k_buf, scratch);
    }
  });
  };
  if (state_type == at::kHalf) {
    auto bits = [](const at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::Half>()); };
    run(first ? nullptr : static_cast<const uint16_t*>(bits(state_in)), bits(state_out), kernels.update_and_read_out_fp16);
  } else {
    run(first ? nullptr : static_cast<const float*>(state_in.data_ptr<float>()), state_out.data_ptr<float>(),
        kernels.update_and_read_out_fp32);
  }
}

namespace {

// row r's sentence: r / beam, or sentences[r / beam] (step_kernels.h); checks that `sentences` names rows of N
struct SentenceOfRow {
  const int64_t* sentences = nullptr;
  int64_t beam = 1;
  SentenceOfRow(const at::Tensor& given, int64_t R, int64_t N, int64_t beam_, const char* kernel) : beam(beam_) {
    TORCH_CHECK(beam >= 1, kernel, ": beam must be positive, got ", beam);
    if (!given.defined()) {
      TORCH_CHECK(R <= N * beam, kernel, ": ", R, " rows for ", N, " sentences x beam ", beam);
      return;
    }
    const int64_t groups = (R + beam - 1) / beam;
    TORCH_CHECK(given.device().is_cpu() && given.scalar_type() == at::kLong && given.dim() == 1 &&
                    given.is_contiguous() && given.numel() >= groups,
                kernel, ": sentences must be a contiguous int64 CPU vector of ", groups, " or more entries");
    sentences = given.data_ptr<int64_t>();
    for (int64_t g = 0; g < groups; ++g) {
      TORCH_CHECK(sentences[g] >= 0 && sentences[g] < N, kernel, ": sentences[", g, "] = ", sentences[g],
                  " is not one of ", N);
    }
  }
  int64_t operator()(int64_t r) const { return sentences == nullptr ? r / beam : sentences[r / beam]; }
};

}  // namespace

void rfa_cross_step(const at::Tensor& q, const at::Tensor& cross_state, int64_t beam, double eps,
                    int64_t activation, const at::Tensor& sigma, const at::Tensor& matrix, const at::Tensor& out,
                    const Kernels& kernels, const at::Tensor& sentences) {
  const int64_t R = q.size(0), N = cross_state.size(0), H = cross_state.size(1), F = cross_state.size(2);
  const int64_t D1 = cross_state.size(3), d = D1 - 1;
  TORCH_CHECK(activation != kFeatures, "rfa cross step: the map is applied here (to raw queries or a learned affine "
              "map's pre-activations)");
  const MapParams map = map_params(activation, H, F, d, sigma, matrix);
  const int64_t P = map.width;  // values per head in q's rows
  check_rows(q, R, H * P, "q");
  check_rows(out, R, H * d, "out");
  TORCH_CHECK(cross_state.device().is_cpu() && cross_state.is_contiguous() && cross_state.scalar_type() == at::kFloat,
              "rfa cross step: the state must be a contiguous fp32 (sentences, heads, F, head_dim + 1) tensor");
  const SentenceOfRow sentence_of(sentences, R, N, beam, "rfa cross step");
  const float* qp = q.data_ptr<float>();
  const float* sp = cross_state.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t ldq = q.stride(0), ldo = out.stride(0);
  const float eps_f = static_cast<float>(eps);
  at::parallel_for(0, R * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(D1), q_buf(F), scratch(std::max(F, d));
    for (int64_t rh = begin; rh < end; ++rh) {
      const int64_t r = rh / H, h = rh % H, n = sentence_of(r);
      const float* phi = head_features(kernels, qp + r * ldq + h * P, map, h, true, q_buf.data(), scratch.data());
      const float* state = sp + (n * H + h) * F * D1;
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t f = 0; f < F; ++f) kernels.axpy(phi[f], state + f * D1, acc.data(), D1);
      const float den = std::max(acc[d], eps_f);
      float* o = op + r * ldo + h * d;
      for (int64_t j = 0; j < d; ++j) o[j] = acc[j] / den;
    }
  });
}

void softmax_cross_step(const at::Tensor& q, const at::Tensor& key, const at::Tensor& value,
                        const at::Tensor& key_bias, int64_t beam, double scaling, const at::Tensor& out,
                        const at::Tensor& weights, const Kernels& kernels, const at::Tensor& sentences) {
  const int64_t R = q.size(0), N = key.size(0), H = key.size(1), S = key.size(2), d = key.size(3), C = H * d;
  check_rows(q, R, C, "q");
  check_rows(out, R, C, "out");
  TORCH_CHECK(key.device().is_cpu() && value.device().is_cpu() && key.scalar_type() == at::kFloat &&
                  value.scalar_type() == at::kFloat && key.is_contiguous() && value.is_contiguous() &&
                  value.sizes() == key.sizes(),
              "rfa static step: key and value must be contiguous fp32 CPU (sentences, heads, source, head_dim)");
  const SentenceOfRow sentence_of(sentences, R, N, beam, "rfa static step");
  const bool biased = key_bias.defined();
  if (biased) {
    TORCH_CHECK(key_bias.device().is_cpu() && key_bias.scalar_type() == at::kFloat && key_bias.is_contiguous() &&
                    key_bias.numel() >= N * S,
                "rfa static step: key_bias must be a contiguous fp32 CPU (sentences, source) tensor");
  }
  const bool want_weights = weights.defined();
  if (want_weights) check_rows(weights, R, S, "weights");

  const float* qp = q.data_ptr<float>();
  const float* kp = key.data_ptr<float>();
  const float* vp = value.data_ptr<float>();
  const float* bp = biased ? key_bias.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  float* wp = want_weights ? weights.data_ptr<float>() : nullptr;
  const int64_t ldq = q.stride(0), ldo = out.stride(0), ldw = want_weights ? weights.stride(0) : 0;
  const float scale = static_cast<float>(scaling), inv_heads = 1.0f / static_cast<float>(H);

  at::parallel_for(0, R, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qs(d), p(S);
    for (int64_t r = begin; r < end; ++r) {
      const int64_t n = sentence_of(r);
      float* w_row = want_weights ? wp + r * ldw : nullptr;
      if (w_row != nullptr) std::fill(w_row, w_row + S, 0.0f);
      for (int64_t h = 0; h < H; ++h) {
        const float* qh = qp + r * ldq + h * d;
        for (int64_t i = 0; i < d; ++i) qs[i] = qh[i] * scale;  // fairseq scales q before q . k
        const float* kh = kp + (n * H + h) * S * d;
        const float* vh = vp + (n * H + h) * S * d;
        float hi = -std::numeric_limits<float>::infinity();
        for (int64_t s = 0; s < S; ++s) {
          p[s] = kernels.dot(qs.data(), kh + s * d, d) + (biased ? bp[n * S + s] : 0.0f);
          hi = std::max(hi, p[s]);
        }
        float sum = 0.0f;
        for (int64_t s = 0; s < S; ++s) {
          p[s] = std::exp(p[s] - hi);
          sum += p[s];
        }
        const float inv = 1.0f / sum;
        float* o = op + r * ldo + h * d;
        std::fill(o, o + d, 0.0f);
        for (int64_t s = 0; s < S; ++s) {
          const float ps = p[s] * inv;
          kernels.axpy(ps, vh + s * d, o, d);
          if (w_row != nullptr) w_row[s] += ps * inv_heads;
        }
      }
    }
  });
}

void add_layer_norm(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& gamma,
                    const at::Tensor& beta, double eps, const at::Tensor& out, const Kernels& kernels) {
  const int64_t R = x.size(0), C = x.size(1);
  check_rows(x, R, C, "x");
  check_rows(out, R, C, "out");
  const bool add = residual.defined();
  if (add) check_rows(residual, R, C, "residual");
  TORCH_CHECK(gamma.device().is_cpu() && beta.device().is_cpu() && gamma.scalar_type() == at::kFloat &&
                  beta.scalar_type() == at::kFloat && gamma.is_contiguous() && beta.is_contiguous() &&
                  gamma.numel() == C && beta.numel() == C,
              "rfa static step: layer norm weight and bias must have ", C, " values");
  const float* xp = x.data_ptr<float>();
  const float* rp = add ? residual.data_ptr<float>() : nullptr;
  const float* gp = gamma.data_ptr<float>();
  const float* bp = beta.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t ldx = x.stride(0), ldr = add ? residual.stride(0) : 0, ldo = out.stride(0);
  const float eps_f = static_cast<float>(eps);
  at::parallel_for(0, R, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> y(C);
    for (int64_t r = begin; r < end; ++r) {
      // the whole row is read before `out` is written: out may be x or residual
      kernels.layer_norm_row(xp + r * ldx, add ? rp + r * ldr : nullptr, gp, bp, C, eps_f, y.data(), op + r * ldo);
    }
  });
}

void beam_candidates(const at::Tensor& lprobs, const at::Tensor& prev_scores, int64_t beam,
                     const at::Tensor& scores_out, const at::Tensor& indices_out, const Kernels& kernels) {
  const int64_t V = lprobs.size(1), N = scores_out.size(0), k = scores_out.size(1);
  const bool first = !prev_scores.defined();  // step 0: a sentence's beams are one hypothesis: beam 0 only
  const int64_t beams = first ? 1 : beam;
  check_rows(lprobs, N * beam, V, "lprobs");
  TORCH_CHECK(scores_out.device().is_cpu() && indices_out.device().is_cpu() && scores_out.is_contiguous() &&
                  scores_out.scalar_type() == at::kFloat && indices_out.is_contiguous() &&
                  indices_out.scalar_type() == at::kLong && indices_out.size(0) == N && indices_out.size(1) == k,
              "rfa beam_candidates: scores_out (N, k) fp32 and indices_out (N, k) int64, contiguous, on the CPU");
  TORCH_CHECK(k >= 1 && k <= beams * V, "rfa beam_candidates: k = ", k, " of ", beams * V, " candidates");
  TORCH_CHECK(first || (prev_scores.device().is_cpu() && prev_scores.dim() == 1 && prev_scores.size(0) == N * beam &&
                        prev_scores.scalar_type() == at::kFloat),
              "rfa beam_candidates: prev_scores must be (", N * beam, ",) fp32, or None at the first step");
  const float* lp = lprobs.data_ptr<float>();
  const float* prev = first ? nullptr : prev_scores.data_ptr<float>();
  const int64_t ldp = first ? 0 : prev_scores.stride(0);  // a column of the search's score buffer
  float* so = scores_out.data_ptr<float>();
  int64_t* io = indices_out.data_ptr<int64_t>();
  const int64_t ld = lprobs.stride(0);
  const float neg_inf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, N, 1, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      auto row = [&](int64_t b) { return lp + (n * beam + b) * ld; };
      auto add = [&](int64_t b) { return first ? 0.0f : prev[(n * beam + b) * ldp]; };
      // every value counts, NaN as -inf; x + add is monotonic in x, so a block's max bounds its sums
      auto value = [&](int64_t b, int64_t v) { return std::isnan(row(b)[v]) ? neg_inf : row(b)[v] + add(b); };
      auto bound = [&](int64_t b, int64_t start, int64_t len) { return kernels.block_max(row(b) + start, len) + add(b); };
      TopK best{so + n * k, io + n * k, k};
      sentence_candidates(best, beams, V, value, bound);
    }
  });
}


void quantize_rows(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                   const Kernels& kernels) {
  const int64_t R = x.size(0), C = x.size(1);
  check_rows(x, R, C, "x");
  TORCH_CHECK(codes.is_contiguous() && codes.scalar_type() == at::kByte && codes.size(0) == R && codes.size(1) == C,
              "rfa static step: codes must be a contiguous (", R, ", ", C, ") uint8 tensor");
  TORCH_CHECK(scales.is_contiguous() && scales.scalar_type() == at::kFloat && scales.numel() == R,
              "rfa static step: scales must be a contiguous fp32 tensor of ", R, " values");
  quantize_rows(x.data_ptr<float>(), x.stride(0), R, C, codes.data_ptr<uint8_t>(), scales.data_ptr<float>(), kernels);
}

void quantize_rows(const float* x, int64_t ldx, int64_t R, int64_t C, uint8_t* codes, float* scales,
                   const Kernels& kernels) {
  const float levels = static_cast<float>(kInt8RowZeroPoint - 1);
  at::parallel_for(0, R, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float m = kernels.max_abs(x + r * ldx, C);
      const float scale = m > 0.0f ? m / levels : 1.0f;
      scales[r] = scale;
      kernels.quantize_row(x + r * ldx, C, 1.0f / scale, codes + r * C);
    }
  });
}
