"""The aarch64 levels' kernels executed: neon and neon_dotprod, compiled for aarch64 with Debian's cross compiler
(g++-aarch64-linux-gnu) into the kernels' own program (tests/level_kernels_program.cpp: cpu_level.cpp and the level
objects, linked statically, no torch, no Python) and run under qemu's user-mode emulation (qemu-user: `-cpu max`, an
ARMv8 CPU with the dot-product extension), on the inputs of the comparisons the x86 levels get (tests/test_cpu_levels.py,
test_ops.py): linear products (fp32 and int8) against float64 products and exact integer products, a row's result
alone equal to it inside a batch, exp within 2 ulps of float64, log-sum-exp, the causal update and read-out (fp32 and
fp16 state), the feature map, layer norm, the row quantization; the references computed here on the host. The CPU's
answer (getauxval's HWCAP) is checked on an emulated CPU without the dot-product extension (`-cpu cortex-a53`).
Skipped, saying why, where qemu-user or the cross compiler is not installed (scripts/run_tests.sh installs both with
apt-get where it can). The decoding step through the native runtime needs an aarch64 torch and is not run here."""
import platform
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import REPO

from rfa_fairseq.cpu import extension

CXX = "aarch64-linux-gnu-g++"
PROGRAM_SOURCE = Path(REPO) / "tests" / "level_kernels_program.cpp"
AARCH64_LEVELS = list(extension.machine_levels("aarch64"))
INT8_ZERO_POINT = 64  # cpu_kernels.h's kInt8RowZeroPoint


def _qemu():
    return shutil.which("qemu-aarch64-static") or shutil.which("qemu-aarch64")


def _compile(command):
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.fixture(scope="module")
def program(tmp_path_factory):
    """The kernels' program for aarch64 (statically linked: qemu runs it without an aarch64 root)."""
    if platform.machine() != "x86_64":
        pytest.skip(f"the emulated aarch64 run is made from an x86-64 machine; this one is {platform.machine()}")
    missing = [tool for tool, found in ((CXX, shutil.which(CXX)), ("qemu-aarch64", _qemu())) if not found]
    if missing:
        pytest.skip(f"{' and '.join(missing)} not installed (scripts/run_tests.sh installs them with apt-get where it "
                    f"can: Debian's g++-aarch64-linux-gnu and qemu-user)")
    out = tmp_path_factory.mktemp("aarch64_kernels")
    args = extension.torch_level_build_args()
    levels = extension.compile_level_objects(out, args["include_dirs"], args["abi_flag"], compiler=CXX, machine="aarch64")
    flags = [*extension.EXTRA_CFLAGS, extension.LEVEL_STD, f"-I{extension.CSRC_DIR}"]
    objects = [out / "cpu_level.o", out / "program.o"]
    jobs = [_compile([CXX, *flags, "-c", str(src), "-o", str(obj)])
            for src, obj in zip([extension.CSRC_DIR / "cpu_level.cpp", PROGRAM_SOURCE], objects)]
    for job in jobs:
        output = job.communicate()[0]
        assert job.returncode == 0, f"{shlex.join(map(str, job.args))}:\n{output[-3000:]}"
    binary = out / "level_kernels_program"
    proc = subprocess.run([CXX, "-static", *extension.EXTRA_LDFLAGS, *map(str, [*objects, *levels]), "-o", str(binary)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, f"linking the aarch64 kernels' program failed:\n{proc.stderr[-3000:]}"
    return binary


def _levels_under(program, cpu):
    proc = subprocess.run([_qemu(), "-cpu", cpu, str(program), "levels"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return dict(line.split(": ", 1) for line in proc.stdout.splitlines())


@pytest.mark.slow
def test_the_emulated_cpu_runs_the_levels_its_hwcap_has(program):
    """getauxval's HWCAP as qemu presents each CPU: cortex-a53 (ARMv8.0, no dot product) runs neon alone, max both."""
    assert _levels_under(program, "max") == {"architecture": " ".join(AARCH64_LEVELS),
                                             "runnable": "neon neon_dotprod"}
    assert _levels_under(program, "cortex-a53")["runnable"] == "neon"


# ------------------------------------------------------------------------------------------------- the cases


def _f32(x):
    """A float32 argument as a decimal that reads back as the same float32."""
    return repr(float(torch.tensor(x, dtype=torch.float32)))


class Cases:
    """The program's input (case lines and raw arrays) and, per case, its results' layout and their check."""

    def __init__(self, level):
        self.level, self.request, self.cases = level, bytearray(), []

    def add(self, name, kernel, arguments, inputs, outputs, check):
        self.request += f"{kernel} {self.level} {' '.join(map(str, arguments))}\n".encode()
        for tensor in inputs:
            self.request += tensor.contiguous().numpy().tobytes()
        self.cases.append((name, outputs, check))

    def run(self, program):
        proc = subprocess.run([_qemu(), "-cpu", "max", str(program)], input=bytes(self.request), capture_output=True,
                              timeout=600)
        assert proc.returncode == 0, proc.stderr.decode(errors="replace")[-3000:]
        data, at, failures = proc.stdout, 0, []
        for name, outputs, check in self.cases:
            results = []
            for dtype, count in outputs:
                size = count * torch.empty((), dtype=dtype).element_size()
                assert at + size <= len(data), f"{name}: the program wrote fewer results than its cases need"
                results.append(torch.frombuffer(bytearray(data[at:at + size]), dtype=dtype) if size else
                               torch.empty(0, dtype=dtype))
                at += size
            try:
                check(*results)
            except AssertionError as error:
                failures.append(f"{name}: {str(error)[:600]}")
        assert at == len(data), "the program wrote more results than its cases"
        return failures


def _linear_cases(cases, precision, I, O, R, variants, seed):
    torch.manual_seed(seed)
    weight, bias = torch.randn(O, I) * 0.1, torch.randn(O)
    x, residual = torch.randn(R, I) * 3, torch.randn(R, O)
    for relu, with_residual, with_bias in variants:
        res, b = (residual if with_residual else None), (bias if with_bias else None)
        reference = _linear_reference(precision, weight, b, x, relu, res)
        _add_linear(cases, f"linear_{precision} I={I} O={O} R={R} relu={relu} residual={res is not None} "
                    f"bias={b is not None}", precision, weight, b, x, relu, res,
                    lambda y, want=reference: torch.testing.assert_close(y.view_as(want), want, rtol=1e-5, atol=1e-4))


def _int8_weight(weight):
    """pack_int8's per-channel codes and scales (linear_layers.cpp; tests/test_cpu_levels.py checks them on x86)."""
    scales = (weight.abs().amax(dim=1) / 127.0).clamp_min(torch.finfo(torch.float32).tiny)
    return torch.round(weight / scales[:, None]).clamp(-127, 127).to(torch.int8), scales


def _quantized_rows(x):
    """step_kernels.cpp's quantize_rows: 7-bit codes round(x / scale) + the zero point, scale = max|x| / 63."""
    top = x.abs().amax(dim=1)
    scales = torch.where(top > 0, top / (INT8_ZERO_POINT - 1), torch.ones_like(top))
    codes = torch.round(x * (1.0 / scales)[:, None]) + INT8_ZERO_POINT
    return codes.clamp(0, 2 * INT8_ZERO_POINT - 1).to(torch.uint8), scales


def _linear_reference(precision, weight, bias, x, relu, residual):
    if precision == "fp32":
        y = x.double() @ weight.double().T + (bias.double() if bias is not None else 0)
    else:  # the exact integer products of the same codes, scaled in the kernels' order
        w_codes, scales = _int8_weight(weight)
        codes, row_scales = _quantized_rows(x)
        y = ((((codes.long() - INT8_ZERO_POINT) @ w_codes.long().T).float() * scales) * row_scales[:, None])
        y = (y + bias if bias is not None else y).double()
    y = y.relu() if relu else y
    return (y + residual.double() if residual is not None else y).float()


def _add_linear(cases, name, precision, weight, bias, x, relu, residual, check):
    (R, I), O = x.shape, weight.size(0)
    arguments = [R, I, O, int(relu), int(bias is not None), int(residual is not None)]
    optional = [t for t in (bias, residual) if t is not None]
    if precision == "fp32":
        inputs = [x, weight, *optional]
    else:
        codes, row_scales = _quantized_rows(x)
        inputs = [codes, row_scales, *_int8_weight(weight), *optional]
    cases.add(name, f"linear_{precision}", arguments, inputs, [(torch.float32, R * O)], check)


def _row_independence_cases(cases, precision):
    """A sentence's beam alone (4 rows) and inside a batch of 300 (other tiles, row blocks, K blocks): the same bits."""
    torch.manual_seed(3)
    weight, bias = torch.randn(70, 1030) * 0.1, torch.randn(70)
    batch = torch.randn(300, 1030)
    whole = {}
    _add_linear(cases, f"linear_{precision} batch of 300", precision, weight, bias, batch, False, None,
                lambda y: whole.setdefault("y", y.view(300, 70)))
    for first in (0, 37, 296):
        _add_linear(cases, f"linear_{precision} rows {first}..{first + 3} alone equal the batch's", precision, weight,
                    bias, batch[first:first + 4], False, None,
                    lambda y, first=first: _assert_equal(y.view(4, 70), whole["y"][first:first + 4]))


def _assert_equal(got, want):
    assert torch.equal(got, want), f"max difference {(got - want).abs().max().item():.3g}"


def _exp_case(cases):
    x = torch.cat([torch.linspace(-87, 0, 100_003), torch.tensor([-100.0, -88.0, 0.0, 1e-30])])

    def check(got):
        got, want = got.double(), x.double().exp()
        ulp = torch.finfo(torch.float32).eps * want.abs()
        normal = want > torch.finfo(torch.float32).tiny
        assert ((got - want).abs()[normal] <= 2 * ulp[normal]).all(), "exp more than 2 ulps from float64"
        below = got[~normal]  # clamped far below zero: tiny and not negative (nor NaN)
        assert ((below >= 0) & (below <= 2 * torch.finfo(torch.float32).tiny)).all(), below

    cases.add("exp", "exp", [x.numel()], [x], [(torch.float32, x.numel())], check)


def _row_cases(cases):
    torch.manual_seed(11)
    for n in (1, 3, 4, 7, 100, 1031):
        x = torch.randn(n) * 10
        if n > 4:
            x[1] = float("-inf")  # a masked token

        def log_sum_exp(got, x=x):
            want_max = x.max()
            assert got[0] == want_max, (got[0], want_max)
            want = torch.log(torch.exp(x.double() - float(want_max)).sum())
            torch.testing.assert_close(got[1].double(), want, rtol=1e-5, atol=1e-6)

        cases.add(f"row_log_sum_exp n={n}", "row_log_sum_exp", [n], [x], [(torch.float32, 2)], log_sum_exp)
        cases.add(f"block_max n={n}", "block_max", [n], [x], [(torch.float32, 1)],
                  lambda got, x=x: _assert_equal(got[0], x.max()))
        finite = torch.nan_to_num(x, neginf=-5.0)
        cases.add(f"max_abs n={n}", "max_abs", [n], [finite], [(torch.float32, 1)],
                  lambda got, x=finite: _assert_equal(got[0], x.abs().max()))
        a, b = torch.randn(n), torch.randn(n)
        cases.add(f"dot n={n}", "dot", [n], [a, b], [(torch.float32, 1)],
                  lambda got, a=a, b=b: torch.testing.assert_close(
                      got[0].double(), (a.double() * b.double()).sum(), rtol=0,
                      atol=1e-6 * float((a.double() * b.double()).abs().sum()) + 1e-7))
        y = torch.randn(n)
        cases.add(f"axpy n={n}", "axpy", [n, _f32(0.37)], [a, y], [(torch.float32, n)],
                  lambda got, a=a, y=y: torch.testing.assert_close(
                      got.double(), y.double() + float(torch.tensor(0.37)) * a.double(), rtol=1e-6, atol=1e-6))


def _update_cases(cases):
    torch.manual_seed(13)
    g, k_scale = 0.9, 0.125
    g32, k32 = float(torch.tensor(g)), float(torch.tensor(k_scale))
    for F, D1 in [(8, 5), (16, 65), (64, 129), (32, 4)]:
        for state_dtype in (torch.float32, torch.float16):
            for has_state in (False, True):
                s_in = (torch.randn(F, D1) * 0.5).to(state_dtype)
                q, k, v_aug = torch.rand(F), torch.rand(F), torch.randn(D1)
                want_state = k32 * k.double()[:, None] * v_aug.double()[None, :]
                if has_state:
                    want_state = want_state + g32 * s_in.double()
                want_acc = q.double() @ want_state
                name = f"update_and_read_out {state_dtype} F={F} D1={D1} state={has_state}"
                kernel = "update_fp32" if state_dtype == torch.float32 else "update_fp16"
                inputs = [s_in.view(torch.int16)] if state_dtype == torch.float16 else [s_in]

                def check(s_out, acc, want_state=want_state, want_acc=want_acc, dtype=state_dtype, F=F, D1=D1):
                    s_out = (s_out.view(torch.float16) if dtype == torch.float16 else s_out).view(F, D1).double()
                    # fp16: the fp32 sum rounded once to binary16 (within one of its ulps of the float64 sum's)
                    tolerance = dict(rtol=2 ** -10, atol=2 ** -24) if dtype == torch.float16 else dict(rtol=1e-6,
                                                                                                       atol=1e-6)
                    torch.testing.assert_close(s_out, want_state, **tolerance)
                    torch.testing.assert_close(acc.double(), want_acc, rtol=1e-5, atol=1e-5)

                cases.add(name, kernel, [F, D1, int(has_state), _f32(g), _f32(k_scale)],
                          (inputs if has_state else []) + [q, k, v_aug],
                          [(torch.int16 if state_dtype == torch.float16 else torch.float32, F * D1),
                           (torch.float32, D1)], check)


def _feature_and_norm_cases(cases):
    torch.manual_seed(17)
    for D in (3, 32, 64):
        p = torch.randn(D) * 4
        want = torch.cat([torch.softmax(p.double(), 0), torch.softmax(-p.double(), 0)])
        cases.add(f"hedgehog D={D}", "hedgehog", [D], [p], [(torch.float32, 2 * D)],
                  lambda got, want=want: torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-7))
    for C in (7, 512, 1024):
        for with_residual in (False, True):
            x, residual, gamma, beta = torch.randn(C) * 2 + 1, torch.randn(C), torch.randn(C), torch.randn(C)
            summed = (x + residual if with_residual else x).double()
            want = torch.nn.functional.layer_norm(summed, (C,), gamma.double(), beta.double(), eps=1e-5)
            cases.add(f"layer_norm C={C} residual={with_residual}", "layer_norm", [C, int(with_residual), _f32(1e-5)],
                      [x, *([residual] if with_residual else []), gamma, beta], [(torch.float32, C)],
                      lambda got, want=want: torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5))
    x = torch.randn(1031) * 5
    x[:8] = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 63.0, -63.0]) * (float(x.abs().max()) / 63)  # halves
    inv_scale = float(torch.tensor(63 / float(x.abs().max())))
    want = (torch.round(x * torch.tensor(inv_scale)) + INT8_ZERO_POINT).clamp(0, 127).to(torch.uint8)
    cases.add("quantize_row", "quantize_row", [x.numel(), _f32(inv_scale)], [x], [(torch.uint8, x.numel())],
              lambda got: _assert_equal(got, want))


def _all_cases(level):
    cases = Cases(level)
    every = [(False, False, True), (True, False, True), (False, True, True), (True, True, False)]  # relu, residual, bias
    for precision in ("fp32", "int8"):
        # shapes of tests/test_cpu_levels.py: inputs not a multiple of 4 and past one fp32 chunk of 512, outputs not a
        # multiple of the vector width, a beam's rows and past every tile's rows, a batch past one row block
        for i, (I, O, R) in enumerate([(256, 516, 1), (256, 516, 4), (256, 516, 9), (13, 7, 3), (13, 7, 40),
                                       (258, 50, 6), (258, 50, 17), (1030, 131, 4), (1030, 131, 23), (1030, 60, 300),
                                       (1024, 4096, 4), (4096, 1024, 4), (4096, 1024, 40)]):  # + transformer big's FFN
            variants = every if I * O * R < 2_000_000 else every[i % 4:i % 4 + 1]
            _linear_cases(cases, precision, I, O, R, variants, seed=I * 1000 + O + R)
        _row_independence_cases(cases, precision)
    # int8's extreme codes: every code 127 against weights of +-127, the largest pair sums an int16 must hold
    weight = torch.ones(40, 260)
    weight[::2] = -1.0
    for rows in (5, 33):
        x = torch.full((rows, 260), 7.0)
        _add_linear(cases, f"linear_int8 extreme codes rows={rows}", "int8", weight, None, x, False, None,
                    lambda y, want=x @ weight.T: torch.testing.assert_close(y.view_as(want), want, rtol=1e-6,
                                                                            atol=1e-3))
    _exp_case(cases)
    _row_cases(cases)
    _update_cases(cases)
    _feature_and_norm_cases(cases)
    return cases


@pytest.mark.slow
@pytest.mark.parametrize("level", AARCH64_LEVELS)
def test_the_aarch64_level_kernels_match_the_references_under_emulation(program, level, record_property):
    cases = _all_cases(level)
    failures = cases.run(program)
    record_property("aarch64_emulated", f"{level}: {len(cases.cases) - len(failures)} of {len(cases.cases)} kernel "
                                        f"cases equal their references")
    assert not failures, f"{len(failures)} of {len(cases.cases)} cases differ on {level}:\n" + "\n".join(failures)
