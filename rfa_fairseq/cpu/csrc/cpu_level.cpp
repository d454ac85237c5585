// The CPU kernels' levels (cpu_kernels.h): which this build has, which this CPU runs, and the one resolution of a
// level's name. The levels come from levels/level_table.h (written from rfa_fairseq/cpu/levels.py).
#include "cpu_kernels.h"

#include <stdexcept>

#if defined(__aarch64__) && defined(__linux__)
#include <sys/auxv.h>
#endif

namespace rfa::cpu {

// each level's table, defined by levels/level_kernels.cpp compiled into the level's namespace
#define RFA_DECLARE_LEVEL(enumerator, ns, runs) \
  namespace ns {                                \
  const Kernels& level_table();                 \
  }
RFA_ARCHITECTURE_LEVELS(RFA_DECLARE_LEVEL)
#undef RFA_DECLARE_LEVEL

namespace {

[[maybe_unused]] bool hwcap_has(unsigned long bit) {
#if defined(__aarch64__) && defined(__linux__)
  return (getauxval(AT_HWCAP) & bit) != 0;
#else
  (void)bit;
  return false;
#endif
}

std::string joined(const std::vector<Level>& levels) {
  std::string out;
  for (Level level : levels) out += (out.empty() ? "" : ", ") + std::string(level_name(level));
  return out;
}

}  // namespace

const char* level_name(Level level) {
#define RFA_NAME(enumerator, name) \
  if (level == Level::enumerator) return name;
  RFA_ALL_LEVELS(RFA_NAME)
#undef RFA_NAME
  return "unknown";
}

std::vector<Level> architecture_levels() {
#define RFA_LEVEL_OF(enumerator, ns, runs) Level::enumerator,
  return {RFA_ARCHITECTURE_LEVELS(RFA_LEVEL_OF)};
#undef RFA_LEVEL_OF
}

bool cpu_runs(Level level) {
  // asked once per level (__builtin_cpu_supports also checks that the operating system saves the AVX registers)
#define RFA_RUNS(enumerator, ns, runs)      \
  if (level == Level::enumerator) {         \
    static const bool answer = (runs);      \
    return answer;                          \
  }
  RFA_ARCHITECTURE_LEVELS(RFA_RUNS)
#undef RFA_RUNS
  return false;
}

const Kernels& kernels(Level level) {
#define RFA_KERNELS(enumerator, ns, runs) \
  if (level == Level::enumerator) return ns::level_table();
  RFA_ARCHITECTURE_LEVELS(RFA_KERNELS)
#undef RFA_KERNELS
  throw std::invalid_argument(std::string("rfa cpu kernels: the level '") + level_name(level) +
                              "' is not one of this architecture's (" + joined(architecture_levels()) + ")");
}

std::vector<Level> runnable_levels() {
  std::vector<Level> out;
  for (Level level : architecture_levels())
    if (cpu_runs(level)) out.push_back(level);
  return out;
}

Level resolve_level(const std::string& name) {
  const std::vector<Level> levels = architecture_levels();
  size_t limit = levels.size();
  if (name != "auto") {
    limit = 0;
    while (limit < levels.size() && name != level_name(levels[limit])) ++limit;
    if (limit == levels.size())
      throw std::invalid_argument("rfa cpu kernels: '" + name + "' is not an instruction-set level of this " +
                                  "architecture (" + joined(levels) + ", or auto)");
    ++limit;
  }
  Level best = levels.front();  // the architecture's baseline: every CPU of it runs it
  for (size_t i = 0; i < limit; ++i)
    if (cpu_runs(levels[i])) best = levels[i];
  return best;
}

}  // namespace rfa::cpu
