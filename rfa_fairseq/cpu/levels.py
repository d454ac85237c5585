"""The CPU kernels' instruction-set levels, declared once: `LEVELS`. Everything else that names a level derives from it:

- the C++ enum, each architecture's levels and how the CPU is asked whether it runs one: csrc/levels/level_table.h,
  written from this table by `python rfa_fairseq/cpu/levels.py` (tests/test_cpu_levels.py checks it is current);
- the flags that compile csrc/levels/level_kernels.cpp once per level (`compile_flags`, cpu/extension.py);
- oneDNN's name of a level (`onednn_isa`: the benchmarks cap torch's own oneDNN products with it when they measure a
  level; the plugin's runtime does not use oneDNN), --rfa-cpu-isa's choices (`ALL_NAMES`, kernel_choice.py), and the
  tests' lists.

A level's `cpu_features` are what the CPU must have to run it: on x86-64 __builtin_cpu_supports' names (which also
checks that the operating system saves the registers), on aarch64 the kernel's HWCAP names (getauxval); each is also
the Linux kernel's /proc/cpuinfo flag (CPUINFO_FLAG where the spelling differs), which the tests check the module's
answer against.

"default" is each architecture's baseline, which every CPU of it runs: on x86-64 SSE2 (the kernels are compiled with no
-m flag), elsewhere the compiler's baseline. oneDNN has no ISA below SSE4.1 (its own code below it is its reference C++,
not capped by name), so capping it at "default" names its lowest, SSE41.

Importing this file needs only the standard library: setup.py loads cpu/extension.py, and it this file, by path.
"""
import dataclasses
import platform
import sys
from pathlib import Path
from typing import Optional, Tuple


@dataclasses.dataclass(frozen=True)
class Level:
    name: str  # --rfa-cpu-isa's name and the level object's file name
    machines: Tuple[str, ...]  # platform.machine() values it is built for ("*": an architecture without a table)
    namespace: str  # the level object's namespace rfa::cpu::<namespace>, and torch's CPU_CAPABILITY define
    instructions: str  # in words
    cpu_features: Tuple[str, ...] = ()  # what the CPU must have (module docstring)
    flags: Tuple[str, ...] = ()  # the compiler's instruction-set flags
    # the macro torch's vector layer (ATen/cpu/vec) reads for its vector width: CPU_CAPABILITY_<vec>
    torch_vec: Optional[str] = None
    onednn: Optional[str] = None  # ONEDNN_MAX_CPU_ISA: oneDNN's highest ISA at this level (None: no cap)
    defines: Tuple[str, ...] = ()  # further macros of the level's object

    @property
    def enumerator(self) -> str:
        """The C++ enumerator: Level::k<namespace>."""
        return f"k{self.namespace}"


_AVX2 = ("avx2", "fma", "f16c")
_AVX512 = (*_AVX2, "avx512f", "avx512bw", "avx512vl", "avx512dq")
_M_AVX2 = ("-mavx2", "-mfma", "-mf16c")
_M_AVX512 = (*_M_AVX2, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq")

# Every level, each architecture's lowest first (its baseline, which every CPU of it runs). The order here is the
# enum's; a new level is one more row (and its kernels in csrc/levels/simd.h where its vectors differ).
LEVELS = (
    Level("default", ("x86_64", "*"), "DEFAULT", "the baseline (x86-64: SSE2)", torch_vec="DEFAULT",
          onednn="SSE41"),
    Level("avx2", ("x86_64",), "AVX2", "AVX2 + FMA + F16C", _AVX2, _M_AVX2, torch_vec="AVX2", onednn="AVX2"),
    Level("avx512", ("x86_64",), "AVX512", "AVX-512 F/BW/VL/DQ", _AVX512, _M_AVX512, torch_vec="AVX512",
          onednn="AVX512_CORE"),
    Level("avx512_vnni", ("x86_64",), "AVX512_VNNI", "AVX-512 + VNNI (vpdpbusd)", (*_AVX512, "avx512vnni"),
          (*_M_AVX512, "-mavx512vnni"), torch_vec="AVX512", onednn="AVX512_CORE_VNNI", defines=("RFA_LEVEL_VNNI",)),
    # oneDNN has no ISA between ASIMD and SVE: neon_dotprod, the top aarch64 level, needs no cap
    Level("neon", ("aarch64",), "NEON", "Advanced SIMD (the aarch64 baseline)", onednn="ASIMD"),
    Level("neon_dotprod", ("aarch64",), "NEON_DOTPROD", "Advanced SIMD + the dot-product extension (sdot)",
          ("asimddp",), ("-march=armv8.2-a+dotprod",)),
)
ALL_NAMES = tuple(level.name for level in LEVELS)
# the preprocessor's test for each architecture that has a table
MACHINE_MACROS = {"x86_64": "__x86_64__", "aarch64": "__aarch64__"}
MACHINE_ALIASES = {"amd64": "x86_64", "arm64": "aarch64"}
CPUINFO_FLAG = {"avx512vnni": "avx512_vnni"}  # /proc/cpuinfo's spelling where __builtin_cpu_supports' differs
HWCAP_BIT = {"asimddp": 20}  # aarch64: the bit of getauxval(AT_HWCAP) (asm/hwcap.h's HWCAP_ASIMDDP)
HEADER = Path(__file__).with_name("csrc") / "levels" / "level_table.h"


def machine_name(machine: str = "") -> str:
    """The table's name of an architecture (platform.machine() by default): x86_64, aarch64 or "*" (any other)."""
    machine = machine or platform.machine()
    machine = MACHINE_ALIASES.get(machine.lower(), machine)
    return machine if machine in MACHINE_MACROS else "*"


def machine_levels(machine: str = "") -> Tuple[Level, ...]:
    """An architecture's levels, lowest first."""
    key = machine_name(machine)
    return tuple(level for level in LEVELS if key in level.machines)


def by_name(name: str) -> Level:
    for level in LEVELS:
        if level.name == name:
            return level
    raise ValueError(f"no instruction-set level named {name!r} (one of {', '.join(ALL_NAMES)})")


def compile_flags(level: Level) -> list:
    """The flags that compile the level's object: its namespace (torch's CPU_CAPABILITY), torch's vector-width
    macro, RFA_LEVEL (its enumerator), its further macros and its instructions."""
    return [f"-DCPU_CAPABILITY={level.namespace}", *([f"-DCPU_CAPABILITY_{level.torch_vec}"] if level.torch_vec else []),
            f"-DRFA_LEVEL={level.enumerator}", *(f"-D{define}" for define in level.defines), *level.flags]


def onednn_isa(name: str) -> Optional[str]:
    """ONEDNN_MAX_CPU_ISA's value for a level (None: no cap there)."""
    return by_name(name).onednn


def cpuinfo_flags(level: Level) -> Tuple[str, ...]:
    """The /proc/cpuinfo flags (x86: "flags", aarch64: "Features") a CPU that runs the level lists."""
    return tuple(CPUINFO_FLAG.get(feature, feature) for feature in level.cpu_features)


def _runs_expression(level: Level, machine: str) -> str:
    if not level.cpu_features:
        return "true"
    if machine == "x86_64":
        return " && ".join(f'__builtin_cpu_supports("{feature}")' for feature in level.cpu_features)
    if machine == "aarch64":
        return " && ".join(f"hwcap_has(1ul << {HWCAP_BIT[feature]})" for feature in level.cpu_features)
    raise ValueError(f"{level.name}: no way to ask a {machine} CPU for {level.cpu_features}")


def header_text() -> str:
    """csrc/levels/level_table.h: the enum and each architecture's levels as X-macros."""
    lines = ["// Written by `python rfa_fairseq/cpu/levels.py` from its table (LEVELS): edit that table, not this file.",
             "// tests/test_cpu_levels.py checks that this file is current.", "#pragma once", "",
             "namespace rfa::cpu {", "",
             "enum class Level : int { " + ", ".join(f"{lv.enumerator} = {i}" for i, lv in enumerate(LEVELS)) + " };",
             "", "}  // namespace rfa::cpu", "",
             "// X(enumerator, name): every level, in the enum's order",
             "#define RFA_ALL_LEVELS(X) " + " ".join(f'X({lv.enumerator}, "{lv.name}")' for lv in LEVELS), "",
             "// X(enumerator, namespace, whether this CPU runs it): this build's architecture's levels, lowest first",
             "// (hwcap_has: cpu_level.cpp's test of a getauxval(AT_HWCAP) bit)"]
    branches = [(f"defined({macro})", machine) for machine, macro in MACHINE_MACROS.items()]
    for i, (condition, machine) in enumerate([*branches, (None, "*")]):
        lines.append(f"#{'if' if i == 0 else 'elif'} {condition}" if condition else "#else")
        entries = [f"X({lv.enumerator}, {lv.namespace}, {_runs_expression(lv, machine)})"
                   for lv in machine_levels(machine)]
        lines.append("#define RFA_ARCHITECTURE_LEVELS(X) \\")
        lines.extend("  " + entry + (" \\" if j < len(entries) - 1 else "") for j, entry in enumerate(entries))
    lines.append("#endif")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    if sys.argv[1:] not in ([], ["--check"]):
        sys.exit("usage: python rfa_fairseq/cpu/levels.py [--check]   (writes, or checks, csrc/levels/level_table.h)")
    if sys.argv[1:] == ["--check"]:
        current = HEADER.read_text() if HEADER.exists() else ""
        if current != header_text():
            sys.exit(f"{HEADER} is not the table's: run python rfa_fairseq/cpu/levels.py")
    else:
        HEADER.write_text(header_text())
        print(f"wrote {HEADER}")
