// The CPU kernels' levels (cpu_kernels.h): which this build has, which this CPU runs, and the one choice of a level.
#include "cpu_kernels.h"

#include <stdexcept>

#if defined(__aarch64__) && defined(__linux__)
#include <sys/auxv.h>
#endif

namespace rfa::cpu {

// each level's table, defined by levels/<level>.cpp in the level's namespace
#define RFA_DECLARE_LEVEL(ns) \
  namespace ns {              \
  const Kernels& level_table(); \
  }
#if defined(__x86_64__)
RFA_DECLARE_LEVEL(DEFAULT)
RFA_DECLARE_LEVEL(AVX2)
RFA_DECLARE_LEVEL(AVX512)
RFA_DECLARE_LEVEL(AVX512_VNNI)
#elif defined(__aarch64__)
RFA_DECLARE_LEVEL(NEON)
RFA_DECLARE_LEVEL(NEON_DOTPROD)
#else
RFA_DECLARE_LEVEL(DEFAULT)
#endif
#undef RFA_DECLARE_LEVEL

namespace {

struct LevelEntry {
  Level level;
  const char* name;
};

constexpr LevelEntry kLevelNames[] = {{Level::kDefault, "default"},     {Level::kAVX2, "avx2"},
                                      {Level::kAVX512, "avx512"},       {Level::kAVX512VNNI, "avx512_vnni"},
                                      {Level::kNEON, "neon"},           {Level::kNEONDotProd, "neon_dotprod"}};

std::string joined(const std::vector<Level>& levels) {
  std::string out;
  for (Level level : levels) out += (out.empty() ? "" : ", ") + std::string(level_name(level));
  return out;
}

#if defined(__aarch64__)
bool has_dotprod() {
#if defined(__linux__)
  constexpr unsigned long kHwcapAsimdDp = 1ul << 20;  // HWCAP_ASIMDDP (asm/hwcap.h)
  return (getauxval(AT_HWCAP) & kHwcapAsimdDp) != 0;
#else
  return false;
#endif
}
#endif

}  // namespace

const char* level_name(Level level) {
  for (const LevelEntry& entry : kLevelNames)
    if (entry.level == level) return entry.name;
  return "unknown";
}

std::vector<Level> architecture_levels() {
#if defined(__x86_64__)
  return {Level::kDefault, Level::kAVX2, Level::kAVX512, Level::kAVX512VNNI};
#elif defined(__aarch64__)
  return {Level::kNEON, Level::kNEONDotProd};
#else
  return {Level::kDefault};
#endif
}

bool cpu_runs(Level level) {
#if defined(__x86_64__)
  // __builtin_cpu_supports also checks that the operating system saves the AVX / AVX-512 registers
  static const bool avx2 =
      __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  static const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  static const bool vnni = avx512 && __builtin_cpu_supports("avx512vnni");
  switch (level) {
    case Level::kDefault: return true;
    case Level::kAVX2: return avx2;
    case Level::kAVX512: return avx512;
    case Level::kAVX512VNNI: return vnni;
    default: return false;
  }
#elif defined(__aarch64__)
  static const bool dotprod = has_dotprod();
  return level == Level::kNEON || (level == Level::kNEONDotProd && dotprod);
#else
  return level == Level::kDefault;
#endif
}

const Kernels& kernels(Level level) {
  switch (level) {
#if defined(__x86_64__)
    case Level::kDefault: return DEFAULT::level_table();
    case Level::kAVX2: return AVX2::level_table();
    case Level::kAVX512: return AVX512::level_table();
    case Level::kAVX512VNNI: return AVX512_VNNI::level_table();
#elif defined(__aarch64__)
    case Level::kNEON: return NEON::level_table();
    case Level::kNEONDotProd: return NEON_DOTPROD::level_table();
#else
    case Level::kDefault: return DEFAULT::level_table();
#endif
    default: break;
  }
  throw std::invalid_argument(std::string("rfa cpu kernels: the level '") + level_name(level) +
                              "' is not one of this architecture's (" + joined(architecture_levels()) + ")");
}

Level level_of(const std::string& name) {
  for (Level level : architecture_levels())
    if (name == level_name(level)) return level;
  throw std::invalid_argument("rfa cpu kernels: '" + name + "' is not an instruction-set level of this architecture (" +
                              joined(architecture_levels()) + ", or auto)");
}

std::vector<Level> runnable_levels() {
  std::vector<Level> out;
  for (Level level : architecture_levels())
    if (cpu_runs(level)) out.push_back(level);
  return out;
}

Level select_level(const std::string& cap) {
  const std::vector<Level> levels = architecture_levels();
  size_t limit = levels.size();
  if (cap != "auto") {
    const Level capped = level_of(cap);
    limit = 0;
    while (levels[limit] != capped) ++limit;
    ++limit;
  }
  Level best = levels.front();  // the architecture's baseline: every CPU of it runs it
  for (size_t i = 0; i < limit; ++i)
    if (cpu_runs(levels[i])) best = levels[i];
  return best;
}

}  // namespace rfa::cpu
