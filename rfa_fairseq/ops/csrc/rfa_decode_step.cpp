// Kernels of the decoding step on CPU in fp32 (the native program, decode_program.cpp, calls them; bindings.cpp
// binds them for the tests): each writes its outputs into buffers the caller passes; absent inputs are undefined
// tensors.
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
//   scale_rows          an int8 linear layer's output, in place: y * the row's scale + bias, relu, + residual
//
// References (tests/test_decoding.py compares against them): ops/naive.py's causal_rfa_recurrent,
// ops/feature_maps.py's activate_learned, fairseq's MultiheadAttention, torch.nn.functional.layer_norm,
// ops/naive.py's quantize_rows_reference.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "rfa_kernels.h"

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// exp(x) = 2^n * p(r), n = floor(x log2(e) + 1/2), r = x - n ln(2) (ln(2) in two parts): Cephes' single-precision
// polynomial, about 1 ulp on the range used here (x <= 0); exp8 and exp16 compute it lane for lane alike
struct ExpPoly {
  static constexpr float kHi = 88.3762626647949f, kLo = -87.3365447505531f, kLog2e = 1.44269504088896341f;
  static constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
  static constexpr float kP[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                                  4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
};

__attribute__((target("avx2,fma"))) inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(ExpPoly::kHi)), _mm256_set1_ps(ExpPoly::kLo));
  __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(ExpPoly::kLog2e), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(ExpPoly::kLn2Hi), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(ExpPoly::kLn2Lo), x);
  __m256 y = _mm256_set1_ps(ExpPoly::kP[0]);
  for (int i = 1; i < 6; ++i) y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(ExpPoly::kP[i]));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  const __m256i exponent = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(exponent));
}

// max and log(sum(exp(x - max))) of a row: log_softmax(x) = (x - max) - log_sum
__attribute__((target("avx2,fma"))) void row_log_sum_exp_avx2(const float* x, int64_t n, float* max_out,
                                                              float* log_sum_out) {
  __m256 m8 = _mm256_set1_ps(kNegInf);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) m8 = _mm256_max_ps(m8, _mm256_loadu_ps(x + i));
  float lanes[8];
  _mm256_storeu_ps(lanes, m8);
  float m = kNegInf;
  for (float v : lanes) m = std::max(m, v);
  for (; i < n; ++i) m = std::max(m, x[i]);
  if (!std::isfinite(m)) {  // an all -inf (or +inf) row: log_softmax's own NaN / -inf follow from the scalar path
    float sum = 0.0f;
    for (int64_t j = 0; j < n; ++j) sum += std::exp(x[j] - m);
    *max_out = m;
    *log_sum_out = std::log(sum);
    return;
  }
  const __m256 mv = _mm256_set1_ps(m);
  __m256 s8 = _mm256_setzero_ps();
  for (i = 0; i + 8 <= n; i += 8) s8 = _mm256_add_ps(s8, exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), mv)));
  _mm256_storeu_ps(lanes, s8);
  float sum = 0.0f;
  for (float v : lanes) sum += v;
  for (; i < n; ++i) sum += std::exp(x[i] - m);
  *max_out = m;
  *log_sum_out = std::log(sum);
}

// exp8 on 16 floats
__attribute__((target("avx512f"))) inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(ExpPoly::kHi)), _mm512_set1_ps(ExpPoly::kLo));
  __m512 fx = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(ExpPoly::kLog2e), _mm512_set1_ps(0.5f)),
                                   _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(ExpPoly::kLn2Hi), x);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(ExpPoly::kLn2Lo), x);
  __m512 y = _mm512_set1_ps(ExpPoly::kP[0]);
  for (int i = 1; i < 6; ++i) y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(ExpPoly::kP[i]));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
  const __m512i exponent = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(fx), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(exponent));
}

// row_log_sum_exp_avx2 16 lanes at a time: the vocabulary's exponentials are most of a search step's own work (the
// sum's order is another: 16 partial sums, then theirs)
__attribute__((target("avx512f,avx2,fma"))) void row_log_sum_exp_avx512(const float* x, int64_t n, float* max_out,
                                                                         float* log_sum_out) {
  __m512 m16 = _mm512_set1_ps(kNegInf);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) m16 = _mm512_max_ps(m16, _mm512_loadu_ps(x + i));
  float lanes[16];
  _mm512_storeu_ps(lanes, m16);
  float m = kNegInf;
  for (float v : lanes) m = std::max(m, v);
  for (; i < n; ++i) m = std::max(m, x[i]);
  if (!std::isfinite(m)) return row_log_sum_exp_avx2(x, n, max_out, log_sum_out);  // its all -inf (+inf) rows' path
  const __m512 mv = _mm512_set1_ps(m);
  __m512 s16 = _mm512_setzero_ps();
  for (i = 0; i + 16 <= n; i += 16) s16 = _mm512_add_ps(s16, exp16(_mm512_sub_ps(_mm512_loadu_ps(x + i), mv)));
  _mm512_storeu_ps(lanes, s16);
  float sum = 0.0f;
  for (float v : lanes) sum += v;
  for (; i < n; ++i) sum += std::exp(x[i] - m);
  *max_out = m;
  *log_sum_out = std::log(sum);
}

}  // namespace

void row_log_sum_exp(const float* x, int64_t n, float* max_out, float* log_sum_out) {
  static const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  static const bool avx512 = avx2 && __builtin_cpu_supports("avx512f");
  if (avx512) return row_log_sum_exp_avx512(x, n, max_out, log_sum_out);
  if (avx2) return row_log_sum_exp_avx2(x, n, max_out, log_sum_out);
  float m = kNegInf;
  for (int64_t i = 0; i < n; ++i) m = std::max(m, x[i]);
  float sum = 0.0f;
  for (int64_t i = 0; i < n; ++i) sum += std::exp(x[i] - m);
  *max_out = m;
  *log_sum_out = std::log(sum);
}


namespace {

__attribute__((target("avx2,fma"))) void exp_inplace_avx2(float* x, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, exp8(_mm256_loadu_ps(x + i)));
  for (; i < n; ++i) x[i] = std::exp(x[i]);
}

}  // namespace

void exp_inplace(float* x, int64_t n) {
  static const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (avx2) return exp_inplace_avx2(x, n);
  for (int64_t i = 0; i < n; ++i) x[i] = std::exp(x[i]);
}

namespace {

RFA_SIMD_CLONES
float dot(const float* __restrict__ a, const float* __restrict__ b, int64_t n) {
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// The state's elements: fp32, or fp16 (int8 decoding's state: half the bytes a step reads and writes; each step's
// arithmetic stays in fp32, the state rounded to fp16 as it is stored).
inline float state_load(const float* p) { return *p; }
inline float state_load(const at::Half* p) { return static_cast<float>(*p); }
inline void state_store(float* p, float x) { *p = x; }
inline void state_store(at::Half* p, float x) { *p = static_cast<at::Half>(x); }

// one element with F16C (c10::Half's own conversion is bit arithmetic: the same rounding, ~10x the instructions; it
// made the last state column, one element per feature, cost 60 % as much as the other 64 in int8 decoding)
__attribute__((target("avx2,fma,f16c"))) inline float state_load1(const float* p) { return *p; }
__attribute__((target("avx2,fma,f16c"))) inline float state_load1(const at::Half* p) { return _cvtsh_ss(p->x); }
__attribute__((target("avx2,fma,f16c"))) inline void state_store1(float* p, float x) { *p = x; }
__attribute__((target("avx2,fma,f16c"))) inline void state_store1(at::Half* p, float x) {
  p->x = _cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
__attribute__((target("avx2,fma,f16c"))) inline __m256 state_load8(const float* p) { return _mm256_loadu_ps(p); }
__attribute__((target("avx2,fma,f16c"))) inline __m256 state_load8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
__attribute__((target("avx2,fma,f16c"))) inline void state_store8(float* p, __m256 x) { _mm256_storeu_ps(p, x); }
__attribute__((target("avx2,fma,f16c"))) inline void state_store8(at::Half* p, __m256 x) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// S' = g * S + k (x) [v, 1] (no S on the first step: S' = k (x) [v, 1]); acc = q . S' (S' before it is stored). The
// portable loop:
template <typename S>
void update_and_read_out_portable(const S* __restrict__ s_in, S* __restrict__ s_out, const float* __restrict__ q,
                                  const float* __restrict__ k, const float* __restrict__ v_aug, float g, float k_scale,
                                  int64_t F, int64_t D1, float* __restrict__ acc) {
  for (int64_t j = 0; j < D1; ++j) acc[j] = 0.0f;
  for (int64_t f = 0; f < F; ++f) {
    const float kf = k[f] * k_scale, qf = q[f];
    for (int64_t j = 0; j < D1; ++j) {
      const float s = (s_in != nullptr ? g * state_load(s_in + f * D1 + j) : 0.0f) + kf * v_aug[j];
      state_store(s_out + f * D1 + j, s);
      acc[j] += qf * s;
    }
  }
}

// The same with AVX2: up to 64 columns at a time, their read-out sums held in registers across the F rows (they never
// go to memory) and each state row read and written once, in order.
template <int kBlocks, typename S>
__attribute__((target("avx2,fma,f16c"))) inline void update_columns(const S* __restrict__ s_in, S* __restrict__ s_out,
                                                                    const float* __restrict__ q, const float* __restrict__ k,
                                                                    const float* __restrict__ v_aug, float g, float k_scale,
                                                                    int64_t F, int64_t D1, int64_t j, float* __restrict__ acc) {
  __m256 a[kBlocks];
  for (int b = 0; b < kBlocks; ++b) a[b] = _mm256_setzero_ps();
  const __m256 gv = _mm256_set1_ps(g);
  for (int64_t f = 0; f < F; ++f) {
    const __m256 kf = _mm256_set1_ps(k[f] * k_scale), qf = _mm256_set1_ps(q[f]);
    for (int b = 0; b < kBlocks; ++b) {
      __m256 s = _mm256_mul_ps(kf, _mm256_loadu_ps(v_aug + j + 8 * b));
      if (s_in != nullptr) s = _mm256_fmadd_ps(gv, state_load8(s_in + f * D1 + j + 8 * b), s);
      state_store8(s_out + f * D1 + j + 8 * b, s);
      a[b] = _mm256_fmadd_ps(qf, s, a[b]);
    }
  }
  for (int b = 0; b < kBlocks; ++b) _mm256_storeu_ps(acc + j + 8 * b, a[b]);
}

template <typename S>
__attribute__((target("avx2,fma,f16c"))) void update_and_read_out_avx2(const S* __restrict__ s_in, S* __restrict__ s_out,
                                                                       const float* __restrict__ q, const float* __restrict__ k,
                                                                       const float* __restrict__ v_aug, float g, float k_scale,
                                                                       int64_t F, int64_t D1, float* __restrict__ acc,
                                                                       int64_t j = 0) {  // from column j
  for (; j + 64 <= D1; j += 64) update_columns<8>(s_in, s_out, q, k, v_aug, g, k_scale, F, D1, j, acc);
  for (; j + 32 <= D1; j += 32) update_columns<4>(s_in, s_out, q, k, v_aug, g, k_scale, F, D1, j, acc);
  for (; j + 8 <= D1; j += 8) update_columns<1>(s_in, s_out, q, k, v_aug, g, k_scale, F, D1, j, acc);
  for (; j < D1; ++j) {  // the last columns (z's, the ones column of [v, 1], among them)
    float sum = 0.0f;
    for (int64_t f = 0; f < F; ++f) {
      const float s = (s_in != nullptr ? g * state_load1(s_in + f * D1 + j) : 0.0f) + k[f] * k_scale * v_aug[j];
      state_store1(s_out + f * D1 + j, s);
      sum += q[f] * s;
    }
    acc[j] = sum;
  }
}

// The same with AVX-512, 16 columns a vector: [v, 1]'s columns held in registers too (AVX2's 16 registers cannot
// hold them beside the sums). Each element's arithmetic is AVX2's (k * v, then g * S + that in one fma; the sums in
// the same order): the same results, bit for bit. It pays where the fp16 state's conversions make the loop
// compute-bound (one layer, one thread, recipe heads: 318 -> 286 us at 128 rows, 1,808 -> 1,696 at 512); the fp32
// state's loop waits on memory either way (236 -> 234, 2,048 -> 1,995).
__attribute__((target("avx512f"))) inline __m512 state_load16(const float* p) { return _mm512_loadu_ps(p); }
__attribute__((target("avx512f"))) inline __m512 state_load16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
__attribute__((target("avx512f"))) inline void state_store16(float* p, __m512 x) { _mm512_storeu_ps(p, x); }
__attribute__((target("avx512f"))) inline void state_store16(at::Half* p, __m512 x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

template <int kBlocks, typename S>
__attribute__((target("avx512f"))) inline void update_columns16(const S* __restrict__ s_in, S* __restrict__ s_out,
                                                                const float* __restrict__ q, const float* __restrict__ k,
                                                                const float* __restrict__ v_aug, float g, float k_scale,
                                                                int64_t F, int64_t D1, int64_t j, float* __restrict__ acc) {
  __m512 a[kBlocks], v[kBlocks];
  for (int b = 0; b < kBlocks; ++b) {
    a[b] = _mm512_setzero_ps();
    v[b] = _mm512_loadu_ps(v_aug + j + 16 * b);
  }
  const __m512 gv = _mm512_set1_ps(g);
  for (int64_t f = 0; f < F; ++f) {
    const __m512 kf = _mm512_set1_ps(k[f] * k_scale), qf = _mm512_set1_ps(q[f]);
    for (int b = 0; b < kBlocks; ++b) {
      __m512 s = _mm512_mul_ps(kf, v[b]);
      if (s_in != nullptr) s = _mm512_fmadd_ps(gv, state_load16(s_in + f * D1 + j + 16 * b), s);
      state_store16(s_out + f * D1 + j + 16 * b, s);
      a[b] = _mm512_fmadd_ps(qf, s, a[b]);
    }
  }
  for (int b = 0; b < kBlocks; ++b) _mm512_storeu_ps(acc + j + 16 * b, a[b]);
}

template <typename S>
__attribute__((target("avx512f,avx2,fma,f16c"))) void update_and_read_out_avx512(
    const S* __restrict__ s_in, S* __restrict__ s_out, const float* __restrict__ q, const float* __restrict__ k,
    const float* __restrict__ v_aug, float g, float k_scale, int64_t F, int64_t D1, float* __restrict__ acc) {
  int64_t j = 0;
  for (; j + 64 <= D1; j += 64) update_columns16<4>(s_in, s_out, q, k, v_aug, g, k_scale, F, D1, j, acc);
  for (; j + 16 <= D1; j += 16) update_columns16<1>(s_in, s_out, q, k, v_aug, g, k_scale, F, D1, j, acc);
  update_and_read_out_avx2(s_in, s_out, q, k, v_aug, g, k_scale, F, D1, acc, j);  // the columns left
}

template <typename S>
void update_and_read_out(const S* s_in, S* s_out, const float* q, const float* k, const float* v_aug, float g,
                         float k_scale, int64_t F, int64_t D1, float* acc) {
  static const bool avx2 =
      __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  static const bool avx512 = avx2 && __builtin_cpu_supports("avx512f");
  if (avx512) return update_and_read_out_avx512(s_in, s_out, q, k, v_aug, g, k_scale, F, D1, acc);
  if (avx2) return update_and_read_out_avx2(s_in, s_out, q, k, v_aug, g, k_scale, F, D1, acc);
  update_and_read_out_portable(s_in, s_out, q, k, v_aug, g, k_scale, F, D1, acc);
}

// y += a * x
RFA_SIMD_CLONES
void axpy(float a, const float* __restrict__ x, float* __restrict__ y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

// out = LayerNorm(x + residual) of one row, through y (C floats); two passes for the variance, as torch
RFA_SIMD_CLONES
void layer_norm_row(const float* __restrict__ x, const float* __restrict__ residual, const float* __restrict__ gamma,
                    const float* __restrict__ beta, int64_t C, float eps, float* __restrict__ y, float* out) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t c = 0; c < C; ++c) {
    y[c] = residual != nullptr ? x[c] + residual[c] : x[c];
    sum += y[c];
  }
  const float mean = sum / static_cast<float>(C);
  float sq = 0.0f;
#pragma omp simd reduction(+ : sq)
  for (int64_t c = 0; c < C; ++c) {
    const float centered = y[c] - mean;
    sq += centered * centered;
  }
  const float rstd = 1.0f / std::sqrt(sq / static_cast<float>(C) + eps);
  for (int64_t c = 0; c < C; ++c) out[c] = (y[c] - mean) * rstd * gamma[c] + beta[c];
}

// The largest of n floats (NaN ignored; -inf when none): a filter before the exact comparisons
RFA_SIMD_CLONES
float block_max_simd(const float* __restrict__ x, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
  for (int64_t i = 0; i < n; ++i) m = x[i] > m ? x[i] : m;
  return m;
}

// phi = [softmax(p), softmax(-p)] of one head's D pre-activations (F = 2D), max-shifted as torch.softmax
RFA_SIMD_CLONES
void hedgehog(const float* __restrict__ p, int64_t D, float* __restrict__ phi) {
  float hi = p[0], lo = p[0];
#pragma omp simd reduction(max : hi) reduction(min : lo)
  for (int64_t i = 1; i < D; ++i) {
    hi = std::max(hi, p[i]);
    lo = std::min(lo, p[i]);
  }
  for (int64_t i = 0; i < D; ++i) {
    phi[i] = p[i] - hi;
    phi[D + i] = lo - p[i];  // softmax(-p): -p - max(-p) = lo - p
  }
  exp_inplace(phi, 2 * D);
  float sum_pos = 0.0f, sum_neg = 0.0f;
  for (int64_t i = 0; i < D; ++i) {
    sum_pos += phi[i];
    sum_neg += phi[D + i];
  }
  const float inv_pos = 1.0f / sum_pos, inv_neg = 1.0f / sum_neg;
  for (int64_t i = 0; i < D; ++i) {
    phi[i] *= inv_pos;
    phi[D + i] *= inv_neg;
  }
}

}  // namespace

float block_max(const float* x, int64_t n) { return block_max_simd(x, n); }

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

MapParams map_params(int64_t activation, int64_t H, int64_t F, int64_t head_dim, const torch::Tensor& sigma,
                     const torch::Tensor& matrix) {
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
      TORCH_CHECK(sigma.defined() && sigma.device().is_cpu() && sigma.scalar_type() == torch::kFloat32 &&
                      sigma.is_contiguous() && sigma.numel() == H * head_dim,
                  "rfa static step: a random map needs sigma as a contiguous fp32 (heads, head_dim) tensor");
      TORCH_CHECK(matrix.defined() && matrix.device().is_cpu() && matrix.scalar_type() == torch::kFloat32 &&
                      matrix.is_contiguous() && matrix.numel() == H * D * head_dim,
                  "rfa static step: a random map needs its matrix as a contiguous fp32 (heads, D, head_dim) tensor");
      map.width = head_dim;
      map.sigma = sigma.data_ptr<float>();
      map.matrix = matrix.data_ptr<float>();
    }
  }
  return map;
}

const float* head_features(const float* row, const MapParams& map, int64_t h, bool is_query, float* buf,
                           float* scratch) {
  const int64_t F = map.features;
  switch (map.kind) {
    case kFeatures:
      return row;
    case kHedgehog:
      hedgehog(row, F / 2, buf);
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
  const float norm = std::max(std::sqrt(dot(row, row, d)), 1e-6f);
  const float* sigma = map.sigma + h * d;
  float* xs = scratch;
  float sq = 0.0f;
  for (int64_t i = 0; i < d; ++i) {
    xs[i] = row[i] / norm * sigma[i];
    sq += xs[i] * xs[i];
  }
  const float* w = map.matrix + h * D * d;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  for (int64_t j = 0; j < D; ++j) buf[j] = dot(w + j * d, xs, d);
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

void check_rows(const torch::Tensor& t, int64_t rows, int64_t cols, const char* name) {
  TORCH_CHECK(t.defined() && t.device().is_cpu() && t.dim() == 2 && t.size(0) >= rows && t.size(1) == cols &&
                  t.stride(1) == 1 && t.scalar_type() == torch::kFloat32,
              "rfa static step: ", name, " must be a (", rows, ", ", cols,
              ") fp32 CPU matrix with unit column stride");
}

}  // namespace

void causal_layer_step(const torch::Tensor& phi_q, const torch::Tensor& phi_k, const torch::Tensor& v,
                       const torch::Tensor& gate_logits, const torch::Tensor& key_pad, const torch::Tensor& state_in,
                       const torch::Tensor& order, const torch::Tensor& state_out, const torch::Tensor& out, double eps,
                       int64_t activation, const torch::Tensor& sigma, const torch::Tensor& matrix) {
  const int64_t R = v.size(0), H = state_out.size(1), F = state_out.size(2), D1 = state_out.size(3), d = D1 - 1;
  const MapParams map = map_params(activation, H, F, d, sigma, matrix);
  const int64_t P = map.width;  // values per head in phi_q / phi_k rows
  check_rows(phi_q, R, H * P, "phi_q");
  check_rows(phi_k, R, H * P, "phi_k");
  check_rows(v, R, H * d, "v");
  check_rows(out, R, H * d, "out");
  const auto state_type = state_out.scalar_type();
  TORCH_CHECK(state_out.device().is_cpu() && state_out.is_contiguous() && state_out.size(0) >= R &&
                  (state_type == torch::kFloat32 || state_type == torch::kFloat16),
              "rfa static step: state_out must be a contiguous fp32 or fp16 CPU (rows, heads, F, head_dim + 1) buffer");
  const bool first = !state_in.defined();
  const bool reorder = order.defined();
  TORCH_CHECK(!(first && reorder), "rfa static step: a reorder needs a state");
  if (!first) {
    TORCH_CHECK(state_in.device().is_cpu() && state_in.is_contiguous() &&
                    state_in.sizes().slice(1) == state_out.sizes().slice(1) && state_in.scalar_type() == state_type,
                "rfa static step: state_in and state_out differ in layout or dtype");
    TORCH_CHECK(state_in.data_ptr() != state_out.data_ptr(), "rfa static step: state_out must not be state_in");
    const int64_t R0 = state_in.size(0);
    if (reorder) {
      TORCH_CHECK(order.device().is_cpu() && order.is_contiguous() && order.numel() == R &&
                      order.scalar_type() == torch::kInt64,
                  "rfa static step: order must be a contiguous (rows,) int64 CPU tensor");
      const int64_t* ord = order.data_ptr<int64_t>();
      for (int64_t r = 0; r < R; ++r)
        TORCH_CHECK(ord[r] >= 0 && ord[r] < R0, "rfa static step: order[", r, "] = ", ord[r], " is out of range for ",
                    R0, " rows");
    } else {
      TORCH_CHECK(R0 >= R, "rfa static step: state has ", R0, " rows for ", R);
    }
  }
  const bool gated = gate_logits.defined();
  if (gated) check_rows(gate_logits, R, H, "gate_logits");
  const bool padded = key_pad.defined();
  if (padded) {
    TORCH_CHECK(key_pad.device().is_cpu() && key_pad.is_contiguous() && key_pad.numel() == R &&
                    key_pad.scalar_type() == torch::kBool,
                "rfa static step: key_pad must be a contiguous (rows,) bool CPU tensor");
  }

  const float* pq = phi_q.data_ptr<float>();
  const float* pk = phi_k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const float* gp = gated ? gate_logits.data_ptr<float>() : nullptr;
  const bool* padp = padded ? key_pad.data_ptr<bool>() : nullptr;
  const int64_t* ord = reorder ? order.data_ptr<int64_t>() : nullptr;
  float* op = out.data_ptr<float>();
  const int64_t ldq = phi_q.stride(0), ldk = phi_k.stride(0), ldv = v.stride(0), ldo = out.stride(0);
  const int64_t ldg = gated ? gate_logits.stride(0) : 0;
  const float eps_f = static_cast<float>(eps);

  auto run = [&](auto* s_in, auto* s_out) {  // float or at::Half state
  at::parallel_for(0, R * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> v_aug(D1), acc(D1), q_buf(F), k_buf(F), scratch(std::max(F, d));
    for (int64_t rh = begin; rh < end; ++rh) {
      const int64_t r = rh / H, h = rh % H;
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
      const int64_t src = reorder ? ord[r] : r;
      const float* q = head_features(pq + r * ldq + h * P, map, h, true, q_buf.data(), scratch.data());
      const float* k = head_features(pk + r * ldk + h * P, map, h, false, k_buf.data(), scratch.data());
      update_and_read_out(first ? nullptr : s_in + (src * H + h) * F * D1, s_out + rh * F * D1, q, k, v_aug.data(),
                          decay, k_scale, F, D1, acc.data());
      const float den = std::max(acc[d], eps_f);
      float* o = op + r * ldo + h * d;
      for (int64_t j = 0; j < d; ++j) o[j] = acc[j] / den;
    }
  });
  };
  if (state_type == torch::kFloat16) {
    run(first ? static_cast<const at::Half*>(nullptr) : state_in.data_ptr<at::Half>(), state_out.data_ptr<at::Half>());
  } else {
    run(first ? static_cast<const float*>(nullptr) : state_in.data_ptr<float>(), state_out.data_ptr<float>());
  }
}

namespace {

// row r's sentence: r / beam, or sentences[r / beam] (rfa_kernels.h); checks that `sentences` names rows of N
struct SentenceOfRow {
  const int64_t* sentences = nullptr;
  int64_t beam = 1;
  SentenceOfRow(const torch::Tensor& given, int64_t R, int64_t N, int64_t beam_, const char* kernel) : beam(beam_) {
    TORCH_CHECK(beam >= 1, kernel, ": beam must be positive, got ", beam);
    if (!given.defined()) {
      TORCH_CHECK(R <= N * beam, kernel, ": ", R, " rows for ", N, " sentences x beam ", beam);
      return;
    }
    const int64_t groups = (R + beam - 1) / beam;
    TORCH_CHECK(given.device().is_cpu() && given.scalar_type() == torch::kInt64 && given.dim() == 1 &&
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

void rfa_cross_step(const torch::Tensor& q, const torch::Tensor& cross_state, int64_t beam, double eps,
                    int64_t activation, const torch::Tensor& sigma, const torch::Tensor& matrix, const torch::Tensor& out,
                    const torch::Tensor& sentences) {
  const int64_t R = q.size(0), N = cross_state.size(0), H = cross_state.size(1), F = cross_state.size(2);
  const int64_t D1 = cross_state.size(3), d = D1 - 1;
  TORCH_CHECK(activation != kFeatures, "rfa cross step: the map is applied here (to raw queries or a learned affine "
              "map's pre-activations)");
  const MapParams map = map_params(activation, H, F, d, sigma, matrix);
  const int64_t P = map.width;  // values per head in q's rows
  check_rows(q, R, H * P, "q");
  check_rows(out, R, H * d, "out");
  TORCH_CHECK(cross_state.device().is_cpu() && cross_state.is_contiguous() && cross_state.scalar_type() == torch::kFloat32,
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
      const float* phi = head_features(qp + r * ldq + h * P, map, h, true, q_buf.data(), scratch.data());
      const float* state = sp + (n * H + h) * F * D1;
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t f = 0; f < F; ++f) axpy(phi[f], state + f * D1, acc.data(), D1);
      const float den = std::max(acc[d], eps_f);
      float* o = op + r * ldo + h * d;
      for (int64_t j = 0; j < d; ++j) o[j] = acc[j] / den;
    }
  });
}

void softmax_cross_step(const torch::Tensor& q, const torch::Tensor& key, const torch::Tensor& value,
                        const torch::Tensor& key_bias, int64_t beam, double scaling, const torch::Tensor& out,
                        const torch::Tensor& weights, const torch::Tensor& sentences) {
  const int64_t R = q.size(0), N = key.size(0), H = key.size(1), S = key.size(2), d = key.size(3), C = H * d;
  check_rows(q, R, C, "q");
  check_rows(out, R, C, "out");
  TORCH_CHECK(key.device().is_cpu() && value.device().is_cpu() && key.scalar_type() == torch::kFloat32 &&
                  value.scalar_type() == torch::kFloat32 && key.is_contiguous() && value.is_contiguous() &&
                  value.sizes() == key.sizes(),
              "rfa static step: key and value must be contiguous fp32 CPU (sentences, heads, source, head_dim)");
  const SentenceOfRow sentence_of(sentences, R, N, beam, "rfa static step");
  const bool biased = key_bias.defined();
  if (biased) {
    TORCH_CHECK(key_bias.device().is_cpu() && key_bias.scalar_type() == torch::kFloat32 && key_bias.is_contiguous() &&
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
          p[s] = dot(qs.data(), kh + s * d, d) + (biased ? bp[n * S + s] : 0.0f);
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
          axpy(ps, vh + s * d, o, d);
          if (w_row != nullptr) w_row[s] += ps * inv_heads;
        }
      }
    }
  });
}

void add_layer_norm(const torch::Tensor& x, const torch::Tensor& residual, const torch::Tensor& gamma,
                    const torch::Tensor& beta, double eps, const torch::Tensor& out) {
  const int64_t R = x.size(0), C = x.size(1);
  check_rows(x, R, C, "x");
  check_rows(out, R, C, "out");
  const bool add = residual.defined();
  if (add) check_rows(residual, R, C, "residual");
  TORCH_CHECK(gamma.device().is_cpu() && beta.device().is_cpu() && gamma.scalar_type() == torch::kFloat32 &&
                  beta.scalar_type() == torch::kFloat32 && gamma.is_contiguous() && beta.is_contiguous() &&
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
      layer_norm_row(xp + r * ldx, add ? rp + r * ldr : nullptr, gp, bp, C, eps_f, y.data(), op + r * ldo);
    }
  });
}

void beam_candidates(const torch::Tensor& lprobs, const torch::Tensor& prev_scores, int64_t beam,
                     const torch::Tensor& scores_out, const torch::Tensor& indices_out) {
  const int64_t V = lprobs.size(1), N = scores_out.size(0), k = scores_out.size(1);
  const bool first = !prev_scores.defined();  // step 0: a sentence's beams are one hypothesis: beam 0 only
  const int64_t beams = first ? 1 : beam;
  check_rows(lprobs, N * beam, V, "lprobs");
  TORCH_CHECK(scores_out.device().is_cpu() && indices_out.device().is_cpu() && scores_out.is_contiguous() &&
                  scores_out.scalar_type() == torch::kFloat32 && indices_out.is_contiguous() &&
                  indices_out.scalar_type() == torch::kInt64 && indices_out.size(0) == N && indices_out.size(1) == k,
              "rfa beam_candidates: scores_out (N, k) fp32 and indices_out (N, k) int64, contiguous, on the CPU");
  TORCH_CHECK(k >= 1 && k <= beams * V, "rfa beam_candidates: k = ", k, " of ", beams * V, " candidates");
  TORCH_CHECK(first || (prev_scores.device().is_cpu() && prev_scores.dim() == 1 && prev_scores.size(0) == N * beam &&
                        prev_scores.scalar_type() == torch::kFloat32),
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
      auto bound = [&](int64_t b, int64_t start, int64_t len) { return block_max(row(b) + start, len) + add(b); };
      TopK best{so + n * k, io + n * k, k};
      sentence_candidates(best, beams, V, value, bound);
    }
  });
}

namespace {

RFA_SIMD_CLONES
float max_abs(const float* __restrict__ x, int64_t n) {
  float m = 0.0f;
#pragma omp simd reduction(max : m)
  for (int64_t i = 0; i < n; ++i) m = std::max(m, std::fabs(x[i]));
  return m;
}

RFA_SIMD_CLONES
void quantize_row(const float* __restrict__ x, int64_t n, float inv_scale, uint8_t* __restrict__ q) {
  const float zero = static_cast<float>(kInt8RowZeroPoint), top = static_cast<float>(2 * kInt8RowZeroPoint - 1);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    // round half to even, as torch.round; |x| <= the row's maximum keeps the code in 1 .. 127
    const float v = std::nearbyint(x[i] * inv_scale) + zero;
    q[i] = static_cast<uint8_t>(std::min(std::max(v, 0.0f), top));
  }
}

RFA_SIMD_CLONES
void scale_row(float* __restrict__ y, int64_t n, float s, const float* __restrict__ bias,
               const float* __restrict__ residual, bool relu) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    float v = y[i] * s + (bias != nullptr ? bias[i] : 0.0f);
    if (relu) v = std::max(v, 0.0f);
    y[i] = v + (residual != nullptr ? residual[i] : 0.0f);
  }
}

}  // namespace

void quantize_rows(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scales) {
  const int64_t R = x.size(0), C = x.size(1);
  check_rows(x, R, C, "x");
  TORCH_CHECK(codes.is_contiguous() && codes.scalar_type() == torch::kUInt8 && codes.size(0) == R && codes.size(1) == C,
              "rfa static step: codes must be a contiguous (", R, ", ", C, ") uint8 tensor");
  TORCH_CHECK(scales.is_contiguous() && scales.scalar_type() == torch::kFloat32 && scales.numel() == R,
              "rfa static step: scales must be a contiguous fp32 tensor of ", R, " values");
  const float* xp = x.data_ptr<float>();
  uint8_t* cp = codes.data_ptr<uint8_t>();
  float* sp = scales.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  const float levels = static_cast<float>(kInt8RowZeroPoint - 1);
  at::parallel_for(0, R, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float m = max_abs(xp + r * ldx, C);
      const float scale = m > 0.0f ? m / levels : 1.0f;
      sp[r] = scale;
      quantize_row(xp + r * ldx, C, 1.0f / scale, cp + r * C);
    }
  });
}

void scale_rows(const torch::Tensor& y, const torch::Tensor& scales, const torch::Tensor& bias,
                const torch::Tensor& residual, bool relu) {
  const int64_t R = y.size(0), O = y.size(1);
  check_rows(y, R, O, "y");
  TORCH_CHECK(scales.is_contiguous() && scales.scalar_type() == torch::kFloat32 && scales.numel() == R,
              "rfa static step: scales must be a contiguous fp32 tensor of ", R, " values");
  const bool biased = bias.defined(), added = residual.defined();
  TORCH_CHECK(!biased || (bias.is_contiguous() && bias.scalar_type() == torch::kFloat32 && bias.numel() == O),
              "rfa static step: bias must be a contiguous fp32 tensor of ", O, " values");
  if (added) check_rows(residual, R, O, "residual");
  float* yp = y.data_ptr<float>();
  const float* sp = scales.data_ptr<float>();
  const float* bp = biased ? bias.data_ptr<float>() : nullptr;
  const float* rp = added ? residual.data_ptr<float>() : nullptr;
  const int64_t ldy = y.stride(0), ldr = added ? residual.stride(0) : 0;
  at::parallel_for(0, R, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      scale_row(yp + r * ldy, O, sp[r], bp, added ? rp + r * ldr : nullptr, relu);
    }
  });
}
