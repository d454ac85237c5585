"""The GPU kernels: the plugin's Triton kernels of causal RFA over sequences (triton_chunk.py) and of the decoding
step's causal layer (triton_step.py), whether Triton runs (triton_support.py), the self-check that trusts a kernel on
the user's device (triton_self_check.py), and the CUDA step's kernel set (step.py)."""
