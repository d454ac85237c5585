"""The Triton kernels of the CUDA path, run by Triton's interpreter on the CPU tensors these tests pass the kernel
modules directly (TRITON_INTERPRET=1; the plugin itself routes only CUDA tensors to them):
triton_chunk.causal_rfa_triton (training's causal RFA, forward and backward) against the O(T^2) reference in fp64
(outputs, final states, the gradients of every input), and triton_step.launch_causal_layer_step (one decoding step
of a causal layer) against TorchKernels.causal_layer_step; and every kernel compiled for Hopper by Triton's own
compiler (tests/triton_aot.py). tests/test_cuda.py runs the compiled kernels on a GPU; tests/test_triton_self_check.py
the check that vets them on the user's device. The interpreter has no TF32, so the bounds here are tighter than the
self-check's (triton_self_check.SEQUENCE_TOLERANCES, STEP_TOLERANCES), which allow for it.

Every input is fresh random data (no zeros), drawn from a generator seeded by the case's parameters; outputs are
poisoned with NaN first, so an unwritten element fails."""
import importlib.util
import os
import subprocess
import sys
import zlib

import pytest
import torch
import torch.nn.functional as F

from conftest import REPO

from rfa_fairseq.gpu.triton_support import triton_import_error
from rfa_fairseq.ops import causal_rfa_reference
from rfa_fairseq.ops.step import TORCH_KERNELS
from rfa_fairseq.gpu.triton_support import kernels


@pytest.fixture(scope="module")
def interpreted(triton_interpreter):
    """The kernel modules, their kernels run by Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1
    where there is no GPU) on the CPU tensors these tests pass them."""
    return kernels("triton_chunk"), kernels("triton_step")


def seeded(*case) -> torch.Generator:
    """A generator seeded by the test case's parameters, the same in every process: a failing draw replays."""
    return torch.Generator().manual_seed(zlib.crc32(repr(case).encode()))


def _rel(a, b):
    """Relative error; against 0.1 where the reference is ~0 (a gradient that vanishes: one position, ungated)."""
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(0.1)).item()


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("B,H,T,F_,D", [(2, 2, 1, 16, 16), (2, 3, 7, 24, 20), (1, 2, 33, 64, 64), (2, 1, 70, 20, 12)])
def test_chunked_kernels_match_the_reference_values_and_gradients(interpreted, gated, with_state, B, H, T, F_, D):
    """Lengths inside one chunk, across chunks and not a multiple of the chunk (32); features and head dims that
    are not powers of two; gradients of q, k, v, the log-gates and the initial state."""
    chunk = interpreted[0]
    g = seeded(gated, with_state, B, H, T, F_, D)
    q = torch.rand(B, H, T, F_, generator=g, dtype=torch.float64)
    k = torch.rand(B, H, T, F_, generator=g, dtype=torch.float64)
    v = torch.randn(B, H, T, D, generator=g, dtype=torch.float64)
    log_gate = F.logsigmoid(torch.randn(B, H, T, generator=g, dtype=torch.float64) + 2) if gated else None
    state = torch.rand(B, H, F_, D + 1, generator=g, dtype=torch.float64) if with_state else None
    upstream = torch.randn(B, H, T, D, generator=g, dtype=torch.float64)
    inputs = [x for x in (q, k, v, log_gate, state)]
    results = {}
    for name, fn, dtype in (("triton", chunk.causal_rfa_triton, torch.float32), ("reference", causal_rfa_reference, torch.float64)):
        leaves = [x.to(dtype).requires_grad_() if x is not None else None for x in inputs]
        out, final = fn(*leaves)
        (out * upstream.to(out.dtype)).sum().backward()
        results[name] = (out, final, [x.grad for x in leaves if x is not None])
    (out, final, grads), (ref_out, ref_final, ref_grads) = results["triton"], results["reference"]
    assert out.dtype == torch.float32 and final.dtype == torch.float32 and not final.requires_grad
    assert _rel(out, ref_out) < 1e-5 and _rel(final, ref_final) < 1e-5
    for grad, ref in zip(grads, ref_grads):
        assert torch.isfinite(grad).all() and _rel(grad, ref) < 1e-5


def test_chunked_kernels_take_half_precision_and_strided_inputs(interpreted):
    """fp16 features and values (fp32 arithmetic), v a permuted view as the attention passes it; gradients come back
    in each input's dtype."""
    chunk = interpreted[0]
    g = torch.Generator().manual_seed(7)
    B, H, T, F_, D = 2, 2, 40, 32, 16
    q = torch.rand(B, H, T, F_, generator=g).half().requires_grad_()
    k = torch.rand(B, H, T, F_, generator=g).half().requires_grad_()
    v_tbc = torch.randn(T, B, H, D, generator=g).half().requires_grad_()
    v = v_tbc.permute(1, 2, 0, 3)  # (B, H, T, D), not contiguous
    log_gate = F.logsigmoid(torch.randn(B, H, T, generator=g) + 2).requires_grad_()
    out, _ = chunk.causal_rfa_triton(q, k, v, log_gate)
    out.sum().backward()
    assert q.grad.dtype == torch.float16 and v_tbc.grad.dtype == torch.float16 and log_gate.grad.dtype == torch.float32
    ref = [x.detach().double().requires_grad_() for x in (q, k, v, log_gate)]
    ref_out, _ = causal_rfa_reference(*ref)
    ref_out.sum().backward()
    assert _rel(out, ref_out) < 1e-5
    for got, want in ((q.grad, ref[0].grad), (k.grad, ref[1].grad), (v_tbc.grad.permute(1, 2, 0, 3), ref[2].grad),
                      (log_gate.grad, ref[3].grad)):
        assert _rel(got, want) < 2e-3  # fp16 gradients


@pytest.mark.parametrize("activation,W,F_", [("hedgehog", 16, 32), ("hedgehog", 12, 24), ("relu", 20, 20), (None, 24, 24)])
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("case", ["first", "order", "padded", "fp16"])
def test_step_kernel_matches_the_torch_step(interpreted, activation, W, F_, gated, case):
    """One decoding step of a causal layer: out and the state it writes equal TorchKernels' (every map's step
    activation, gated or not, the first step (no state), a beam order over more rows than the step's, padded keys,
    fp16 projections); rows of state_out past the step's stay untouched."""
    step = interpreted[1]
    g = seeded(activation, W, F_, gated, case)
    R, H, D = 6, 3, 20
    dtype = torch.float16 if case == "fp16" else torch.float32
    proj = torch.randn(R, H * (2 * W + D + 1), generator=g).to(dtype)  # [q | k | v | gate logits] as the step's
    q, k, v = proj[:, : H * W], proj[:, H * W: 2 * H * W], proj[:, 2 * H * W: 2 * H * W + H * D]
    if activation is None:  # the features themselves (random maps): positive, contiguous
        q, k = q.float().abs(), k.float().abs()
    gate = proj[:, 2 * H * W + H * D:] if gated else None
    key_pad = torch.tensor([r % 3 == 1 for r in range(R)]) if case == "padded" else None
    state_in = None if case == "first" else torch.rand(R + 3, H, F_, D + 1, generator=g)
    order = torch.randperm(R + 3, generator=g)[:R] if case in ("order", "fp16") else None
    want_state = torch.full((R + 2, H, F_, D + 1), float("nan"))
    got_state = want_state.clone()
    want = TORCH_KERNELS.causal_layer_step(q, k, v, gate, key_pad, state_in, order, want_state, 1e-3, activation)
    got = step.launch_causal_layer_step(q, k, v, gate, key_pad, state_in, order, got_state, 1e-3, activation)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert _rel(got, want) < (2e-3 if dtype == torch.float16 else 1e-5)
    assert _rel(got_state[:R], want_state[:R]) < 1e-5
    assert torch.isnan(got_state[R:]).all()


@pytest.mark.slow
def test_every_kernel_compiles_for_hopper_without_a_gpu():
    """Each kernel variant the model launches compiles for sm_90 (H100, H200) with the installed Triton and its own
    ptxas (tests/triton_aot.py, without the interpreter): what the GPU will compile, checked where there is none."""
    if not importlib.util.find_spec("triton") or triton_import_error() is not None:
        pytest.skip(f"Triton is not usable here: {triton_import_error() or 'not installed'}")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, os.path.join(REPO, "tests", "triton_aot.py"), "--arch", "90"],
                          capture_output=True, text=True, env=env, timeout=600)
    print(proc.stdout[-3000:])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "36 kernels compiled for sm_90" in proc.stdout
