// Written by `python rfa_fairseq/cpu/levels.py` from its table (LEVELS): edit that table, not this file.
// tests/test_cpu_levels.py checks that this file is current.
#pragma once

namespace rfa::cpu {

enum class Level : int { kDEFAULT = 0, kAVX2 = 1, kAVX512 = 2, kAVX512_VNNI = 3, kNEON = 4, kNEON_DOTPROD = 5 };

}  // namespace rfa::cpu

// X(enumerator, name): every level, in the enum's order
#define RFA_ALL_LEVELS(X) X(kDEFAULT, "default") X(kAVX2, "avx2") X(kAVX512, "avx512") X(kAVX512_VNNI, "avx512_vnni") X(kNEON, "neon") X(kNEON_DOTPROD, "neon_dotprod")

// X(enumerator, namespace, whether this CPU runs it): this build's architecture's levels, lowest first
// (hwcap_has: cpu_level.cpp's test of a getauxval(AT_HWCAP) bit)
#if defined(__x86_64__)
#define RFA_ARCHITECTURE_LEVELS(X) \
  X(kDEFAULT, DEFAULT, true) \
  X(kAVX2, AVX2, __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) \
  X(kAVX512, AVX512, __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c") && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")) \
  X(kAVX512_VNNI, AVX512_VNNI, __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c") && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vnni"))
#elif defined(__aarch64__)
#define RFA_ARCHITECTURE_LEVELS(X) \
  X(kNEON, NEON, true) \
  X(kNEON_DOTPROD, NEON_DOTPROD, hwcap_has(1ul << 20))
#else
#define RFA_ARCHITECTURE_LEVELS(X) \
  X(kDEFAULT, DEFAULT, true)
#endif
