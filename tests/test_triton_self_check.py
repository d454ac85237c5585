"""The self-check that vets each Triton kernel on the user's device before its first use (gpu/triton_self_check.py),
run here in Triton's interpreter on CPU tensors passed to its entry points directly (the plugin routes only CUDA
tensors there): the real kernels pass and run; a kernel made to disagree, through the documented seam (a TritonTrust
with a kernel source of the test's, `installed`), fails its check, says so in one warning line, and its variant runs
the torch path from then on; --no-rfa-triton-self-check skips the check; a check runs once per (device, dtypes,
variant). Each check's cost is printed (milliseconds in the interpreter; tests/test_cuda.py prints a GPU's)."""
import logging
import math

import pytest
import torch
import torch.nn.functional as F
from helpers import build_model, decode_incrementally, random_batch

from rfa_fairseq.gpu import triton_self_check
from rfa_fairseq.gpu.triton_support import triton_usable
from rfa_fairseq.ops import causal_rfa_chunked
from rfa_fairseq.gpu.step import TRITON_KERNELS
from rfa_fairseq.ops.step import TORCH_KERNELS
from rfa_fairseq.gpu.triton_self_check import TritonKernelSource, TritonTrust, installed
from rfa_fairseq.gpu.triton_support import kernels

LOGGER = "rfa_fairseq.gpu.triton_self_check"


class CountingSource(TritonKernelSource):
    """The real kernels, counting their calls (the check's and the uses')."""

    def __init__(self):
        self.calls = {"causal_rfa": 0, "causal_layer_step": 0}

    def causal_rfa(self, *args):
        self.calls["causal_rfa"] += 1
        return super().causal_rfa(*args)

    def causal_layer_step(self, *args):
        self.calls["causal_layer_step"] += 1
        return super().causal_layer_step(*args)


class _ScaledGradient(torch.autograd.Function):
    """The identity forward; its backward scales the gradient by `scale`."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


class WrongGradientSource(CountingSource):
    """The real kernels, with the sequences' gradient of v 1.5 times what it is: right values, one wrong gradient."""

    def causal_rfa(self, phi_q, phi_k, v, *rest):
        return super().causal_rfa(phi_q, phi_k, _ScaledGradient.apply(v, 1.5), *rest)


class WrongStepSource(CountingSource):
    """The real kernels, with the step's output moved by a tenth of its range."""

    def causal_layer_step(self, *args):
        out = super().causal_layer_step(*args)
        return out + 0.1 * out.abs().max()


class RaisingSource(CountingSource):
    """Kernels that do not run here (as one that does not compile for this GPU)."""

    def causal_rfa(self, *args):
        self.calls["causal_rfa"] += 1
        raise RuntimeError("no kernel image is available for execution on the device")


@pytest.fixture
def trust(triton_interpreter, request):
    """A TritonTrust with the kernel source the test names (CountingSource by default), installed for the test: no
    verdicts yet, as in a fresh process."""
    source = getattr(request, "param", CountingSource)()
    with installed(TritonTrust(source)) as fresh:
        yield fresh
    for record in fresh.records:
        print(f"{record.kernel} ({record.variant}) {record.dtypes}: {record.outcome}, largest error "
              f"{record.largest_error} ({record.worst}), {record.milliseconds:.0f} ms")


def sequences(gated=True, T=20, dtype=torch.float32, grad=False, seed=0):
    """(phi_q, phi_k, v, log_gate) of 1 sentence x 2 heads, F = d = 16."""
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.rand(1, 2, T, 16, generator=g) * 0.25 for _ in range(2))
    v = torch.randn(1, 2, T, 16, generator=g)
    log_gate = F.logsigmoid(torch.randn(1, 2, T, generator=g) + 2) if gated else None
    inputs = [q.to(dtype), k.to(dtype), v.to(dtype), log_gate]
    return [x.requires_grad_(grad) if x is not None else None for x in inputs]


def run_sequences(inputs, self_check=True):
    """triton_self_check.causal_rfa (kernel_choice.causal_rfa's Triton side) -> out, and the inputs' gradients where
    they require them."""
    out, _ = triton_self_check.causal_rfa(*inputs, chunk_size=8, self_check=self_check)
    leaves = [x for x in inputs if x is not None and x.requires_grad]
    return out, (torch.autograd.grad((out * out).sum(), leaves) if leaves else ())


def run_chunked(inputs):
    out, _ = causal_rfa_chunked(*inputs, chunk_size=8)
    leaves = [x for x in inputs if x is not None and x.requires_grad]
    return out, (torch.autograd.grad((out * out).sum(), leaves) if leaves else ())


def step_inputs(seed=0):
    """One hedgehog, gated step of 5 rows x 2 heads (W = 16, F = 32, d = 8) reading a state of 7 rows through a
    beam order; -> the call's arguments but state_out."""
    g = torch.Generator().manual_seed(seed)
    R, H, W, D = 5, 2, 16, 8
    proj = torch.randn(R, H * (2 * W + D + 1), generator=g)
    q, k, v, gate = proj[:, : H * W], proj[:, H * W: 2 * H * W], proj[:, 2 * H * W: -H], proj[:, -H:]
    state_in = torch.rand(R + 2, H, 2 * W, D + 1, generator=g)
    return q, k, v, gate, None, state_in, torch.tensor([6, 0, 0, 3, 1])


def run_step(step, inputs):
    """-> the step's output and the state rows it wrote."""
    state_out = torch.full(inputs[5].shape, math.nan)
    out = step(*inputs, state_out, 1e-30, "hedgehog")
    return out, state_out[: out.size(0)]


def assert_exactly(got, want):
    for a, b in zip(got, want):
        assert all(torch.equal(x, y) for x, y in zip(a, b)) if isinstance(a, tuple) else torch.equal(a, b)


# ------------------------------------------------------------------ (a) the real kernels pass and run


def test_real_kernels_pass_their_check_and_run(trust):
    """Sequences (training: values and every gradient) and the step: one passing check each, then the Triton
    kernels' own results at every call; the check draws from its own generator (the process's stream untouched)."""
    rng = torch.get_rng_state()
    inputs = sequences(grad=True)
    raw_out, _ = kernels("triton_chunk").causal_rfa_triton(*inputs)
    want = (raw_out, torch.autograd.grad((raw_out * raw_out).sum(), inputs))
    for _ in range(2):
        assert_exactly(run_sequences(inputs), want)
    step = step_inputs()
    want_step = run_step(kernels("triton_step").launch_causal_layer_step, step)
    for _ in range(2):
        assert_exactly(run_step(TRITON_KERNELS.causal_layer_step, step), want_step)  # the CUDA kernel set's entry
    assert torch.equal(torch.get_rng_state(), rng)
    assert [(r.kernel, r.outcome) for r in trust.records] == [("causal_rfa", "passed"), ("causal_layer_step", "passed")]
    assert trust.source.calls == {"causal_rfa": 1 + 2, "causal_layer_step": 1 + 2}  # the check, then the uses
    for record, bound in zip(trust.records, (1e-2, 1e-5)):
        assert record.device == "cpu (Triton interpreter)" and record.tolerance == bound
        assert 0 <= record.largest_error <= bound and record.milliseconds > 0
    assert trust.records[0].variant == "gated, no initial state, training (gradients), F=16 d=16, chunks of 32"


def test_the_plugin_never_routes_cpu_tensors_to_triton():
    """Whether Triton takes tensors depends on their device, not on TRITON_INTERPRET (set in this process where
    there is no GPU): the CPU runs the torch path; tests reach the kernels by calling them."""
    q = torch.rand(1, 1, 4, 16)
    assert not triton_usable(q, q, q)


# ------------------------------------------------------------------ (b) a kernel that disagrees


@pytest.mark.parametrize("trust", [WrongGradientSource], indirect=True)
def test_a_wrong_gradient_fails_the_check_once_and_its_variant_runs_torch(trust, caplog):
    """The check compares every gradient: v's, 1.5 times too large, fails training's check (one warning naming the
    device, Triton's and torch's versions, d_v and the difference); that call and every later one of the variant
    give the chunked torch path's values and gradients, the kernel uncalled; inference, whose values are right,
    passes and runs the kernel."""
    import triton

    inputs = sequences(grad=True)
    want = run_chunked(inputs)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        for _ in range(3):
            assert_exactly(run_sequences(inputs), want)
        assert trust.source.calls["causal_rfa"] == 1  # the check's only
        warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(warnings) == 1 and "\n" not in warnings[0].getMessage()
        message = warnings[0].getMessage()
        failed = trust.records[0]
        assert (failed.outcome, failed.worst) == ("failed", "d_v") and failed.largest_error == pytest.approx(0.5)
        for part in ("cpu (Triton interpreter)", f"Triton {triton.__version__}", f"torch {torch.__version__}",
                     "causal_rfa (gated, no initial state, training (gradients)", "largest difference 5.0e-01 in d_v"):
            assert part in message, (part, message)

        values = sequences(grad=False)
        with torch.no_grad():
            out, _ = run_sequences(values)
        assert torch.equal(out, kernels("triton_chunk").causal_rfa_triton(*values)[0])
    assert [r.outcome for r in trust.records] == ["failed", "passed"]
    assert trust.source.calls["causal_rfa"] == 1 + 1 + 1  # inference: its check and its use
    assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) == 1


@pytest.mark.parametrize("trust", [WrongStepSource], indirect=True)
def test_a_wrong_step_fails_the_check_once_and_decodes_on_torch(trust, caplog):
    step = step_inputs()
    want = run_step(TORCH_KERNELS.causal_layer_step, step)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for _ in range(3):
            assert_exactly(run_step(TRITON_KERNELS.causal_layer_step, step), want)
    assert trust.source.calls["causal_layer_step"] == 1
    assert len(caplog.records) == 1
    record = trust.records[0]
    assert (record.outcome, record.worst) == ("failed", "out") and record.largest_error > 0.05
    assert f"largest difference {record.largest_error:.1e} in out" in caplog.records[0].getMessage()


@pytest.mark.parametrize("trust", [RaisingSource], indirect=True)
def test_a_kernel_that_raises_fails_the_check_and_names_the_error(trust, caplog):
    inputs = sequences()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for _ in range(2):
            assert torch.equal(run_sequences(inputs)[0], run_chunked(inputs)[0])
    assert trust.source.calls["causal_rfa"] == 1 and len(caplog.records) == 1
    assert "raised RuntimeError: no kernel image is available" in caplog.records[0].getMessage()
    assert trust.records[0].outcome == "failed" and trust.records[0].largest_error == math.inf


# ------------------------------------------------------------------ (c) the option skips the check


@pytest.mark.parametrize("trust", [WrongGradientSource], indirect=True)
def test_the_skip_option_runs_the_kernels_unchecked_until_a_call_asks_for_the_check(trust):
    """self_check=False (--no-rfa-triton-self-check): no check, the kernel runs as it is (here its wrong gradient
    shows), one "skipped" record; a later call that checks fails the check and gets the torch path."""
    inputs = sequences(grad=True)
    chunked = run_chunked(inputs)
    for _ in range(2):
        out, grads = run_sequences(inputs, self_check=False)
        torch.testing.assert_close(grads[2], 1.5 * chunked[1][2], rtol=1e-4, atol=1e-5)
    assert trust.source.calls["causal_rfa"] == 2
    assert [(r.outcome, r.milliseconds, r.largest_error) for r in trust.records] == [("skipped", 0.0, None)]
    assert_exactly(run_sequences(inputs), chunked)
    assert [r.outcome for r in trust.records] == ["skipped", "failed"]


@pytest.mark.parametrize("trust", [WrongStepSource], indirect=True)
def test_the_step_runs_unchecked_on_a_device_set_so(trust):
    step = step_inputs()
    triton_self_check.set_step_self_check("cpu", False)
    assert_exactly(run_step(TRITON_KERNELS.causal_layer_step, step),
                   run_step(WrongStepSource().causal_layer_step, step))
    triton_self_check.set_step_self_check("cpu", True)
    assert_exactly(run_step(TRITON_KERNELS.causal_layer_step, step), run_step(TORCH_KERNELS.causal_layer_step, step))
    assert [r.outcome for r in trust.records] == ["skipped", "failed"]


def test_the_model_option_reaches_the_sequence_calls_and_the_decoders_step(monkeypatch):
    """--no-rfa-triton-self-check: every causal module's call says self_check=False, and decoding sets the step's
    check off on the decoder's device; by default both on."""
    import rfa_fairseq.modules.rfa_attention as rfa_attention

    asked = []
    original = rfa_attention.causal_rfa

    def spy(*args, **kwargs):
        asked.append(kwargs["self_check"])
        return original(*args, **kwargs)

    monkeypatch.setattr(rfa_attention, "causal_rfa", spy)
    for option, checked in (([], True), (["--no-rfa-triton-self-check"], False)):
        model, d = build_model(option + ["--rfa-decode-kernel", "torch"])
        src, src_lengths, prev = random_batch(d, bsz=2, tgt_len=3)
        asked.clear()
        with installed(TritonTrust()) as trust:
            model(src, src_lengths, prev)
            model.eval()
            with torch.no_grad():
                decode_incrementally(model, model.encoder(src, src_lengths=src_lengths), prev, {})
            assert asked == [checked] * len(model.decoder.layers)
            assert trust.unchecked_steps == (set() if checked else {"cpu"})


# ------------------------------------------------------------------ (d) once per (device, dtypes, variant)


def test_each_variant_is_checked_once_per_process(trust):
    """Calls of one variant share one check; another dtype, the ungated kernel, a sequence inside the 16-position
    chunk and gradients are other variants, each checked once."""
    with torch.no_grad():
        for _ in range(3):
            run_sequences(sequences())
        for _ in range(2):
            run_sequences(sequences(dtype=torch.float16))
            run_sequences(sequences(gated=False))
            run_sequences(sequences(T=10))
    run_sequences(sequences(grad=True))
    variants = [(r.dtypes, r.variant) for r in trust.records]
    assert variants == [
        ("float32", "gated, no initial state, inference, F=16 d=16, chunks of 32"),
        ("float16+float32", "gated, no initial state, inference, F=16 d=16, chunks of 32"),  # fp32 log-gates
        ("float32", "ungated, no initial state, inference, F=16 d=16, chunks of 32"),
        ("float32", "gated, no initial state, inference, F=16 d=16, chunks of 16"),
        ("float32", "gated, no initial state, training (gradients), F=16 d=16, chunks of 32"),
    ]
    assert all(r.outcome == "passed" for r in trust.records)
    assert trust.source.calls["causal_rfa"] == 5 + (3 + 2 * 3 + 1)  # five checks, ten uses
