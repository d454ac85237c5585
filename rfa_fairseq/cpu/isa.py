"""The CPU kernels' instruction-set level outside the C++ module (which picks it: csrc/cpu_kernels.h): oneDNN's GEMMs
capped to match a runtime capped below the CPU's best (--rfa-cpu-isa), and the machine's name (the few-rows limits
are measured per machine, cpu/few_rows_limits.py).

oneDNN reads its cap, the ONEDNN_MAX_CPU_ISA environment variable, once, when the process creates its first
primitive: `cap_onednn_isa` sets it before the plugin's first packed weight (which in fairseq-generate,
fairseq-interactive and hub.translate comes before any other oneDNN work) unless the environment already names one.
A later runtime with another cap in the same process cannot move it (a warning says so). torch's own CPU operators
read their level (ATEN_CPU_CAPABILITY) at their first call, before any option is known: the benchmarks set it in the
environment of the processes they cap (benchmarks/benchmark_generate.py --cpu-isa).
"""
import functools
import logging
import os
import platform
import warnings
from typing import Optional

from .levels import LEVELS

ONEDNN_ENV = "ONEDNN_MAX_CPU_ISA"
# oneDNN's name of the highest ISA each level allows, where it has one (cpu/levels.py)
ONEDNN_ISA = {level.name: level.onednn for level in LEVELS if level.onednn is not None}

logger = logging.getLogger(__name__)

_first_level: Optional[str] = None  # the level of the process's first native runtime: oneDNN's cap follows it


def note_runtime_level(level: str, capped: bool) -> None:
    """A native runtime runs on `level` (capped: below the CPU's best): the first one in the process caps oneDNN to
    match where it is capped; a later one on another capped level is warned about (oneDNN's cap is already fixed)."""
    global _first_level
    if _first_level is None:
        _first_level = level
        if capped:
            cap_onednn_isa(level)
    elif capped and level != _first_level:
        warnings.warn(f"rfa_fairseq: --rfa-cpu-isa {level}: oneDNN's products keep the instruction set the process's "
                      f"first runtime fixed ({_first_level}); set {ONEDNN_ENV} before the process starts to cap them")


def cap_onednn_isa(level: str) -> None:
    """Set ONEDNN_MAX_CPU_ISA to `level`'s oneDNN name, unless the environment names one already (kept)."""
    name = ONEDNN_ISA.get(level)
    if name is None:
        return
    given = os.environ.get(ONEDNN_ENV)
    if given is not None:
        if given.upper() != name:
            logger.info("rfa_fairseq: --rfa-cpu-isa %s: oneDNN keeps %s=%s from the environment", level, ONEDNN_ENV,
                        given)
        return
    os.environ[ONEDNN_ENV] = name
    logger.info("rfa_fairseq: --rfa-cpu-isa %s: oneDNN's products capped at %s (%s)", level, name, ONEDNN_ENV)


@functools.lru_cache(maxsize=None)
def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo's), else the platform's: what the few-rows limits are recorded for."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as cpuinfo:
            fields = dict(line.split(":", 1) for line in cpuinfo if ":" in line)
    except OSError:
        fields = {}
    fields = {key.strip(): value.strip() for key, value in fields.items()}
    # x86: "model name"; aarch64: the implementer and part numbers name the core
    name = fields.get("model name") or " ".join(
        f"{key} {fields[key]}" for key in ("CPU implementer", "CPU part", "CPU variant") if key in fields)
    # x86 model names are often a family's ("AMD EPYC"): its family, model and stepping tell the generation
    version = " ".join(f"{key.split()[-1]} {fields[key]}" for key in ("cpu family", "model", "stepping") if key in fields)
    return f"{platform.machine()} {name or platform.processor() or 'unknown CPU'}" + (f" ({version})" if version else "")
