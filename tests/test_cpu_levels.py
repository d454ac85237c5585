"""The CPU kernels' instruction-set levels (cpu/csrc/cpu_kernels.h, levels/level_kernels.cpp): each level this CPU runs
against the references (its linear products against float64 products of the same weights (fp32) and exact integer
products of the same codes (int8), a row's result the same whatever rows surround it; its exp against float64), the
weights packed once and their file pages given back, the one choice of a level (--rfa-cpu-isa), the level objects'
symbols (nothing of a level's instructions reachable from another), and the build for aarch64 with Debian's cross
compiler. The decoding step's kernels at every level: tests/test_decoding_step.py and tests/test_ops.py (their
cpu_level_params)."""
import os
import platform
import re
import shutil
import subprocess
import sysconfig

import pytest
import torch
from helpers import cpp_extension, cpu_level_params, resident_pages

from rfa_fairseq.cpu import extension
from rfa_fairseq.cpu import levels as cpu_levels
from rfa_fairseq.cpu.native import NativeKernels
from rfa_fairseq.file_mappings import FileMappings

AARCH64_CXX = "aarch64-linux-gnu-g++"


@pytest.fixture(scope="module")
def ext():
    return cpp_extension()


def _kernels(ext, precision, level):
    kernels = NativeKernels(ext, precision, torch.float32, level)
    assert kernels.level == level and kernels.library.precision == precision
    return kernels


def _product(kernels, packed, x, relu, residual):
    """The level's product itself on `packed`'s blocks (int8: from quantize_rows' codes)."""
    y = torch.full((x.size(0), packed.out_features), float("nan"))
    if kernels.precision == "fp32":
        kernels.library.linear_fp32(packed, x, residual, relu, y)
    else:
        codes, row_scales = torch.empty(x.shape, dtype=torch.uint8), torch.empty(x.size(0))
        kernels.ext.quantize_rows(x, codes, row_scales, kernels.level)
        kernels.library.linear_int8(packed, codes, row_scales, residual, relu, y)
    return y


def _reference(kernels, weight, bias, x, relu, residual):
    """fp32: the product in float64; int8: the exact integer products of the same codes (the weights' per-channel codes
    as torch computes them, the rows' as quantize_rows does), scaled in the kernels' order."""
    if kernels.precision == "fp32":
        y = x.double() @ weight.double().T + (bias.double() if bias is not None else 0)
    else:
        scales = (weight.abs().amax(dim=1) / 127.0).clamp_min(torch.finfo(torch.float32).tiny)
        w_codes = torch.round(weight / scales[:, None]).clamp(-127, 127).long()
        codes, row_scales = torch.empty(x.shape, dtype=torch.uint8), torch.empty(x.size(0))
        kernels.ext.quantize_rows(x, codes, row_scales, kernels.level)
        sums = (codes.long() - kernels.ext.int8_row_zero_point) @ w_codes.T  # exact
        y = (sums.float() * scales) * row_scales[:, None]
        y = (y + bias if bias is not None else y).double()
    y = y.relu() if relu else y
    return (y + residual.double() if residual is not None else y).float()


# inputs not a multiple of 4 (int8: a last partial group of codes) and past one fp32 chunk of 512 (K blocks past a few
# rows), outputs not a multiple of any vector width (masked lanes, a ragged last tile), rows of a sentence's beam and
# past every tile's rows (the last rows in smaller tiles), a batch past one row block (1030 inputs: 127 rows), and
# transformer big's widths
@pytest.mark.parametrize("level", cpu_level_params())
@pytest.mark.parametrize("precision", ["fp32", "int8"])
@pytest.mark.parametrize("in_features,out_features,rows", [
    (256, 516, 1), (256, 516, 4), (256, 516, 9), (13, 7, 3), (13, 7, 40), (258, 50, 6), (258, 50, 17),
    (1030, 131, 4), (1030, 131, 23), (1030, 60, 300),
    (1024, 4096, 4), (4096, 1024, 4), (4096, 1024, 40)])  # transformer big's FFN: a beam's rows and a batch's
def test_linear_products_match_the_reference(ext, level, precision, in_features, out_features, rows):
    kernels = _kernels(ext, precision, level)
    torch.manual_seed(in_features * 1000 + out_features + rows)
    weight, bias = torch.randn(out_features, in_features) * 0.1, torch.randn(out_features)
    x, residual = torch.randn(rows, in_features) * 3, torch.randn(rows, out_features)
    for relu, res, b in [(False, None, bias), (True, None, bias), (False, residual, bias), (True, residual, None)]:
        packed = kernels.pack_linear(weight, b)
        assert packed.weight.shape[-1 if precision == "fp32" else -2] == kernels.library.block
        got, want = _product(kernels, packed, x, relu, res), _reference(kernels, weight, b, x, relu, res)
        # fp32: another summation order than float64's, a few ulps of the terms apart; int8: the same integer sums, the
        # scales' fp32 roundings (a wrong weight, lane or row is off by the terms themselves)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(kernels.linear(x, packed, "relu" if relu else None, res), got, rtol=0, atol=0)


@pytest.mark.parametrize("level", cpu_level_params())
@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_a_rows_result_does_not_depend_on_the_rows_around_it(ext, level, precision):
    """A sentence's beam decoded alone (a few rows) and inside a batch (many rows: other tiles, row blocks, K blocks)
    gives the same bits: the sums of each output run in one order whatever the tiling (the batch's hypotheses are each
    sentence's alone)."""
    kernels = _kernels(ext, precision, level)
    torch.manual_seed(3)
    for in_features in (96, 1030):
        weight, bias = torch.randn(70, in_features) * 0.1, torch.randn(70)
        packed = kernels.pack_linear(weight, bias)
        batch = torch.randn(300, in_features)
        whole = kernels.linear(batch, packed)
        for first in (0, 4, 37, 296):
            alone = kernels.linear(batch[first:first + 4].contiguous(), packed)
            assert torch.equal(alone, whole[first:first + 4]), (in_features, first)


@pytest.mark.parametrize("level", cpu_level_params())
def test_int8_products_are_exact_where_7_bit_codes_meet_the_largest_weights(ext, level):
    """The u8 x s8 multiply-adds (AVX2 / AVX-512 vpmaddubsw sums pairs in int16; NEON vmull; VNNI vpdpbusd) on the
    extreme codes: every code 127 against weights of +-127 in every position, the largest pair sums (2 x 127 x 127)
    that an int16 must hold. The product equals the exact int64 products scaled, for a beam's rows and a batch's."""
    kernels = _kernels(ext, "int8", level)
    I, O = 260, 40
    weight = torch.full((O, I), 1.0)
    weight[::2] = -1.0  # codes -127 / 127 after the per-channel scale (1 / 127)
    packed = kernels.pack_linear(weight, None)
    for rows in (5, 33):
        x = torch.full((rows, I), 7.0)  # every activation code 127 (the row's maximum)
        got = _product(kernels, packed, x, False, None)
        torch.testing.assert_close(got, x @ weight.T, rtol=1e-6, atol=1e-3)  # codes and scales reconstruct both exactly


def test_int8_packing_quantizes_as_torch(ext):
    """pack_int8's scales and codes are torch's (w.abs().amax(1) / 127 clamped to tiny, round half to even), the
    code sums the zero point's: the weights the int8 path decoded with before the packing moved into C++."""
    kernels = _kernels(ext, "int8", ext.select_cpu_level("auto"))
    torch.manual_seed(5)
    weight = torch.randn(37, 21)
    weight[3] = 0.0  # a channel of zeros: the tiny scale, codes 0
    weight[5] = torch.arange(21) * 0.5 - 5.0  # codes that land on halves: rounded to even
    blocks, sums, scales = kernels.library.pack_int8(weight, False)
    want_scales = (weight.abs().amax(dim=1) / 127.0).clamp_min(torch.finfo(torch.float32).tiny)
    assert torch.equal(scales, want_scales)
    codes = torch.round(weight / want_scales[:, None]).clamp(-127, 127).to(torch.int8)
    block = kernels.library.block
    padded = torch.zeros(blocks.size(0) * block, blocks.size(1) * 4, dtype=torch.int8)
    padded[:37, :21] = codes
    assert torch.equal(blocks, padded.view(-1, block, blocks.size(1), 4).permute(0, 2, 1, 3))
    assert torch.equal(sums, padded.int().sum(1) * kernels.ext.int8_row_zero_point)


def test_the_kernels_reject_blocks_of_another_shape_precision_or_level(ext):
    level = ext.select_cpu_level("auto")
    fp32, int8 = _kernels(ext, "fp32", level), _kernels(ext, "int8", level)
    x, y = torch.zeros(4, 64), torch.empty(4, 32)
    wrong_inputs = fp32.pack_linear(torch.zeros(32, 60), None)
    with pytest.raises(RuntimeError, match="level's blocks \\(pack_fp32\\) for 64 inputs and 32 outputs"):
        fp32.library.linear_fp32(wrong_inputs.__class__(**{**wrong_inputs.__dict__, "in_features": 64}), x, None,
                                 False, y)
    packed = int8.pack_linear(torch.zeros(32, 60), None)  # blocks for 60 inputs, not 64
    with pytest.raises(RuntimeError, match="level's blocks \\(pack_int8\\) for 64 inputs"):
        int8.library.linear_int8(packed, torch.zeros(4, 64, dtype=torch.uint8), torch.ones(4), None, False, y)
    with pytest.raises(RuntimeError, match="this library's layers are int8"):
        int8.library.linear_fp32(packed, x, None, False, y)
    others = [other for other in ext.runnable_cpu_levels() if ext.LinearLibrary("fp32", other).block != fp32.library.block]
    if others:  # blocks of another vector width: refused, not misread
        other = ext.LinearLibrary("fp32", others[0])
        with pytest.raises(RuntimeError, match=f"the {others[0]} level's blocks"):
            other.linear_fp32(fp32.pack_linear(torch.zeros(32, 64), None), x, None, False, y)


@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_packing_a_mapped_weight_gives_its_pages_back_and_keeps_a_written_one(ext, tmp_path, precision):
    """A weight mapped from a file (a checkpoint loaded mapped) is packed in chunks, each chunk's pages given back once
    packed: the process keeps the packed copy alone. A weight in memory keeps its pages; a mapped one written since
    (training's updates, copy-on-write) keeps its values."""
    release = tuple(int(part) for part in re.findall(r"\d+", platform.release())[:2])
    if platform.system() != "Linux" or release < (5, 4):
        pytest.skip(f"pages are given back on Linux 5.4 and later (madvise MADV_PAGEOUT); this is {platform.system()} "
                    f"{platform.release()}")
    kernels = _kernels(ext, precision, ext.select_cpu_level("auto"))
    torch.manual_seed(0)
    weight = torch.randn(2048, 512)
    path = tmp_path / "weights.pt"
    torch.save({"w": weight, "v": weight.clone()}, path)
    with open(path, "rb") as saved:  # a checkpoint on disk, not pages still to be written (those cannot be dropped)
        os.fsync(saved.fileno())
    state = torch.load(path, mmap=True, weights_only=True)
    mapped, written = state["w"], state["v"]
    assert FileMappings.now().holds(mapped) and not FileMappings.now().holds(weight)
    assert torch.equal(mapped, weight)  # read: every page resident
    resident, pages = resident_pages(mapped)
    assert resident == pages
    packed = kernels.pack_linear(mapped, None)
    assert resident_pages(mapped)[0] <= pages // 100
    x = torch.randn(3, 512)
    assert torch.equal(kernels.linear(x, packed), kernels.linear(x, kernels.pack_linear(weight, None)))
    assert torch.equal(mapped, weight)  # read again from the file
    in_memory = weight.clone()
    kernels.pack_linear(in_memory, None)
    resident, pages = resident_pages(in_memory)
    assert resident == pages  # memory, not a file's: kept
    written.mul_(2)  # copy-on-write: the pages are the process's now
    kernels.pack_linear(written, None)
    assert torch.equal(written, weight * 2)


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
        ext.LinearLibrary("fp32", "bogus")
    missing = [level for level in levels if level not in runnable]
    if missing:
        with pytest.raises(ValueError, match=f"this CPU does not run the '{missing[0]}' level"):
            ext.row_log_sum_exp(torch.zeros(1, 8), missing[0])


def test_the_decoding_option_names_every_architectures_levels(ext):
    from rfa_fairseq.kernel_choice import CPU_ISAS

    assert CPU_ISAS == ("auto", *cpu_levels.ALL_NAMES) and set(ext.cpu_levels()) <= set(CPU_ISAS)
    assert list(extension.machine_levels()) == ext.cpu_levels()  # the build's levels are the module's, in order


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
    sources through the compiler's front end, torch's headers read once (a precompiled header of the torch and
    pybind11 headers the sources include, included before each file: the project's own headers are still each file's
    to include). tests/test_aarch64_emulated.py runs them."""
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
    # the torch and pybind11 headers the sources include, precompiled once with the same flags: parsing them took
    # most of each file's time
    included = sorted({line.strip() for path in extension.CSRC_DIR.rglob("*") if path.suffix in (".h", ".cpp")
                       for line in path.read_text().splitlines()
                       if re.match(r"#include <(ATen|c10|torch|pybind11)/", line.strip())})
    assert any("ATen/ATen.h" in line for line in included), included
    torch_headers = tmp_path / "torch_headers.h"
    torch_headers.write_text("\n".join(included) + "\n")
    proc = subprocess.run([AARCH64_CXX, *flags, "-x", "c++-header", str(torch_headers), "-o", f"{torch_headers}.gch"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, f"{', '.join(included)} for aarch64: {proc.stderr[-3000:]}"
    failed = {}
    for source in extension.source_files():  # each file its own translation unit
        proc = subprocess.run([AARCH64_CXX, *flags, "-include", str(torch_headers), "-fsyntax-only", str(source)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            failed[source.name] = proc.stderr[-1500:]
    assert not failed, f"sources that do not compile for aarch64: {', '.join(failed)}\n" + "\n".join(failed.values())
    if objdump is None:
        pytest.skip("aarch64-linux-gnu-objdump is not installed (Debian's binutils-aarch64-linux-gnu): every source "
                    "compiled, the sdot check of the neon_dotprod object was not made")


# ---------------------------------------------------------------------------------------------- a capped decode


@pytest.mark.slow
def test_generate_capped_at_avx2_gives_the_uncapped_hypotheses(ext, tmp_path_factory):
    """fairseq-generate --model-overrides "{'rfa_cpu_isa': 'avx2'}" on a CPU above AVX2: the runtime's kernels on
    avx2 (its log line names the level), the same hypotheses as the uncapped run's and their scores within the
    order-of-sums tolerance (the levels' vectors sum fp32 in other orders)."""
    from cli_support import run, synthetic_data, train_generate_model
    from conftest import PLUGIN_DIR

    best = ext.select_cpu_level("auto")
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
        assert f"linear layers: fp32 on the {'avx2' if cap == 'avx2' else best} kernels" in log, log[-3000:]
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
