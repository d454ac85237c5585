// The CPU kernels, written once over the vector layer (simd.h) and compiled once per instruction-set level, as torch
// compiles its own CPU kernels: cpu/levels.py's LEVELS give each level's compiler flags (its instructions, torch's
// CPU_CAPABILITY and RFA_LEVEL, the level's cpu_kernels.h name), and each build defines that level's table (Kernels)
// as rfa::cpu::<CPU_CAPABILITY>::level_table(). Vectors are kLanes floats wide (AVX-512 16, AVX2 8, NEON 4); tiles are
// sized to the level's registers.
//
//   linear_fp32 / _int8     linear layers on the weights in blocks of kLanes output channels, all inputs of a block
//                           contiguous (the one copy of each weight the runtime keeps), any number of rows: tiles of
//                           a few rows x a few blocks hold their sums in registers and read each weight vector once
//                           per tile (below: the tiles' shapes, the row blocks, the prefetch). fp32 sums the inputs in
//                           chunks of 512 (each chunk's sum added to the total) and adds the bias after: oneDNN's
//                           order on AVX-512 (bit-identical results there for I <= 1024). int8 sums exact int32
//                           products of 7-bit u8 codes and s8 weights (simd.h's dot4), then oneDNN's int8 epilogue
//                           in its order: ((sum - zero point x weight sum) * w_scale) * row_scale + bias.
//   exp_inplace             Cephes' single-precision exp polynomial, lane for lane
//   row_log_sum_exp         the search's log-softmax: kLanes partial maxima and sums, then theirs
//   update_and_read_out     the causal RFA state update and read-out of one head in one pass over the state
//
// References (tests): ops/naive.py, torch's operators and oneDNN's linear layers; every level is tested on every machine
// that runs it (tests/test_cpu_levels.py).
#if !defined(CPU_CAPABILITY) || !defined(RFA_LEVEL)
#error "a level's build defines CPU_CAPABILITY and RFA_LEVEL (rfa_fairseq/cpu/levels.py's LEVELS)"
#endif

#include "../cpu_kernels.h"
#include "simd.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <utility>

namespace rfa::cpu {
inline namespace CPU_CAPABILITY {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int64_t kFp32Chunk = 512;  // fp32: inputs summed in one chain before joining the total (oneDNN's split)

// ------------------------------------------------------------------------------------------------ exp, log-softmax

// exp(x) = 2^n * p(r), n = floor(x log2(e) + 1/2), r = x - n ln(2) (ln(2) in two parts): Cephes' single-precision
// polynomial, about 1 ulp on the range used here (x <= 0)
constexpr float kExpHi = 88.3762626647949f, kExpLo = -87.3365447505531f, kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kExpP[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                            4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

inline Vec exp_poly(Vec x) {
  x = at::vec::clamp(x, Vec(kExpLo), Vec(kExpHi));
  const Vec fx = at::vec::fmadd(x, Vec(kLog2e), Vec(0.5f)).floor();
  x = at::vec::fnmadd(fx, Vec(kLn2Hi), x);
  x = at::vec::fnmadd(fx, Vec(kLn2Lo), x);
  Vec y(kExpP[0]);
  for (int i = 1; i < 6; ++i) y = at::vec::fmadd(y, x, Vec(kExpP[i]));
  y = at::vec::fmadd(y, x * x, x + Vec(1.0f));
  const auto n = at::vec::convert_to_int_of_same_size(fx) + at::vec::Vectorized<int32_t>(127);
  return y * at::vec::cast<float>(n << at::vec::Vectorized<int32_t>(23));
}

void exp_inplace(float* x, int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) exp_poly(Vec::loadu(x + i)).store(x + i);
  for (; i < n; ++i) x[i] = std::exp(x[i]);
}

// the lanes' values summed in lane order
inline float lane_sum(Vec v) {
  __at_align__ float lanes[kLanes];
  v.store(lanes);
  float sum = 0.0f;
  for (float x : lanes) sum += x;
  return sum;
}

inline float lane_max(Vec v) {
  __at_align__ float lanes[kLanes];
  v.store(lanes);
  float m = kNegInf;
  for (float x : lanes) m = std::max(m, x);
  return m;
}

void row_log_sum_exp(const float* x, int64_t n, float* max_out, float* log_sum_out) {
  Vec mv(kNegInf);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) mv = at::vec::maximum(mv, Vec::loadu(x + i));  // NaN propagates
  float m = kNegInf;
  if (i > 0) m = lane_max(mv);
  for (; i < n; ++i) m = std::max(m, x[i]);
  float sum = 0.0f;
  if (!std::isfinite(m)) {  // an all -inf (or +inf) row: log_softmax's own NaN / -inf follow from the scalar path
    for (int64_t j = 0; j < n; ++j) sum += std::exp(x[j] - m);
  } else {
    const Vec shift(m);
    Vec sv(0.0f);
    for (i = 0; i + kLanes <= n; i += kLanes) sv = sv + exp_poly(Vec::loadu(x + i) - shift);
    if (i > 0) sum = lane_sum(sv);
    for (; i < n; ++i) sum += std::exp(x[i] - m);
  }
  *max_out = m;
  *log_sum_out = std::log(sum);
}

float block_max(const float* __restrict__ x, int64_t n) {
  float m = kNegInf;
#pragma omp simd reduction(max : m)
  for (int64_t i = 0; i < n; ++i) m = x[i] > m ? x[i] : m;
  return m;
}

// ------------------------------------------------------------------------------------------------ the causal update

// the state's elements: fp32, or fp16 bits (read widened, stored rounded; the arithmetic in fp32)
inline Vec state_load(const float* p) { return Vec::loadu(p); }
inline Vec state_load(const uint16_t* p) { return load_half(p); }
inline void state_store(float* p, Vec x) { x.store(p); }
inline void state_store(uint16_t* p, Vec x) { store_half(p, x); }
inline float state_load1(const float* p) { return *p; }
inline float state_load1(const uint16_t* p) { return load_half1(p); }
inline void state_store1(float* p, float x) { *p = x; }
inline void state_store1(uint16_t* p, float x) { store_half1(p, x); }

// kBlocks vectors of columns from j: their read-out sums held in registers across the F rows (they never go to memory),
// each state row read and written once, in order; [v, 1]'s columns held too where the registers allow
template <int kBlocks, typename S>
inline void update_columns(const S* __restrict__ s_in, S* __restrict__ s_out, const float* __restrict__ q,
                           const float* __restrict__ k, const float* __restrict__ v_aug, float g, float k_scale,
                           int64_t F, int64_t D1, int64_t j, float* __restrict__ acc) {
  constexpr bool kHoldV = kRegisters >= 32;
  Vec a[kBlocks], v[kBlocks];
  for (int b = 0; b < kBlocks; ++b) {
    a[b] = Vec(0.0f);
    if (kHoldV) v[b] = Vec::loadu(v_aug + j + kLanes * b);
  }
  const Vec gv(g);
  for (int64_t f = 0; f < F; ++f) {
    const Vec kf(k[f] * k_scale), qf(q[f]);
    for (int b = 0; b < kBlocks; ++b) {
      const int64_t at = f * D1 + j + kLanes * b;
      Vec s = kf * (kHoldV ? v[b] : Vec::loadu(v_aug + j + kLanes * b));
      if (s_in != nullptr) s = at::vec::fmadd(gv, state_load(s_in + at), s);
      state_store(s_out + at, s);
      a[b] = at::vec::fmadd(qf, s, a[b]);
    }
  }
  for (int b = 0; b < kBlocks; ++b) a[b].store(acc + j + kLanes * b);
}

template <typename S>
void update_and_read_out(const S* __restrict__ s_in, S* __restrict__ s_out, const float* __restrict__ q,
                         const float* __restrict__ k, const float* __restrict__ v_aug, float g, float k_scale,
                         int64_t F, int64_t D1, float* __restrict__ acc) {
  // up to 64 columns at a time (AVX2's 16 registers: 8 sums and a loaded vector; AVX-512: 4 sums and 4 of [v, 1])
  constexpr int kWide = static_cast<int>(std::max<int64_t>(1, 64 / kLanes));
  int64_t j = 0;
  for (; j + kWide * kLanes <= D1; j += kWide * kLanes)
    update_columns<kWide>(s_in, s_out, q, k, v_aug, g, k_scale, F, D1, j, acc);
  for (; j + kLanes <= D1; j += kLanes) update_columns<1>(s_in, s_out, q, k, v_aug, g, k_scale, F, D1, j, acc);
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

void update_and_read_out_fp32(const float* s_in, float* s_out, const float* q, const float* k, const float* v_aug,
                              float g, float k_scale, int64_t F, int64_t D1, float* acc) {
  update_and_read_out(s_in, s_out, q, k, v_aug, g, k_scale, F, D1, acc);
}

void update_and_read_out_fp16(const uint16_t* s_in, uint16_t* s_out, const float* q, const float* k,
                              const float* v_aug, float g, float k_scale, int64_t F, int64_t D1, float* acc) {
  update_and_read_out(s_in, s_out, q, k, v_aug, g, k_scale, F, D1, acc);
}

// ------------------------------------------------------------------------------------------------ small loops

float dot(const float* __restrict__ a, const float* __restrict__ b, int64_t n) {
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

void axpy(float a, const float* __restrict__ x, float* __restrict__ y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

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

// two passes for the variance, as torch
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

float max_abs(const float* __restrict__ x, int64_t n) {
  float m = 0.0f;
#pragma omp simd reduction(max : m)
  for (int64_t i = 0; i < n; ++i) m = std::max(m, std::fabs(x[i]));
  return m;
}

void quantize_row(const float* __restrict__ x, int64_t n, float inv_scale, uint8_t* __restrict__ q) {
  const float zero = static_cast<float>(kInt8RowZeroPoint), top = static_cast<float>(2 * kInt8RowZeroPoint - 1);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    // round half to even, as torch.round; |x| <= the row's maximum keeps the code in 1 .. 127
    const float v = std::nearbyint(x[i] * inv_scale) + zero;
    q[i] = static_cast<uint8_t>(std::min(std::max(v, 0.0f), top));
  }
}

// ------------------------------------------------------------------------------------------------ linear products

// v (kLanes channels from n0, `valid` of them) of row r: + bias, relu, + residual, stored
inline void store_output(const LinearOutput& out, int64_t r, int64_t n0, int64_t valid, Vec v, Vec bias) {
  v = v + bias;
  if (out.relu) v = at::vec::clamp_min(v, Vec(0.0f));
  if (out.residual != nullptr) v = v + Vec::loadu(out.residual + r * out.ldr + n0, valid);
  v.store(out.y + r * out.ldy + n0, valid);
}

inline int64_t valid_lanes(const LinearOutput& out, int64_t n0) { return std::min(kLanes, out.out_features - n0); }

inline Vec bias_of(const LinearOutput& out, int64_t n0, int64_t valid) {
  return out.bias != nullptr ? Vec::loadu(out.bias + n0, valid) : Vec(0.0f);
}

// the weights a tile reads kPrefetchSteps steps of its inputs ahead, asked of the memory before they are needed (a
// panel's first tile meets them coming from memory: the hardware's own prefetch keeps too few lines in flight)
constexpr int64_t kPrefetchSteps = 16;
inline void prefetch(const void* p) { __builtin_prefetch(p, 0, 3); }

// The inputs [k0, k1) of a tile (whole chunks of kFp32Chunk, or all of them): their chunks' sums added to the total so
// far (first: none; else the raw sums an earlier call left in y), then stored with the epilogue (last) or raw, for
// the next call (the K blocks of many rows, for_each_tile)
template <int ROWS, int BLOCKS>
void fp32_tile(const float* x, int64_t ldx, int64_t I, const float* weight, const LinearOutput& out, int64_t r0,
               int64_t b0, bool ahead, int64_t k_begin, int64_t k_end, bool first, bool last) {
  const int64_t block_stride = I * kLanes;
  const float* w = weight + b0 * block_stride;
  Vec total[ROWS][BLOCKS];
  if (!first) {
    for (int b = 0; b < BLOCKS; ++b) {
      const int64_t n0 = (b0 + b) * kLanes, valid = valid_lanes(out, n0);
      for (int r = 0; r < ROWS; ++r) total[r][b] = Vec::loadu(out.y + (r0 + r) * out.ldy + n0, valid);
    }
  }
  for (int64_t k0 = k_begin; k0 < k_end; k0 += kFp32Chunk) {
    Vec part[ROWS][BLOCKS];
    for (int r = 0; r < ROWS; ++r)
      for (int b = 0; b < BLOCKS; ++b) part[r][b] = Vec(0.0f);
    for (int64_t k = k0, end = std::min(k_end, k0 + kFp32Chunk); k < end; ++k) {
      Vec wb[BLOCKS];
      for (int b = 0; b < BLOCKS; ++b) {
        wb[b] = Vec::loadu(w + b * block_stride + k * kLanes);
        if (ahead) prefetch(w + b * block_stride + (k + kPrefetchSteps) * kLanes);
      }
      for (int r = 0; r < ROWS; ++r) {
        const Vec a(x[(r0 + r) * ldx + k]);
        for (int b = 0; b < BLOCKS; ++b) part[r][b] = at::vec::fmadd(a, wb[b], part[r][b]);
      }
    }
    for (int r = 0; r < ROWS; ++r)
      for (int b = 0; b < BLOCKS; ++b) total[r][b] = first && k0 == k_begin ? part[r][b] : total[r][b] + part[r][b];
  }
  for (int b = 0; b < BLOCKS; ++b) {
    const int64_t n0 = (b0 + b) * kLanes, valid = valid_lanes(out, n0);
    if (!last) {
      for (int r = 0; r < ROWS; ++r) total[r][b].store(out.y + (r0 + r) * out.ldy + n0, valid);
      continue;
    }
    const Vec bias = bias_of(out, n0, valid);
    for (int r = 0; r < ROWS; ++r) store_output(out, r0 + r, n0, valid, total[r][b], bias);
  }
}

// AVX2's int8 product of a group is three instructions (vpmaddubsw, vpmaddwd, vpaddd): the compiler hoisted every
// row's first instruction above the others', and the sums their temporaries displaced from the 16 registers went to
// the stack (a store and a load per group). An empty asm taking a row's sums in registers ends the row's products
// first: no sum leaves the registers. (AVX-512 without VNNI, tried the same way, lost more than it kept.)
#if defined(CPU_CAPABILITY_AVX2)
inline void keep_in_register(Int8Acc& acc) { asm("" : "+x"(acc)); }
#else
inline void keep_in_register(Int8Acc&) {}
#endif

template <int ROWS, int BLOCKS>
void int8_tile(const uint8_t* codes, int64_t I, const int8_t* weight, const Int8Scales& scales,
               const LinearOutput& out, int64_t r0, int64_t b0, bool ahead) {
  const int64_t groups = (I + kInt8Group - 1) / kInt8Group, whole = I / kInt8Group;
  const int64_t block_stride = groups * kLanes * kInt8Group;
  const int8_t* w = weight + b0 * block_stride;
  const uint8_t* rows = codes + r0 * I;
  // a last partial group: its missing codes 0 (their weights are padding)
  uint8_t tail[ROWS][kInt8Group] = {};
  if (whole < groups)
    for (int r = 0; r < ROWS; ++r) std::memcpy(tail[r], rows + r * I + whole * kInt8Group, I - whole * kInt8Group);
  // the sums stay in registers: one loop body over every group (the tail's codes read from `tail`), written in this
  // function (sums passed to a helper by reference were kept on the stack too, a store after every product)
  Int8Acc acc[ROWS][BLOCKS];
  for (int r = 0; r < ROWS; ++r)
    for (int b = 0; b < BLOCKS; ++b) acc[r][b] = int8_zero();
  for (int64_t g = 0; g < groups; ++g) {
    const bool partial = g == whole;
    const uint8_t* group_codes = partial ? &tail[0][0] : rows + g * kInt8Group;
    const int64_t ldc = partial ? kInt8Group : I;
    const bool prefetching = ahead && !partial;
    Int8W wb[BLOCKS];
    for (int b = 0; b < BLOCKS; ++b) {
      wb[b] = int8_weights(w + b * block_stride + g * kLanes * kInt8Group);
      if (prefetching) prefetch(w + b * block_stride + (g + kPrefetchSteps) * kLanes * kInt8Group);
    }
    // each row's broadcast just before its products (with AVX2's 16 registers, every row's broadcast held at once
    // made the sums spill to the stack)
    for (int r = 0; r < ROWS; ++r) {
      int32_t word;  // the group's 4 codes as one int32 (rows need no 4-byte alignment)
      std::memcpy(&word, group_codes + r * ldc, sizeof(word));
      const Int8Acc a = broadcast_codes(word);
      for (int b = 0; b < BLOCKS; ++b) acc[r][b] = dot4(acc[r][b], a, wb[b]);
      for (int b = 0; b < BLOCKS; ++b) keep_in_register(acc[r][b]);
    }
  }
  // the epilogue unrolled too: a sum read at a variable index kept the whole array on the stack
#pragma GCC unroll 16
  for (int b = 0; b < BLOCKS; ++b) {
    const int64_t n0 = (b0 + b) * kLanes, valid = valid_lanes(out, n0);
    const Vec w_scales = Vec::loadu(scales.w_scales + n0, valid), bias = bias_of(out, n0, valid);
#pragma GCC unroll 16
    for (int r = 0; r < ROWS; ++r) {
      // oneDNN's int8 output, float(sum) * w_scale, then the row's scale and the bias in that order (no fused
      // multiply-add: the roundings of the int8 path this replaced, the same results)
      const Vec v = int8_sums(acc[r][b], scales.sums + n0) * w_scales;
      store_output(out, r0 + r, n0, valid, v * Vec(scales.row_scales[r0 + r]), bias);
    }
  }
}

// The tiles' shapes, sized to the level's registers (sums + a tile's weight vectors + a broadcast row):
//   few rows (at most kFewRows: a sentence's beam): kFewRows x kFewBlocks;
//   more rows: kManyRows x kManyBlocks (fp32; AVX-512 / NEON 8 x 3: 24 sums, 3 weights, 1 broadcast), int8 with the
//   level's dot product (VNNI vpdpbusd, NEON sdot: one instruction) the same, without it (two products and a
//   constant of ones in registers too) fewer rows.
constexpr int64_t kFewRows = 4;
constexpr int kFewBlocks = kRegisters >= 32 ? 4 : 2;
constexpr int kManyRows = kRegisters >= 32 ? 8 : 6;
constexpr int kManyBlocks = kRegisters >= 32 ? 3 : 2;
#if defined(RFA_LEVEL_VNNI) || defined(__ARM_FEATURE_DOTPROD)
constexpr int kInt8ManyRows = kManyRows;
#elif defined(CPU_CAPABILITY_AVX512)
// AVX-512 without VNNI: 5 rows (6 x 3 kept 6 of its 18 sums on the stack, 5 % slower)
constexpr int kInt8ManyRows = 5;
#else
constexpr int kInt8ManyRows = kRegisters >= 32 ? 6 : kFewRows;
#endif
constexpr int kTileRows = static_cast<int>(std::max<int64_t>(kFewRows, std::max(kManyRows, kInt8ManyRows)));
constexpr int kTileBlocks = std::max(kFewBlocks, kManyBlocks);
// many rows go in row blocks whose inputs take about this many bytes: they stay in the core's L2 cache while every
// panel of weights passes over them (larger blocks read the weights fewer times)
constexpr int64_t kRowBlockBytes = 512 * 1024;

// table[rows][blocks] of a tile function: rows 1 .. kTileRows, blocks 1 .. kTileBlocks
template <class Tile, template <int, int> class Of>
struct TileTable {
  using Row = std::array<Tile, kTileBlocks + 1>;
  template <int ROWS, int... B>
  static constexpr Row row(std::integer_sequence<int, B...>) {
    return {nullptr, Of<ROWS, B + 1>::fn...};
  }
  template <int... R>
  static constexpr std::array<Row, kTileRows + 1> rows(std::integer_sequence<int, R...>) {
    return {Row{}, row<R + 1>(std::make_integer_sequence<int, kTileBlocks>{})...};
  }
  static constexpr std::array<Row, kTileRows + 1> table = rows(std::make_integer_sequence<int, kTileRows>{});
};

using Fp32Tile = void (*)(const float*, int64_t, int64_t, const float*, const LinearOutput&, int64_t, int64_t, bool,
                          int64_t, int64_t, bool, bool);
using Int8Tile = void (*)(const uint8_t*, int64_t, const int8_t*, const Int8Scales&, const LinearOutput&, int64_t,
                          int64_t, bool);
template <int R, int B>
struct Fp32Of {
  static constexpr Fp32Tile fn = fp32_tile<R, B>;
};
template <int R, int B>
struct Int8Of {
  static constexpr Int8Tile fn = int8_tile<R, B>;
};

// The tiles of blocks [block_begin, block_end) x every row, run(r0, rows, b0, blocks, ahead, k0, k1): up to kFewRows
// rows, kFewRows x kFewBlocks tiles over every input, columns outer (a tile's weights stay near over every row). More
// rows: row blocks whose inputs [k0, k1) take about kRowBlockBytes (bytes_per_input per row and input), and in each,
// panels of many_blocks blocks passing over tiles of many_rows rows (the last rows and blocks in smaller tiles); the
// inputs in K blocks of k_block (fp32: whole chunks; a K block's sums carried to the next in y), so that a row block
// holds many rows of long inputs and the weights pass over them fewer times. A panel's first tile prefetches its
// weights.
template <class Run>
void for_each_tile(int64_t R, int64_t I, int64_t bytes_per_input, int64_t k_block, int64_t many_rows,
                   int64_t many_blocks, int64_t block_begin, int64_t block_end, const Run& run) {
  if (R <= kFewRows) {
    for (int64_t b0 = block_begin; b0 < block_end; b0 += kFewBlocks)
      run(0, R, b0, std::min<int64_t>(kFewBlocks, block_end - b0), true, 0, I);
    return;
  }
  const int64_t k_step = std::min(I, k_block);
  const int64_t row_block = std::max(many_rows, kRowBlockBytes / (k_step * bytes_per_input) / many_rows * many_rows);
  for (int64_t m0 = 0; m0 < R; m0 += row_block) {
    const int64_t m1 = std::min(R, m0 + row_block);
    for (int64_t k0 = 0; k0 < I; k0 += k_step) {
      for (int64_t b0 = block_begin; b0 < block_end; b0 += many_blocks) {
        const int64_t blocks = std::min(many_blocks, block_end - b0);
        for (int64_t r0 = m0; r0 < m1; r0 += many_rows)
          run(r0, std::min(many_rows, m1 - r0), b0, blocks, r0 == m0, k0, std::min(I, k0 + k_step));
      }
    }
  }
}

int64_t tile_blocks(int64_t rows) { return rows <= kFewRows ? kFewBlocks : kManyBlocks; }

void linear_fp32(const float* x, int64_t ldx, int64_t R, int64_t I, const float* blocks, const LinearOutput& out,
                 int64_t block_begin, int64_t block_end) {
  for_each_tile(R, I, sizeof(float), kFp32Chunk, kManyRows, kManyBlocks, block_begin, block_end,
                [&](int64_t r0, int64_t rows, int64_t b0, int64_t n, bool ahead, int64_t k0, int64_t k1) {
                  TileTable<Fp32Tile, Fp32Of>::table[rows][n](x, ldx, I, blocks, out, r0, b0, ahead, k0, k1, k0 == 0,
                                                              k1 == I);
                });
}

void linear_int8(const uint8_t* codes, int64_t R, int64_t I, const int8_t* blocks, const Int8Scales& scales,
                 const LinearOutput& out, int64_t block_begin, int64_t block_end) {
  // int8 rows are a quarter of fp32's: a row block holds many rows of every input, no K blocks
  for_each_tile(R, I, 1, I, kInt8ManyRows, kManyBlocks, block_begin, block_end,
                [&](int64_t r0, int64_t rows, int64_t b0, int64_t n, bool ahead, int64_t, int64_t) {
                  TileTable<Int8Tile, Int8Of>::table[rows][n](codes, I, blocks, scales, out, r0, b0, ahead);
                });
}

}  // namespace

const Kernels& level_table() {
  static const Kernels table{Level::RFA_LEVEL,
                             level_name(Level::RFA_LEVEL),
                             kLanes,
                             tile_blocks,
                             linear_fp32,
                             linear_int8,
                             exp_inplace,
                             row_log_sum_exp,
                             block_max,
                             update_and_read_out_fp32,
                             update_and_read_out_fp16,
                             dot,
                             axpy,
                             hedgehog,
                             layer_norm_row,
                             max_abs,
                             quantize_row};
  return table;
}

}  // namespace CPU_CAPABILITY
}  // namespace rfa::cpu
