"""The CUDA step's kernel set: `TritonKernels`, the torch step (ops/step.py) with each causal layer's update one
Triton launch (gpu/triton_step.py, trusted after its self-check: gpu/triton_self_check.py) instead of 16 torch kernels:
the step's CUDA graph has that many fewer nodes per layer."""
from ..ops.step import TorchKernels
from .triton_support import kernels as triton_kernels


class TritonKernels(TorchKernels):
    """TorchKernels whose causal layer step is one Triton launch (triton_step.py): CUDA."""

    name = "triton"

    @staticmethod
    def causal_layer_step(phi_q, phi_k, v, gate_logits, key_pad, state_in, order, state_out, eps, activation=None):
        return triton_kernels("triton_step").causal_layer_step(phi_q, phi_k, v, gate_logits, key_pad, state_in, order,
                                                                state_out, eps, activation)


TRITON_KERNELS = TritonKernels()
