"""The CPU kernels' instruction-set levels (cpu/csrc/cpu_kernels.h, levels/level_kernels.cpp): each level this CPU runs
against the references (its few-rows products against oneDNN's on the same weights and codes; its exp against
float64), the one choice of a level (--rfa-cpu-isa), the library's choice between its kernels by the measured
few-rows limits (cpu/few_rows_limits.py) and their record, the level objects' symbols (nothing of a level's
instructions reachable from another), and the build for aarch64 with Debian's cross compiler. The decoding step's
kernels at every level: tests/test_decoding_step.py and tests/test_ops.py (their cpu_level_params)."""
import dataclasses
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import sysconfig
import time

import pytest
import torch
from conftest import REPO
from helpers import cpp_extension, cpu_level_params

from rfa_fairseq import torch_internals
from rfa_fairseq.cpu import extension, few_rows_limits
from rfa_fairseq.cpu import levels as cpu_levels
from rfa_fairseq.cpu.native import OneDNNInt8Linear, OneDNNLinear

PRECISIONS = {"fp32": (OneDNNLinear, "onednn"), "int8": (OneDNNInt8Linear, "onednn_int8")}
AARCH64_CXX = "aarch64-linux-gnu-g++"


@pytest.fixture(scope="module")
def ext():
    return cpp_extension()


def _library(ext, precision, level):
    available = torch_internals.onednn_int8_linear_available() if precision == "int8" else \
        torch_internals.onednn_linear_available()
    if not available:
        pytest.skip(f"torch {torch.__version__} has no oneDNN {precision} linear ops: nothing to compare with")
    packer, code = PRECISIONS[precision]
    library = ext.LinearLibrary(code, torch_internals.onednn_operators(), level)
    assert library.level == level
    return packer(library), library


def _few_rows(library, precision, packed, x, relu, residual):
    """The level's few-rows kernel itself on `packed`'s blocks."""
    y = torch.full((x.size(0), packed.out_features), float("nan"))
    if precision == "fp32":
        library.few_rows_fp32(packed, x, residual, relu, y)
    else:
        codes, row_scales = torch.empty(x.shape, dtype=torch.uint8), torch.empty(x.size(0))
        cpp_extension().quantize_rows(x, codes, row_scales, library.level)
        library.few_rows_int8(packed, codes, row_scales, residual, relu, y)
    return y


def _onednn(library, packed, x, relu, residual):
    """oneDNN's product on the packed layer (the library's other path: its few-rows limit 0)."""
    library.set_few_rows_limit(packed.in_features, packed.out_features, 0)
    return library.linear(packed, x, relu, residual)


# inputs not a multiple of 4 (int8: a last partial group of codes) and past one fp32 chunk of 512, outputs not a
# multiple of any vector width (masked lanes, a ragged last tile), rows past a tile of 4
@pytest.mark.parametrize("level", cpu_level_params())
@pytest.mark.parametrize("precision", ["fp32", "int8"])
@pytest.mark.parametrize("in_features,out_features", [(256, 516), (13, 7), (258, 50), (1030, 131)])
@pytest.mark.parametrize("rows", [1, 3, 4, 6, 9])
def test_few_rows_kernel_matches_onednn(ext, level, precision, in_features, out_features, rows):
    packer, library = _library(ext, precision, level)
    torch.manual_seed(in_features * 1000 + out_features + rows)
    weight, bias = torch.randn(out_features, in_features) * 0.1, torch.randn(out_features)
    x, residual = torch.randn(rows, in_features) * 3, torch.randn(rows, out_features)
    for relu, res, b in [(False, None, bias), (True, None, bias), (False, residual, bias), (True, residual, None)]:
        packed = packer.pack_linear(weight, b)
        assert packed.rows_weight.shape[-1 if precision == "fp32" else -2] == library.block
        # int8: the same exact int32 sums and epilogue; fp32: the sums in about oneDNN's order. A few ulps of the terms
        # apart (a wrong weight, lane or row is off by the terms themselves)
        torch.testing.assert_close(_few_rows(library, precision, packed, x, relu, res),
                                   _onednn(library, packed, x, relu, res), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("level", cpu_level_params())
def test_int8_products_are_exact_where_7_bit_codes_meet_the_largest_weights(ext, level):
    """The u8 x s8 multiply-adds (AVX2 / AVX-512 vpmaddubsw sums pairs in int16; NEON vmull; VNNI vpdpbusd) on the
    extreme codes: every code 127 against weights of +-127 in every position, the largest pair sums (2 x 127 x 127)
    that an int16 must hold. The few-rows result equals the exact int64 products scaled."""
    packer, library = _library(ext, "int8", level)
    I, O = 260, 40
    weight = torch.full((O, I), 1.0)
    weight[::2] = -1.0  # codes -127 / 127 after the per-channel scale (1 / 127)
    x = torch.full((5, I), 7.0)  # every activation code 127 (the row's maximum)
    packed = packer.pack_linear(weight, None)
    got = _few_rows(library, "int8", packed, x, False, None)
    want = (x @ weight.T)  # codes and scales reconstruct x and the weights exactly
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-3)


@pytest.mark.parametrize("level", cpu_level_params())
def test_the_library_takes_the_few_rows_kernel_up_to_its_limit_only(ext, level):
    """The library's pick by rows (linear_layers.cpp's LinearLibrary::few_rows, the measured limit): zeroed few-rows
    blocks change the output at or below the limit (the kernel runs) and not above it (oneDNN runs), nor without a
    limit."""
    packer, library = _library(ext, "fp32", level)
    torch.manual_seed(0)
    packed = packer.pack_linear(torch.randn(96, 64) * 0.1, torch.randn(96))
    plain = _onednn(library, packed, torch.randn(1, 64), False, None)  # sets the limit to 0
    assert plain.shape == (1, 96)
    zeroed = dataclasses.replace(packed, rows_weight=torch.zeros_like(packed.rows_weight))
    few, many = torch.randn(8, 64), torch.randn(9, 64)
    library.set_few_rows_limit(64, 96, 8)
    assert library.few_rows_limit(64, 96) == 8
    assert not torch.allclose(library.linear(zeroed, few), library.linear(packed, few))
    torch.testing.assert_close(library.linear(zeroed, many), library.linear(packed, many), rtol=0, atol=0)
    fresh = ext.LinearLibrary("onednn", torch_internals.onednn_operators(), level)
    assert fresh.few_rows_limit(64, 96) is None
    torch.testing.assert_close(fresh.linear(zeroed, few), _onednn(library, packed, few, False, None), rtol=0, atol=0)


def test_the_kernels_reject_blocks_of_another_shape_or_level(ext):
    packer, library = _library(ext, "int8", ext.select_cpu_level("auto"))
    x, y = torch.zeros(4, 64), torch.empty(4, 32)
    fp32 = OneDNNLinear(ext.LinearLibrary("onednn", torch_internals.onednn_operators(), library.level))
    wrong_inputs = fp32.pack_linear(torch.zeros(32, 60), None)
    with pytest.raises(RuntimeError, match="level's blocks \\(pack_fp32\\) for 64 inputs and 32 outputs"):
        fp32.native.few_rows_fp32(dataclasses.replace(wrong_inputs, in_features=64), x, None, False, y)
    packed = packer.pack_linear(torch.zeros(32, 60), None)  # blocks for 60 inputs, not 64
    with pytest.raises(RuntimeError, match="level's blocks \\(pack_int8\\) for 64 inputs"):
        library.few_rows_int8(packed, torch.zeros(4, 64, dtype=torch.uint8), torch.ones(4), None, False, y)
    others = [level for level in ext.runnable_cpu_levels() if ext.LinearLibrary(
        "onednn", torch_internals.onednn_operators(), level).block != library.block]
    if others:  # blocks of another vector width: refused, not misread
        other = ext.LinearLibrary("onednn", torch_internals.onednn_operators(), others[0])
        with pytest.raises(RuntimeError, match=f"the {others[0]} level's blocks"):
            other.few_rows_fp32(fp32.pack_linear(torch.zeros(32, 64), None), x, None, False, y)


@pytest.mark.parametrize("level", cpu_level_params())
def test_the_exp_polynomial_is_within_two_ulps_of_float64(ext, level):
    x = torch.cat([torch.linspace(-87, 0, 100_003), torch.tensor([-100.0, -88.0, 0.0, 1e-30])])
    got = ext.exp(x, level).double()
    want = x.double().exp()
    ulp = torch.finfo(torch.float32).eps * want.abs()
    normal = want > torch.finfo(torch.float32).tiny
    assert ((got - want).abs()[normal] <= 2 * ulp[normal]).all()
    below = got[~normal]  # clamped far below zero: tiny and not negative (nor NaN), not garbage
    assert ((below >= 0) & (below <= 2 * torch.finfo(torch.float32).tiny)).all(), below


# ---------------------------------------------------------------------------------------------- the level's choice


def test_one_place_chooses_the_level_and_a_cap_caps_it(ext):
    levels, runnable = ext.cpu_levels(), ext.runnable_cpu_levels()
    assert runnable and runnable == [level for level in levels if level in runnable] and runnable[0] == levels[0]
    assert ext.select_cpu_level("auto") == runnable[-1]
    for i, cap in enumerate(levels):  # a cap: the best level at or below it that this CPU runs
        assert ext.select_cpu_level(cap) == [level for level in levels[: i + 1] if level in runnable][-1]
    foreign = "neon" if "avx2" in levels else "avx2"
    with pytest.raises(ValueError, match=f"'{foreign}' is not an instruction-set level of this architecture"):
        ext.select_cpu_level(foreign)
    with pytest.raises(ValueError, match="--rfa-cpu-isa: .*'bogus'"):
        ext.LinearLibrary("onednn", torch_internals.onednn_operators(), "bogus")
    missing = [level for level in levels if level not in runnable]
    if missing:
        with pytest.raises(ValueError, match=f"this CPU does not run the '{missing[0]}' level"):
            ext.row_log_sum_exp(torch.zeros(1, 8), missing[0])


def test_the_decoding_option_names_every_architectures_levels(ext):
    from rfa_fairseq.cpu.isa import ONEDNN_ISA
    from rfa_fairseq.kernel_choice import CPU_ISAS

    assert CPU_ISAS == ("auto", *cpu_levels.ALL_NAMES) and set(ext.cpu_levels()) <= set(CPU_ISAS)
    assert list(extension.machine_levels()) == ext.cpu_levels()  # the build's levels are the module's, in order
    assert set(ONEDNN_ISA) == {"default", "avx2", "avx512", "avx512_vnni", "neon"}  # neon_dotprod: no oneDNN cap
    assert ONEDNN_ISA["default"] == "SSE41"  # oneDNN's lowest: "default" (SSE2) caps it there


def test_the_level_header_is_the_tables():
    """csrc/levels/level_table.h is what cpu/levels.py writes from its table (python rfa_fairseq/cpu/levels.py)."""
    assert cpu_levels.HEADER.read_text() == cpu_levels.header_text(), \
        "csrc/levels/level_table.h is stale: run python rfa_fairseq/cpu/levels.py"
    for level in cpu_levels.LEVELS:  # each object's flags name its namespace and enumerator
        flags = cpu_levels.compile_flags(level)
        assert f"-DCPU_CAPABILITY={level.namespace}" in flags and f"-DRFA_LEVEL={level.enumerator}" in flags
        assert f"X({level.enumerator}, \"{level.name}\")" in cpu_levels.HEADER.read_text()


def _cpuinfo_flags():
    """The Linux kernel's CPU flags (/proc/cpuinfo: x86 "flags", aarch64 "Features"), or None where it lists none
    of this architecture's (another OS; qemu's user-mode emulation shows the host's)."""
    try:
        text = open("/proc/cpuinfo", encoding="utf-8", errors="replace").read()
    except OSError:
        return None
    field = {"x86_64": "flags", "aarch64": "Features"}.get(cpu_levels.machine_name())
    lines = [line.split(":", 1)[1].split() for line in text.splitlines()
             if field and line.split(":", 1)[0].strip() == field and ":" in line]
    return set(lines[0]) if lines else None


def test_the_levels_this_cpu_runs_are_those_its_kernel_flags_allow(ext):
    """The module's answer (cpu_runs: __builtin_cpu_supports / getauxval) against the Linux kernel's own flags: a
    broken detection would turn every test of a level into a skip with a reasonable-sounding reason."""
    flags = _cpuinfo_flags()
    if flags is None:
        pytest.skip(f"/proc/cpuinfo lists no {cpu_levels.machine_name()} CPU flags here (another OS, or an emulator "
                    "that shows the host's)")
    expected = [level.name for level in cpu_levels.machine_levels() if set(cpu_levels.cpuinfo_flags(level)) <= flags]
    assert ext.runnable_cpu_levels() == expected, (ext.runnable_cpu_levels(), expected)


# ---------------------------------------------------------------------------------------------- the few-rows limits


class ScriptedLibrary:
    """time_products from a table of (few-rows us, oneDNN us) per rows; counts the calls; records the limit set."""

    level = "avx2"
    build_hash = "0123456789abcdef0123"  # the kernels' build (a real library's module has one)

    def __init__(self, times):
        self.times, self.calls, self.limits = times, [], {}

    def time_products(self, packed, rows, repeats):
        self.calls.append(rows)
        value = self.times[rows]
        return value.pop(0) if isinstance(value, list) else value

    def set_few_rows_limit(self, in_features, out_features, rows):
        self.limits[(in_features, out_features)] = rows


PACKED = dataclasses.make_dataclass("Packed", [("in_features", int), ("out_features", int)])


def test_the_limit_is_the_last_count_won_before_the_first_confirmed_loss():
    times = {1: (1, 3), 4: (2, 3), 8: [(4, 3), (2.5, 3)], 16: [(9, 6), (8, 6)], 32: (1, 99), 64: (1, 99)}
    library = ScriptedLibrary(times)
    # 8: a loss not confirmed by the second timing (the best of both counts: 2.5 < 3); 16: confirmed; 32 never timed
    assert few_rows_limits.measure_limit(library, PACKED(4, 4), rows=(1, 4, 8, 16, 32, 64)) == 8
    assert library.calls == [1, 4, 8, 8, 16, 16]
    assert few_rows_limits.measure_limit(ScriptedLibrary({1: [(5, 1), (5, 1)]}), PACKED(4, 4), rows=(1, 4)) == 0
    assert few_rows_limits.measure_limit(ScriptedLibrary({1: (1, 2), 4: (1, 2)}), PACKED(4, 4), rows=(1, 4)) == 4


def test_limits_are_measured_once_per_machine_and_read_back(tmp_path, monkeypatch):
    monkeypatch.setenv(few_rows_limits.CACHE_ENV, str(tmp_path))
    few_rows_limits.forget_known()
    library = ScriptedLibrary({rows: (1, 2) for rows in few_rows_limits.MEASURED_ROWS})
    assert few_rows_limits.ensure_limit(library, "onednn", PACKED(8, 12)) == few_rows_limits.MEASURED_ROWS[-1]
    assert library.limits == {(8, 12): few_rows_limits.MEASURED_ROWS[-1]}
    record = json.loads((tmp_path / few_rows_limits.RECORD_NAME).read_text())
    (key, value), = record.items()
    assert key.endswith("| avx2 | onednn (oneDNN ISA %s) | kernels 0123456789abcdef | torch %s | 8x12"
                        % (os.environ.get("ONEDNN_MAX_CPU_ISA") or "the CPU's", torch.__version__)) and value == 256
    # another build of the kernels (a later release): its own limits, measured again
    rebuilt = ScriptedLibrary({rows: (3, 2) for rows in few_rows_limits.MEASURED_ROWS})
    rebuilt.build_hash = "fedcba9876543210"
    assert few_rows_limits.ensure_limit(rebuilt, "onednn", PACKED(8, 12)) == 0 and rebuilt.calls
    few_rows_limits.forget_known()
    (tmp_path / few_rows_limits.RECORD_NAME).write_text(json.dumps({key: value}))
    # another process (this one's limits forgotten): read from the record, nothing timed
    few_rows_limits.forget_known()
    again = ScriptedLibrary({})
    assert few_rows_limits.ensure_limit(again, "onednn", PACKED(8, 12)) == 256 and again.calls == []
    # a damaged record: measured again, then replaced whole
    (tmp_path / few_rows_limits.RECORD_NAME).write_text("{not json")
    few_rows_limits.forget_known()
    third = ScriptedLibrary({rows: (3, 2) for rows in few_rows_limits.MEASURED_ROWS})
    assert few_rows_limits.ensure_limit(third, "onednn", PACKED(8, 12)) == 0
    assert json.loads((tmp_path / few_rows_limits.RECORD_NAME).read_text()) == {key: 0}
    few_rows_limits.forget_known()


def test_an_unwritable_record_still_measures_and_says_so(tmp_path, monkeypatch, caplog):
    blocked = tmp_path / "file"
    blocked.write_text("")
    monkeypatch.setenv(few_rows_limits.CACHE_ENV, str(blocked / "below"))  # a directory under a file: no record
    monkeypatch.setattr(few_rows_limits, "_unwritable_logged", False)
    few_rows_limits.forget_known()
    library = ScriptedLibrary({rows: (1, 2) for rows in few_rows_limits.MEASURED_ROWS})
    with caplog.at_level("WARNING"):
        assert few_rows_limits.ensure_limit(library, "onednn", PACKED(8, 12)) == 256
    assert "cannot be used" in caplog.text and few_rows_limits.CACHE_ENV in caplog.text
    few_rows_limits.forget_known()


def test_a_real_library_measures_a_limit_within_the_measured_counts(ext, tmp_path, monkeypatch):
    monkeypatch.setenv(few_rows_limits.CACHE_ENV, str(tmp_path))
    few_rows_limits.forget_known()
    packer, library = _library(ext, "int8", ext.select_cpu_level("auto"))
    packed = packer.pack_linear(torch.randn(64, 48), None)
    limit = few_rows_limits.ensure_limit(library, "onednn_int8", packed)
    assert limit in (0, *few_rows_limits.MEASURED_ROWS) and library.few_rows_limit(48, 64) == limit
    assert [key for key in few_rows_limits.known_limits() if f"| kernels {ext.build_hash[:16]} |" in key]
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # time_products times on one thread, then gives the caller its teams back
    try:
        few, other = library.time_products(packed, 4, 2)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
    assert few > 0 and other > 0
    few_rows_limits.forget_known()


MEASURING_PROCESS = """
import sys
sys.path.insert(0, sys.argv[1])
from rfa_fairseq.cpu import few_rows_limits

class Logged:  # each count it times, logged
    level = "avx2"
    build_hash = "0123456789abcdef"
    def time_products(self, packed, rows, repeats):
        with open(sys.argv[2], "a") as log:
            log.write(f"{rows}\\n")
        return (1.0, 2.0)
    def set_few_rows_limit(self, *args):
        pass

class Packed:
    in_features, out_features = 3, 5

print(few_rows_limits.ensure_limit(Logged(), "onednn", Packed()))
"""


def _lock_waiters(path):
    """The processes blocked on an flock of `path` (the kernel's /proc/locks: a waiter's line has "->")."""
    inode = os.stat(path).st_ino
    with open("/proc/locks") as locks:
        return [line for line in locks if "->" in line and line.split()[-3].endswith(f":{inode}")]


def test_processes_started_together_share_one_measurement(tmp_path):
    """Writers take the record's lock: of two processes that need the same shape at once, one measures and the other
    reads its limit. Both are made to overlap: the test holds the record's lock until both wait on it (the kernel
    lists them as its waiters); without the lock, they would measure at once (the test fails on the first count
    either logs while it holds the lock)."""
    if not os.path.exists("/proc/locks"):
        pytest.skip("no /proc/locks (not Linux): the test cannot see the processes wait on the record's lock")
    log, cache = tmp_path / "timed.txt", tmp_path / "cache"
    log.touch()
    env = {**os.environ, few_rows_limits.CACHE_ENV: str(cache)}
    record = cache / few_rows_limits.RECORD_NAME
    cache.mkdir()
    procs = []
    try:
        with few_rows_limits._record_lock(record):
            procs = [subprocess.Popen([sys.executable, "-c", MEASURING_PROCESS, REPO, str(log)], env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
            while len(_lock_waiters(str(record) + ".lock")) < 2:
                assert log.read_text() == "", "a process measured while another held the record's lock"
                assert all(proc.poll() is None for proc in procs), [proc.communicate()[1][-2000:] for proc in procs]
                time.sleep(0.02)
        outputs = [proc.communicate(timeout=120) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert [proc.returncode for proc in procs] == [0, 0], [err[-2000:] for _, err in outputs]
    assert [out.strip().splitlines()[-1] for out, _ in outputs] == ["256", "256"]
    assert log.read_text().split() == [str(rows) for rows in few_rows_limits.MEASURED_ROWS]  # measured once


# ---------------------------------------------------------------------------------------------- the builds


@pytest.mark.slow
def test_level_objects_define_nothing_outside_their_level_and_initialize_without_its_instructions(tmp_path):
    """Each level's object (the same source, the level's instructions): every function it defines is in its level's
    namespace (an inline function of a header compiled with AVX-512 and picked by the linker for another level's
    callers would crash a CPU without it), and its static initializers, which run on every CPU at load, use no vector
    register wider than the baseline's."""
    if platform.machine() != "x86_64":
        pytest.skip(f"the x86-64 levels' instruction check reads x86 registers; this machine is {platform.machine()}")
    if shutil.which("nm") is None or shutil.which("objdump") is None:
        pytest.skip("binutils (nm, objdump) are not installed")
    objects = extension.compile_level_objects(tmp_path, **extension.torch_level_build_args())
    assert [p.stem for p in objects] == list(extension.machine_levels())
    for obj in objects:
        symbols = subprocess.run(["nm", "-C", "--defined-only", str(obj)], capture_output=True, text=True,
                                 check=True).stdout.splitlines()
        exported = [line for line in symbols if re.match(r"\S+ [TWVuDB] ", line)]
        outside = [line for line in exported if f"rfa::cpu::{_namespace(obj.stem)}::" not in line
                   and "DW.ref.__gxx_personality_v0" not in line]
        assert not outside, f"{obj.name} defines symbols outside its level: {outside[:5]}"
        startup = subprocess.run(["objdump", "-d", "--no-show-raw-insn", "-j", ".text.startup", str(obj)],
                                 capture_output=True, text=True).stdout
        assert not re.search(r"%[yz]mm", startup), f"{obj.name}'s static initializers use AVX registers"
        _assert_level_instructions(obj.stem, subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(obj)],
                                                            capture_output=True, text=True, check=True).stdout)
    again = extension.compile_level_objects(tmp_path, **extension.torch_level_build_args())
    assert [p.stat().st_mtime_ns for p in again] == [p.stat().st_mtime_ns for p in objects]  # nothing compiled twice


# what each x86 level's object must hold and must not: a level built without its instructions (a VNNI level without
# vpdpbusd) would pass every comparison, and one that leaks a higher level's would crash a CPU below it
_AVX512_REGISTERS = r"%zmm|%k[0-7]\b|%[xy]mm(1[6-9]|2[0-9]|3[01])\b"  # only EVEX (AVX-512) encodes these
X86_INSTRUCTIONS = {
    "default": {"forbidden": r"%ymm|%zmm|\bvfmadd"},  # SSE2: no AVX register, no FMA
    "avx2": {"required": r"\bvfmadd\w*\s+%ymm", "forbidden": _AVX512_REGISTERS},
    "avx512": {"required": r"%zmm", "forbidden": r"\bvpdpbusd"},
    "avx512_vnni": {"required": r"\bvpdpbusd\s+[^\n]*%zmm"},
}


def _assert_level_instructions(level, code):
    rules = X86_INSTRUCTIONS[level]
    if "required" in rules:
        assert re.search(rules["required"], code), f"{level}.o lacks its level's instructions ({rules['required']})"
    if "forbidden" in rules:
        found = re.search(rules["forbidden"], code)
        assert found is None, f"{level}.o uses an instruction above its level: {found and found.group(0)}"


def _namespace(level):
    return cpu_levels.by_name(level).namespace


@pytest.mark.slow
def test_the_sources_compile_for_aarch64(tmp_path):
    """Every source compiles for aarch64 (Debian's g++-aarch64-linux-gnu against this torch's headers; installed by
    the test set-up, scripts/run_tests.sh), each file on its own (a missing #include in one is not hidden by
    another's, and the failing file is named): the levels into objects (neon_dotprod's int8 products with sdot,
    neon's without, read by aarch64-linux-gnu-objdump where binutils-aarch64-linux-gnu is installed), the module's
    sources through the compiler's front end. tests/test_aarch64_emulated.py runs them."""
    if shutil.which(AARCH64_CXX) is None:
        pytest.skip(f"{AARCH64_CXX} is not installed (scripts/run_tests.sh installs it with apt-get where it can: "
                    f"Debian's g++-aarch64-linux-gnu)")
    args = extension.torch_level_build_args()
    objdump = shutil.which("aarch64-linux-gnu-objdump")
    for level in extension.machine_levels("aarch64"):
        obj = tmp_path / f"{level}.o"
        command = extension.level_compile_command(AARCH64_CXX, level, args["include_dirs"], args["abi_flag"], obj,
                                                  machine="aarch64")
        proc = subprocess.run(command, capture_output=True, text=True)
        assert proc.returncode == 0, f"{level}: {proc.stderr[-3000:]}"
        if objdump is not None:
            code = subprocess.run([objdump, "-d", str(obj)], capture_output=True, text=True, check=True).stdout
            assert ("sdot" in code) == (level == "neon_dotprod"), f"{level}: sdot {'missing' if level == 'neon_dotprod' else 'used'}"
    flags = [*extension.compile_flags(torch.__version__), extension.LEVEL_STD, "-DTORCH_EXTENSION_NAME=rfa_check",
             "-DTORCH_API_INCLUDE_EXTENSION_H", args["abi_flag"], *(f"-I{d}" for d in args["include_dirs"]),
             f"-I{sysconfig.get_paths()['include']}"]
    failed = {}
    for source in extension.source_files():  # each file its own translation unit
        proc = subprocess.run([AARCH64_CXX, *flags, "-fsyntax-only", str(source)], capture_output=True, text=True)
        if proc.returncode != 0:
            failed[source.name] = proc.stderr[-1500:]
    assert not failed, f"sources that do not compile for aarch64: {', '.join(failed)}\n" + "\n".join(failed.values())
    if objdump is None:
        pytest.skip("aarch64-linux-gnu-objdump is not installed (Debian's binutils-aarch64-linux-gnu): every source "
                    "compiled, the sdot check of the neon_dotprod object was not made")


# ---------------------------------------------------------------------------------------------- a capped decode


def test_note_runtime_level_caps_onednn_once_and_keeps_a_given_cap(monkeypatch):
    """cpu/isa.py: the process's first capped runtime sets ONEDNN_MAX_CPU_ISA to its level's oneDNN name (the
    table's); an uncapped first runtime sets nothing; the environment's own value is kept; a later runtime on another
    capped level is warned about."""
    from rfa_fairseq.cpu import isa

    monkeypatch.delenv(isa.ONEDNN_ENV, raising=False)
    monkeypatch.setattr(isa, "_first_level", None)
    isa.note_runtime_level("avx512_vnni", capped=False)
    assert isa.ONEDNN_ENV not in os.environ
    monkeypatch.setattr(isa, "_first_level", None)
    isa.note_runtime_level("avx2", capped=True)
    assert os.environ[isa.ONEDNN_ENV] == cpu_levels.by_name("avx2").onednn == "AVX2"
    with pytest.warns(UserWarning, match="--rfa-cpu-isa default: oneDNN's products keep the instruction set"):
        isa.note_runtime_level("default", capped=True)
    assert os.environ[isa.ONEDNN_ENV] == "AVX2"
    monkeypatch.setenv(isa.ONEDNN_ENV, "AVX512_CORE")
    isa.cap_onednn_isa("avx2")  # the user's own cap stays
    assert os.environ[isa.ONEDNN_ENV] == "AVX512_CORE"
    isa.cap_onednn_isa("neon_dotprod")  # no oneDNN cap at the top aarch64 level
    assert os.environ[isa.ONEDNN_ENV] == "AVX512_CORE"


@pytest.mark.slow
def test_generate_capped_at_avx2_gives_the_uncapped_hypotheses(ext, tmp_path_factory):
    """fairseq-generate --model-overrides "{'rfa_cpu_isa': 'avx2'}" on a CPU above AVX2: the runtime's kernels on
    avx2 and oneDNN capped to AVX2 (its log line), the same hypotheses as the uncapped run's and their scores within
    the order-of-sums tolerance (the levels' vectors sum fp32 in other orders)."""
    from cli_support import run, synthetic_data, train_generate_model
    from conftest import PLUGIN_DIR

    best = ext.select_cpu_level("auto")
    if os.environ.get("ONEDNN_MAX_CPU_ISA"):
        pytest.skip("ONEDNN_MAX_CPU_ISA is set in the environment: oneDNN keeps it")
    if cpu_levels.machine_name() != "x86_64" or best in ("default", "avx2"):
        pytest.skip(f"needs an x86-64 CPU above AVX2 (this one's best level: {best})")
    data = synthetic_data(tmp_path_factory, train=600, test=24)
    checkpoint = train_generate_model(data, tmp_path_factory.mktemp("capped_model"), max_update=30)
    outputs = {}
    for cap in ("auto", "avx2"):
        proc = run("fairseq-generate", data / "bin", "--user-dir", PLUGIN_DIR, "--path", checkpoint, "--gen-subset",
                   "test", "--beam", "4", "--batch-size", "8", "--required-batch-size-multiple", "1", "--cpu",
                   "--model-overrides", repr({"rfa_cpu_isa": cap, "rfa_decode_state": "fp32"}))
        log = proc.stdout + proc.stderr
        assert ("oneDNN's products capped at AVX2 (ONEDNN_MAX_CPU_ISA)" in log) == (cap == "avx2"), log[-3000:]
        hypotheses = {}
        for line in proc.stdout.splitlines():
            if line.startswith("H-"):
                key, score, text = line.split("\t")
                hypotheses[int(key[2:])] = (float(score), text)
        outputs[cap] = hypotheses
    assert len(outputs["avx2"]) == 24 and outputs["avx2"].keys() == outputs["auto"].keys()
    same = [i for i in outputs["auto"] if outputs["auto"][i][1] == outputs["avx2"][i][1]]
    assert len(same) == len(outputs["auto"]), [i for i in outputs["auto"] if i not in same]
    for i in same:
        assert abs(outputs["auto"][i][0] - outputs["avx2"][i][0]) <= 1e-3, (i, outputs["auto"][i], outputs["avx2"][i])
