"""A Triton kernel runs only where it has agreed with the torch path on this device: a self-check once per (device,
dtypes, variant) and process, the one place that decides whether a Triton kernel is trusted here.

The Triton kernels (triton_chunk.py: causal RFA over sequences, forward and backward; triton_step.py: the decoding
step's causal layer) are tested in Triton's interpreter on CPU tensors and compiled for sm_90 without a GPU
(tests/test_triton_kernels.py); the user's GPU, driver, Triton and torch are their own. So the first time a kernel
is about to run on a (device, dtypes, variant) in a process, it first runs on a small input beside the torch path
(rfa.causal_rfa_chunked for sequences, TorchKernels.causal_layer_step for the step), and it is used only where
every tensor compared (outputs, states, and in training every gradient) agrees within the tolerance of its dtypes
(SEQUENCE_TOLERANCES, STEP_TOLERANCES). Otherwise one warning names the device, the Triton and torch versions, the
kernel and variant and the largest difference (or the error the kernel raised), and that (device, dtypes, variant)
runs the torch path for the rest of the process. A variant is what selects other compiled code: gated or not, an
initial state or not, gradients (training) or not, the shapes the kernel is specialized for (features, head dim,
the chunk of 16 or 32 positions; the step's activation, padding, carried state, beam order, map width). (Triton
also specializes integer arguments by their divisibility by 16: the same code, compiled apart, not told apart here.)
A check inside a CUDA graph capture cannot read its result back: that call takes the torch path, unchecked.

    causal_rfa(phi_q, phi_k, v, log_gate, state, chunk_size=, eps=, self_check=)   kernel_choice.causal_rfa's Triton side
    causal_layer_step(phi_q, ..., state_out, eps, activation)   TritonKernels' step (via triton_step.causal_layer_step)
    set_step_self_check(device, enabled)    the decoder's --no-rfa-triton-self-check (the step's calls take no options)
    checks() -> [CheckRecord]               the checks this process ran or skipped: outcome, difference, milliseconds

The check costs one run of each kernel and of the torch path on a few positions (and the kernels' first compilation
where no earlier run cached it); it is measured, logged at INFO and kept in `checks()`. --no-rfa-triton-self-check
skips it (benchmarks on a GPU checked before); a verdict already reached in the process stands.

`TritonTrust` holds the verdicts and the kernels they vet (`TritonKernelSource`); the process has one (`current()`).
The seam for tests: `installed(trust)` puts another in its place for a block, with its own kernel source (a wrapper
that counts calls or perturbs one result) and no verdicts yet, as a fresh process would start; production code never
installs one. Tests pass CPU tensors to the entry points above, which Triton's interpreter then runs
(TRITON_INTERPRET=1, read by Triton itself as it is imported); the plugin routes only CUDA tensors here.
"""
import contextlib
import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ..ops.rfa import DENOMINATOR_EPS, causal_rfa_chunked
from .triton_support import kernels

logger = logging.getLogger(__name__)

# The largest relative_error to the torch path at which a Triton kernel is used, by the least precise dtype of its
# inputs. The chunked kernels' fp32 products run on TF32 tensor cores (~1e-3); the step's arithmetic is elementwise
# fp32, its output rounded to the inputs' dtype. tests/test_cuda.py asserts the same bounds on a GPU; in Triton's
# interpreter, which has no TF32, tests/test_triton_kernels.py asserts tighter ones.
SEQUENCE_TOLERANCES = {torch.float32: 1e-2, torch.bfloat16: 1e-2, torch.float16: 1e-2}
STEP_TOLERANCES = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}
CHECK_SEED = 0  # the check's inputs come from a generator of their own: the process's random streams are untouched


def relative_error(got: Tensor, want: Tensor) -> float:
    """max |got - want| over max |want| (in fp64): an error relative to the tensor's range; NaN where got has one."""
    want = want.double()
    return ((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def tolerance(table: Dict[torch.dtype, float], dtypes) -> float:
    """The bound of the least precise of `dtypes` (None: an absent input)."""
    return max(table[d] for d in dtypes if d is not None)


@dataclass(frozen=True)
class CheckRecord:
    """One check of a kernel on a (device, dtypes, variant), as `checks()` lists them."""

    kernel: str  # "causal_rfa" (triton_chunk) or "causal_layer_step" (triton_step)
    device: str  # torch.cuda.get_device_name, or "cpu (Triton interpreter)"
    dtypes: str  # the inputs' dtypes, "float16" or "float16+float32"
    variant: str
    outcome: str  # "passed", "failed" (the torch path runs it) or "skipped" (--no-rfa-triton-self-check)
    largest_error: Optional[float]  # relative_error of the worst tensor; inf where the kernel raised; None: skipped
    worst: str  # the tensor of largest_error ("d_phi_k"), or the error the kernel raised
    tolerance: float
    milliseconds: float  # the check's wall time (0 where skipped)


def device_key(device) -> str:
    """A device as the verdicts are keyed: "cuda" means the current CUDA device."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return str(device)


def device_label(device: torch.device) -> str:
    """The device as the warning names it."""
    device = torch.device(device)
    return torch.cuda.get_device_name(device) if device.type == "cuda" else f"{device.type} (Triton interpreter)"


def versions() -> str:
    import triton

    return f"Triton {triton.__version__}, torch {torch.__version__}"


def _dtypes_label(dtypes) -> str:
    """"float16+float32": the distinct dtypes of the inputs present, in order."""
    return "+".join(dict.fromkeys(str(d).replace("torch.", "") for d in dtypes if d is not None))


class TritonKernelSource:
    """The Triton kernels the checks vet and the plugin then runs. Tests install a TritonTrust with another source
    (`installed`): a wrapper of this one that counts its calls or perturbs one result."""

    def causal_rfa(self, phi_q, phi_k, v, log_gate, state, eps):
        return kernels("triton_chunk").causal_rfa_triton(phi_q, phi_k, v, log_gate, state, eps=eps)

    def causal_layer_step(self, phi_q, phi_k, v, gate_logits, key_pad, state_in, order, state_out, eps, activation):
        return kernels("triton_step").launch_causal_layer_step(phi_q, phi_k, v, gate_logits, key_pad, state_in, order,
                                                               state_out, eps, activation)


class TritonTrust:
    """The verdicts of a process's self-checks, the records of the checks, and the kernel source they vet."""

    def __init__(self, source: Optional[TritonKernelSource] = None):
        self.source = source if source is not None else TritonKernelSource()
        self.verdicts: Dict[tuple, bool] = {}
        self.records: List[CheckRecord] = []
        self.unchecked_steps: set = set()  # devices whose decoding step is not checked (set_step_self_check)
        self._skipped: set = set()  # keys whose skip is recorded already
        self._lock = threading.Lock()

    def trusted(self, kernel: str, device: torch.device, dtypes: tuple, variant, tolerances: Dict[torch.dtype, float],
                check: Callable[[], Tuple[str, float]], self_check: bool) -> bool:
        """Whether `kernel` runs for this (device, dtypes, variant): its verdict, reached by `check` (-> the worst
        tensor's name and its relative_error, held to `tolerances`) the first time, or True unchecked where
        self_check is off. variant: a frozen description of the compiled code (`describe()`)."""
        key = (kernel, device_key(device), dtypes, variant)
        verdict = self.verdicts.get(key)
        if verdict is not None:
            return verdict
        bound = tolerance(tolerances, dtypes)
        if not self_check:
            if key not in self._skipped:
                self._skipped.add(key)
                self._record(key, "skipped", None, "", bound, 0.0)
            return True
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            # a check reads its differences back to the host, which a capture forbids: the torch path goes into
            # this graph, and the variant is checked at its next uncaptured call
            logger.debug(f"rfa_fairseq: {kernel} ({variant.describe()}) first met inside a CUDA graph capture: the "
                         "torch path there")
            return False
        with self._lock:
            if key not in self.verdicts:
                self.verdicts[key] = self._run(key, bound, check)
            return self.verdicts[key]

    def _run(self, key: tuple, bound: float, check) -> bool:
        start = time.perf_counter()
        try:
            worst, error = check()
            difference = f"largest difference {error:.1e} in {worst}"
        except Exception as raised:  # a kernel that does not compile or launch here is not trusted either
            worst = difference = f"raised {type(raised).__name__}: {raised}".replace("\n", " ")
            error = math.inf
        milliseconds = 1000 * (time.perf_counter() - start)
        passed = error <= bound  # False for NaN
        record = self._record(key, "passed" if passed else "failed", error, worst, bound, milliseconds)
        where = f"{record.kernel} ({record.variant}) on {record.device} in {record.dtypes}"
        if passed:
            logger.info(f"rfa_fairseq: Triton self-check of {where}: passed, {difference} (tolerance {bound:.0e}), "
                        f"{milliseconds:.0f} ms")
        else:
            logger.warning(f"rfa_fairseq: Triton self-check failed: {where} ({versions()}) disagrees with the torch "
                           f"path: {difference} (tolerance {bound:.0e}); the torch path runs it for the rest of "
                           f"this process (checked in {milliseconds:.0f} ms)")
        return passed

    def _record(self, key, outcome, error, worst, bound, milliseconds) -> CheckRecord:
        kernel, device, dtypes, variant = key
        record = CheckRecord(kernel, device_label(torch.device(device)), _dtypes_label(dtypes), variant.describe(),
                             outcome, error, worst, bound, milliseconds)
        self.records.append(record)
        return record


_process_trust = TritonTrust()


def current() -> TritonTrust:
    """The process's TritonTrust (or a test's, inside `installed`)."""
    return _process_trust


@contextlib.contextmanager
def installed(trust: TritonTrust) -> Iterator[TritonTrust]:
    """The seam for tests: `trust` decides inside the block, then the process's verdicts again."""
    global _process_trust
    previous, _process_trust = _process_trust, trust
    try:
        yield trust
    finally:
        _process_trust = previous


def checks() -> List[CheckRecord]:
    """The checks this process ran or skipped, in order."""
    return list(current().records)


def set_step_self_check(device, enabled: bool) -> None:
    """Whether the decoding step's Triton kernel is checked on `device` (--rfa-triton-self-check of the decoder that
    decodes there: the step's calls take no options)."""
    unchecked = current().unchecked_steps
    (unchecked.discard if enabled else unchecked.add)(device_key(device))


@contextlib.contextmanager
def _checking(device: torch.device):
    """The check's context: no autocast (the inputs' dtypes as the call's), fp32 products in full precision on the
    torch side (a process that allows TF32 would otherwise blur the reference)."""
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        with torch.autocast(device.type, enabled=False):
            yield
    finally:
        torch.set_float32_matmul_precision(precision)


def _worst(pairs) -> Tuple[str, float]:
    """(name, error) of the pair (name, got, want) whose relative_error is largest (NaN counts as largest)."""
    errors = [(name, relative_error(got, want)) for name, got, want in pairs]
    return max(errors, key=lambda item: math.inf if math.isnan(item[1]) else item[1])


def _random(generator, *shape, device, dtype, kind=torch.rand):
    return kind(*shape, generator=generator).to(device=device, dtype=dtype)


# ---------------------------------------------------------------- causal RFA over sequences (triton_chunk)


@dataclass(frozen=True)
class SequenceVariant:
    """What selects the chunked kernels' compiled code for a call."""

    gated: bool
    initial_state: bool
    training: bool  # gradients: the backward's two kernels run too
    state_grad: bool
    features: int
    head_dim: int
    chunk: int  # the kernels' positions per chunk: 16 for calls of <= 16 positions, else 32

    def describe(self) -> str:
        grads = "inference"
        if self.training:
            grads = "training (gradients, the state's too)" if self.state_grad else "training (gradients)"
        state = "an initial state" if self.initial_state else "no initial state"
        return (f"{'gated' if self.gated else 'ungated'}, {state}, {grads}, F={self.features} d={self.head_dim}, "
                f"chunks of {self.chunk}")


def causal_rfa(phi_q, phi_k, v, log_gate=None, state=None, *, chunk_size: int, eps: float = DENOMINATOR_EPS,
               self_check: bool = True):
    """causal_rfa_triton where the kernels are trusted for this call's variant on its device (checked now if not
    yet, unless self_check is off), else causal_rfa_chunked: kernel_choice.causal_rfa's Triton side (its contract)."""
    inputs = (phi_q, phi_k, v, log_gate, state)
    training = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in inputs)
    variant = SequenceVariant(log_gate is not None, state is not None, training,
                              training and state is not None and state.requires_grad, phi_q.size(-1), v.size(-1),
                              kernels("triton_chunk").chunk_positions(phi_q.size(2)))
    dtypes = tuple(x.dtype if x is not None else None for x in inputs)
    trust = current()
    if trust.trusted("causal_rfa", phi_q.device, dtypes, variant, SEQUENCE_TOLERANCES,
                     lambda: _check_sequence(trust.source, variant, dtypes, phi_q.device, chunk_size, eps), self_check):
        return trust.source.causal_rfa(phi_q, phi_k, v, log_gate, state, eps)
    return causal_rfa_chunked(phi_q, phi_k, v, log_gate, state, chunk_size=chunk_size, eps=eps)


def _check_sequence(source, variant: SequenceVariant, dtypes, device, chunk_size, eps) -> Tuple[str, float]:
    """The kernels beside causal_rfa_chunked on 2 sentences x 2 heads of a few positions past one chunk (inside the
    16-position chunk for that variant), the second right-padded as gate_keys pads: outputs, final states and, in
    training, every input's gradient."""
    g = torch.Generator().manual_seed(CHECK_SEED)
    B, H, F_, D = 2, 2, variant.features, variant.head_dim
    T = variant.chunk + 5 if variant.chunk > 16 else variant.chunk - 3
    q_dtype, k_dtype, v_dtype, g_dtype, s_dtype = dtypes
    pad = torch.zeros(B, 1, T, 1, dtype=torch.bool)
    pad[1, :, T - T // 5:] = True
    inputs = {
        "phi_q": _random(g, B, H, T, F_, device=device, dtype=q_dtype) * F_ ** -0.5,  # healthy denominators
        "phi_k": (_random(g, B, H, T, F_, device=device, dtype=k_dtype) * F_ ** -0.5).masked_fill(pad.to(device), 0),
        "v": _random(g, B, H, T, D, device=device, dtype=v_dtype, kind=torch.randn),
    }
    if variant.gated:
        logits = 2 * torch.randn(B, H, T, generator=g)
        inputs["log_gate"] = F.logsigmoid(logits).masked_fill(pad[..., 0], 0.0).to(device=device, dtype=g_dtype)
    if variant.initial_state:
        inputs["state"] = _random(g, B, H, F_, D + 1, device=device, dtype=s_dtype)
    upstream = _random(g, B, H, T, D, device=device, dtype=torch.float32, kind=torch.randn)
    names = [name for name in inputs if variant.training and (name != "state" or variant.state_grad)]
    results = []
    with _checking(device), torch.set_grad_enabled(variant.training):
        for run in (source.causal_rfa, lambda *args: causal_rfa_chunked(*args[:5], chunk_size=chunk_size, eps=eps)):
            leaves = {name: x.detach().requires_grad_(name in names) for name, x in inputs.items()}
            out, final = run(leaves["phi_q"], leaves["phi_k"], leaves["v"], leaves.get("log_gate"), leaves.get("state"),
                             eps)
            grads = torch.autograd.grad((out * upstream).sum(), [leaves[n] for n in names]) if names else ()
            results.append([out.detach(), final.detach(), *grads])
    return _worst(zip(["out", "final state"] + [f"d_{n}" for n in names], *results))


# ---------------------------------------------------------------- the decoding step's causal layer (triton_step)


@dataclass(frozen=True)
class StepVariant:
    """What selects the step kernel's compiled code for a call."""

    activation: Optional[str]
    gated: bool
    padded: bool
    carried: bool  # a state read (not the first step)
    ordered: bool  # through a beam order
    width: int  # phi_q's columns per head
    features: int
    head_dim: int

    def describe(self) -> str:
        parts = [self.activation or "features", "gated" if self.gated else "ungated"]
        parts += ["padded keys"] if self.padded else []
        parts += ["carried state" + (" through a beam order" if self.ordered else "") if self.carried else "first step"]
        return ", ".join(parts) + f", W={self.width} F={self.features} d={self.head_dim}"


def causal_layer_step(phi_q, phi_k, v, gate_logits, key_pad, state_in, order, state_out, eps: float,
                      activation: Optional[str] = None) -> Tensor:
    """TorchKernels.causal_layer_step's contract (ops/step.py): the Triton launch where it is trusted for this
    call's variant on its device (checked now if not yet), else TorchKernels'."""
    H, F_, D1 = state_out.shape[1:]
    variant = StepVariant(activation, gate_logits is not None, key_pad is not None, state_in is not None,
                          state_in is not None and order is not None, phi_q.size(1) // H, F_, D1 - 1)
    dtypes = (phi_q.dtype, v.dtype, gate_logits.dtype if gate_logits is not None else None, state_out.dtype)
    trust = current()
    device = v.device
    if trust.trusted("causal_layer_step", device, dtypes, variant, STEP_TOLERANCES,
                     lambda: _check_step(trust.source, variant, dtypes, device, eps),
                     device_key(device) not in trust.unchecked_steps):
        return trust.source.causal_layer_step(phi_q, phi_k, v, gate_logits, key_pad, state_in, order, state_out, eps,
                                              activation)
    from ..ops.step import TORCH_KERNELS

    return TORCH_KERNELS.causal_layer_step(phi_q, phi_k, v, gate_logits, key_pad, state_in, order, state_out, eps,
                                           activation)


def _check_step(source, variant: StepVariant, dtypes, device, eps) -> Tuple[str, float]:
    """The kernel beside TorchKernels.causal_layer_step on 4 rows x 2 heads (the second row padded where the call
    pads), reading a state of 6 rows through a beam order that repeats a row where the call has one: the output and
    the state written."""
    from ..ops.step import TORCH_KERNELS

    g = torch.Generator().manual_seed(CHECK_SEED)
    R, H, W, F_, D = 4, 2, variant.width, variant.features, variant.head_dim
    phi_dtype, v_dtype, gate_dtype, state_dtype = dtypes
    if variant.activation is None:  # the features themselves: positive, as the maps give them
        phi = _random(g, R, 2 * H * W, device=device, dtype=phi_dtype) * W ** -0.5
    else:  # a learned map's pre-activations
        phi = _random(g, R, 2 * H * W, device=device, dtype=phi_dtype, kind=torch.randn)
    q, k = phi[:, : H * W], phi[:, H * W:]  # views of one tensor, as of the step's projection
    v = _random(g, R, H * D, device=device, dtype=v_dtype, kind=torch.randn)
    gate = _random(g, R, H, device=device, dtype=gate_dtype, kind=torch.randn) if variant.gated else None
    key_pad = torch.tensor([False, True, False, False], device=device) if variant.padded else None
    state_in = _random(g, R + 2, H, F_, D + 1, device=device, dtype=state_dtype) if variant.carried else None
    order = torch.tensor([5, 0, 0, 2], device=device) if variant.ordered else None
    results = []
    with _checking(device), torch.no_grad():
        for step in (source.causal_layer_step, TORCH_KERNELS.causal_layer_step):
            state_out = torch.full((R, H, F_, D + 1), math.nan, device=device, dtype=state_dtype)
            out = step(q, k, v, gate, key_pad, state_in, order, state_out, eps, variant.activation)
            results.append((out, state_out))
    return _worst(zip(["out", "state"], *results))
