"""Compile every Triton kernel of the CUDA path for a GPU architecture without a GPU (Triton's own ptxas), in the
variants the model launches: the chunked kernels for each chunk size, gated or not, with or without an initial
state, fp16 values; the decoding step's kernel for each feature map's activation, gated or not, first step or not.
Prints one line per variant with its registers and spill bytes (cuobjdump's resource usage) and exits non-zero on
the first kernel that does not compile. Run without TRITON_INTERPRET (tests/test_triton_kernels.py runs it so).

    python tests/triton_aot.py --arch 90
"""
import argparse
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

POINTERS_CHUNK = {"Q", "K", "V", "G", "S0", "O", "DEN", "SF", "DO", "DQ", "DK", "DV", "DAQ", "DG", "DS0"}
POINTERS_STEP = {"PQ": "*fp16", "PK": "*fp16", "V": "*fp16", "GATE": "*fp16", "PAD": "*i1", "S_IN": "*fp32",
                 "ORDER": "*i64", "S_OUT": "*fp32", "OUT": "*fp16"}


def signature(fn, constants, pointer_type):
    return {name: "constexpr" if name in constants else pointer_type(name) or ("fp32" if name in ("eps", "relu_scale") else "i32")
            for name in fn.arg_names}


def resource_usage(kernel) -> str:
    """'REG:n STACK:n ...' of a compiled kernel (cuobjdump, shipped with Triton's NVIDIA backend), or ''."""
    import triton

    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if "cubin" not in kernel.asm or not os.path.exists(cuobjdump):
        return ""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        out = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    return next((line.split("Resource usage:")[-1].strip() for line in out.splitlines() if "REG:" in line), "")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: Hopper)")
    args = p.parse_args()
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("triton_aot.py: unset TRITON_INTERPRET (interpreted kernels cannot be compiled)")
    import triton
    from triton.backends.compiler import GPUTarget

    from rfa_fairseq.gpu import triton_chunk, triton_step

    target = GPUTarget("cuda", args.arch, 32)
    variants = []
    for BT in (16, triton_chunk.MAX_CHUNK):
        for gated in (True, False):
            for initial in (True, False):
                shared = dict(F=64, D=64, BT=BT, BF=64, BD=64, GATED=gated)
                absent = {} if gated else {"G": None, "DAQ": None, "DG": None}
                for grad in (False, True):  # the forward pass; the backward's forward sweep (dq)
                    unused = {"DO": None, "DQ": None, "DAQ": None} if not grad else {"SF": None}
                    variants.append((triton_chunk.chunk_forward, {**shared, "HAS_S0": initial, "GRAD": grad, **absent,
                                                                  **unused, **({} if initial else {"S0": None})}, 8))
                variants.append((triton_chunk.chunk_bwd_dkv, {**shared, "S0_GRAD": initial, **absent,
                                                              **({} if initial else {"DS0": None})}, 8))
    for activation, W in ((1, 32), (2, 64), (0, 64)):
        for gated in (True, False):
            for first in (True, False):
                constants = dict(W=W, F=2 * W if activation == 1 else W, D=64, BW=W, BD=64, ACTIVATION=activation,
                                 GATED=gated, HAS_PAD=False, HAS_STATE=not first, HAS_ORDER=not first, PAD=None)
                constants.update({} if gated else {"GATE": None})
                constants.update({"S_IN": None, "ORDER": None} if first else {})
                variants.append((triton_step.causal_step_kernel, constants, 2))
    for fn, constants, num_warps in variants:
        constants = {name: value for name, value in constants.items() if name in fn.arg_names}
        if fn is triton_step.causal_step_kernel:
            types = dict(POINTERS_STEP, **({"PQ": "*fp32", "PK": "*fp32"} if constants["ACTIVATION"] == 0 else {}))
            pointer_type = types.get
        else:
            pointer_type = lambda name: ("*fp16" if name in ("V", "DV") else "*fp32") if name in POINTERS_CHUNK else None  # noqa: E731
        source = triton.compiler.ASTSource(fn=fn, signature=signature(fn, constants, pointer_type), constexprs=constants)
        try:
            kernel = triton.compile(source, target=target, options={"num_warps": num_warps})
        except Exception as error:
            print(f"{fn.__name__} {constants}: does not compile for sm_{args.arch}: {error}", flush=True)
            return 1
        shown = {k: v for k, v in constants.items()
                 if k in ("BT", "GATED", "HAS_S0", "GRAD", "S0_GRAD", "ACTIVATION", "HAS_STATE")}
        print(f"{fn.__name__} {shown}: {resource_usage(kernel)}", flush=True)
    print(f"triton_aot.py: {len(variants)} kernels compiled for sm_{args.arch} with Triton {triton.__version__}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
