// The width-generic vector layer of the CPU kernels (level_kernels.cpp): torch's at::vec::Vectorized<float>, compiled
// once per level with that level's instructions (cpu/extension.py's LEVELS; torch's headers pick the width from the
// CPU_CAPABILITY_* macro, as torch builds its own CPU kernels), and the few operations it lacks, each
// written once per instruction set here:
//
//   load_half / store_half     the fp16 causal state widened to / rounded from a vector of floats
//   Int8Acc / dot4             int8 products: per int32 lane, the sum of 4 u8 codes (0..127) x 4 s8 weights
//                              (AVX-512 VNNI vpdpbusd; AVX2 / AVX-512 vpmaddubsw + vpmaddwd, whose int16 pair sums
//                              cannot saturate on 7-bit codes: 2 x 127 x 127 < 32767; NEON sdot with the dot-product
//                              extension, else vmull + pairwise adds; a plain loop elsewhere)
//
// Everything here is in the level's namespace (rfa::cpu::<CPU_CAPABILITY>), inline or static: nothing a translation
// unit of another level could link to (tests/test_cpu_levels.py checks the objects' symbols).
#pragma once

#include <ATen/cpu/vec/vec.h>

#include <cstdint>
#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#elif defined(__aarch64__)
#include <arm_neon.h>
#endif

namespace rfa::cpu {
inline namespace CPU_CAPABILITY {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kLanes = Vec::size();  // floats (and int32 lanes) in a vector

// vector registers of the instruction set: the kernels' tiles are sized to them
#if defined(CPU_CAPABILITY_AVX512) || defined(__aarch64__)
constexpr int kRegisters = 32;
#else
constexpr int kRegisters = 16;
#endif

// ---------------------------------------------------------------------------------------------- the fp16 state

#if defined(CPU_CAPABILITY_AVX512)
inline Vec load_half(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline void store_half(uint16_t* p, Vec x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
#elif defined(CPU_CAPABILITY_AVX2)
inline Vec load_half(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline void store_half(uint16_t* p, Vec x) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
#elif defined(__aarch64__)
inline Vec load_half(const uint16_t* p) {
  static_assert(kLanes == 4, "NEON: 4 floats a vector");
  return Vec(vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p))));
}
inline void store_half(uint16_t* p, Vec x) { vst1_u16(p, vreinterpret_u16_f16(vcvt_f16_f32(x))); }
#endif

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
inline float load_half1(const uint16_t* p) { return _cvtsh_ss(*p); }
inline void store_half1(uint16_t* p, float x) { *p = _cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
#elif defined(__aarch64__)
inline float load_half1(const uint16_t* p) {
  __fp16 h;
  std::memcpy(&h, p, sizeof(h));
  return static_cast<float>(h);
}
inline void store_half1(uint16_t* p, float x) {
  const __fp16 h = static_cast<__fp16>(x);
  std::memcpy(p, &h, sizeof(h));
}
#else
// IEEE binary16 <-> binary32 in integer arithmetic, round to nearest even (the levels without conversion instructions)
inline float load_half1(const uint16_t* p) {
  const uint32_t h = *p, sign = (h & 0x8000u) << 16, exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
  uint32_t bits;
  if (exponent == 0x1fu) {
    bits = sign | 0x7f800000u | (mantissa << 13);  // inf, NaN
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112u) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;
  } else {  // subnormal: normalize
    int shift = 0;
    uint32_t m = mantissa;
    while ((m & 0x400u) == 0) {
      m <<= 1;
      ++shift;
    }
    bits = sign | ((113u - shift) << 23) | ((m & 0x3ffu) << 13);
  }
  float x;
  std::memcpy(&x, &bits, sizeof(x));
  return x;
}
inline void store_half1(uint16_t* p, float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  const uint32_t sign = (bits >> 16) & 0x8000u, abs = bits & 0x7fffffffu;
  uint16_t h;
  if (abs >= 0x7f800000u) {  // inf, NaN (kept quiet)
    h = static_cast<uint16_t>(sign | 0x7c00u | (abs > 0x7f800000u ? 0x200u | ((abs >> 13) & 0x3ffu) : 0u));
  } else if (abs >= 0x477ff000u) {  // rounds past 65504: inf
    h = static_cast<uint16_t>(sign | 0x7c00u);
  } else if (abs >= 0x38800000u) {  // normal
    const uint32_t rounded = abs + 0xfffu + ((abs >> 13) & 1u);
    h = static_cast<uint16_t>(sign | ((rounded - 0x38000000u) >> 13));
  } else if (abs >= 0x33000000u) {  // subnormal (and the smallest values that round up to one)
    const uint32_t exponent = abs >> 23, mantissa = (abs & 0x7fffffu) | 0x800000u, shift = 126u - exponent;
    const uint32_t kept = mantissa >> shift, rest = mantissa & ((1u << shift) - 1u), half = 1u << (shift - 1u);
    h = static_cast<uint16_t>(sign | (kept + (rest > half || (rest == half && (kept & 1u)))));
  } else {
    h = static_cast<uint16_t>(sign);
  }
  *p = h;
}
#endif

#if !(defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2) || defined(__aarch64__))
inline Vec load_half(const uint16_t* p) {
  __at_align__ float x[kLanes];
  for (int64_t i = 0; i < kLanes; ++i) x[i] = load_half1(p + i);
  return Vec::loadu(x);
}
inline void store_half(uint16_t* p, Vec v) {
  __at_align__ float x[kLanes];
  v.store(x);
  for (int64_t i = 0; i < kLanes; ++i) store_half1(p + i, x[i]);
}
#endif

// ---------------------------------------------------------------------------------------------- int8 products

// Int8Acc: kLanes int32 sums; Int8W: a block's group of weights, kLanes x 4 s8 (lane-major), loaded by int8_weights;
// dot4(acc, codes, w): acc[i] += sum_j codes[j] * w[4 i + j] (j < 4), the 4 codes of one group (u8, 0..127) broadcast
// by broadcast_codes from one little-endian int32
#if defined(CPU_CAPABILITY_AVX512)
using Int8Acc = __m512i;
inline Int8Acc int8_zero() { return _mm512_setzero_si512(); }
inline Int8Acc broadcast_codes(int32_t codes) { return _mm512_set1_epi32(codes); }
using Int8W = __m512i;
inline Int8W int8_weights(const int8_t* w) { return _mm512_loadu_si512(w); }
inline Int8Acc dot4(Int8Acc acc, Int8Acc codes, Int8W weights) {
#if defined(RFA_LEVEL_VNNI)
  return _mm512_dpbusd_epi32(acc, codes, weights);
#else
  const __m512i pairs = _mm512_maddubs_epi16(codes, weights);  // u8 x s8, pairs summed in int16
  return _mm512_add_epi32(acc, _mm512_madd_epi16(pairs, _mm512_set1_epi16(1)));
#endif
}
// float(acc - sums): the symmetric products' sums (the codes' zero point times the weights' sums taken off)
inline Vec int8_sums(Int8Acc acc, const int32_t* sums) {
  return _mm512_cvtepi32_ps(_mm512_sub_epi32(acc, _mm512_loadu_si512(sums)));
}
#elif defined(CPU_CAPABILITY_AVX2)
using Int8Acc = __m256i;
inline Int8Acc int8_zero() { return _mm256_setzero_si256(); }
inline Int8Acc broadcast_codes(int32_t codes) { return _mm256_set1_epi32(codes); }
using Int8W = __m256i;
inline Int8W int8_weights(const int8_t* w) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)); }
inline Int8Acc dot4(Int8Acc acc, Int8Acc codes, Int8W weights) {
  const __m256i pairs = _mm256_maddubs_epi16(codes, weights);  // u8 x s8, pairs summed in int16
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}
inline Vec int8_sums(Int8Acc acc, const int32_t* sums) {
  return _mm256_cvtepi32_ps(_mm256_sub_epi32(acc, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sums))));
}
#elif defined(__aarch64__)
using Int8Acc = int32x4_t;
inline Int8Acc int8_zero() { return vdupq_n_s32(0); }
inline Int8Acc broadcast_codes(int32_t codes) { return vdupq_n_s32(codes); }
using Int8W = int8x16_t;
inline Int8W int8_weights(const int8_t* w) { return vld1q_s8(w); }
inline Int8Acc dot4(Int8Acc acc, Int8Acc codes, Int8W weights) {
  const int8x16_t a = vreinterpretq_s8_s32(codes);  // codes 0..127: the same as s8
#if defined(__ARM_FEATURE_DOTPROD)
  return vdotq_s32(acc, weights, a);
#else
  // the 16 products in int16 (lane i's 4 in 4i .. 4i + 3), pairs summed (2 x 127 x 127 fits), then pairs into acc
  const int16x8_t low = vmull_s8(vget_low_s8(weights), vget_low_s8(a)), high = vmull_high_s8(weights, a);
  return vpadalq_s16(acc, vpaddq_s16(low, high));
#endif
}
inline Vec int8_sums(Int8Acc acc, const int32_t* sums) { return Vec(vcvtq_f32_s32(vsubq_s32(acc, vld1q_s32(sums)))); }
#else
struct Int8Acc {
  int32_t lane[kLanes];
};
inline Int8Acc int8_zero() { return Int8Acc{}; }
inline Int8Acc broadcast_codes(int32_t codes) {
  Int8Acc a;
  for (int64_t i = 0; i < kLanes; ++i) a.lane[i] = codes;
  return a;
}
using Int8W = const int8_t*;
inline Int8W int8_weights(const int8_t* w) { return w; }
inline Int8Acc dot4(Int8Acc acc, Int8Acc codes, Int8W w) {
  uint8_t a[4];
  std::memcpy(a, &codes.lane[0], sizeof(a));
  for (int64_t i = 0; i < kLanes; ++i) {
    for (int j = 0; j < 4; ++j) acc.lane[i] += static_cast<int32_t>(a[j]) * w[4 * i + j];
  }
  return acc;
}
inline Vec int8_sums(Int8Acc acc, const int32_t* sums) {
  __at_align__ float x[kLanes];
  for (int64_t i = 0; i < kLanes; ++i) x[i] = static_cast<float>(acc.lane[i] - sums[i]);
  return Vec::loadu(x);
}
#endif

}  // namespace CPU_CAPABILITY
}  // namespace rfa::cpu
