#!/usr/bin/env python3
"""The CPU GEMM libraries torch offers, on the matrix products of one decoding step: which is fastest here.

One step of the rfa_transformer at Multi30k dimensions (3 layers, C = 256, FFN 1,024, 4 heads, D = 16, the default
when gemm_step_shapes_cpu.csv was measured: the fused input projection gives 2 x 64 feature pre-activations + 256
values + 4 gate logits = 388 columns; the default D = 32 makes it 516)
is 19 products x W^T + b: per layer the fused input projection, the self-attention output, the cross-attention
query and output, fc1 and fc2, then the vocabulary projection (V = 7,997). Each library runs all 19 at each
--rows (batch x beam), best of 200 after 10 warm-up runs:

    addmm        torch.addmm(b, x, W^T, out=...): torch's BLAS (MKL in the pinned wheel)
    linear       torch.nn.functional.linear: the same BLAS through another entry
    mkl_packed   MKL's packed GEMM (torch.ops.mkl._mkl_linear on cblas-packed weights)
    onednn       oneDNN's linear on weights packed once into its blocked layout (torch.ops.mkldnn): what the
                 decoding step's kernels use on the CPU (cpu/native.py)

    python benchmarks/benchmark_gemm.py --threads 1 2    # -> benchmarks/results/gemm_step_shapes_cpu.csv
"""
import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmark_common import machine_description, write_csv  # noqa: E402


def step_shapes(layers=3, embed=256, ffn=1024, proj=388, vocab=7997):
    """(in, out) of the decoding step's products."""
    per_layer = [(embed, proj), (embed, embed), (embed, embed), (embed, embed), (embed, ffn), (ffn, embed)]
    return per_layer * layers + [(embed, vocab)]


def best_ms(fn, repeats=200, warmup=10):
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def library_calls(x, weight, bias, rows):
    """{library: a call computing x W^T + b}."""
    out = torch.empty(rows, weight.size(0))
    weight_t = weight.t()
    calls = {"addmm": lambda: torch.addmm(bias, x, weight_t, out=out),
             "linear": lambda: torch.nn.functional.linear(x, weight, bias)}
    if torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear"):
        packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, rows)
        calls["mkl_packed"] = lambda: torch.ops.mkl._mkl_linear(x, packed, weight, bias, rows)
    if torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        packed_dnn = torch.ops.mkldnn._reorder_linear_weight(weight, rows)
        calls["onednn"] = lambda: torch.ops.mkldnn._linear_pointwise(x, packed_dnn, bias, "none", [], "")
    return calls


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--rows", type=int, nargs="+", default=[32, 64, 128])
    p.add_argument("--csv", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                 "gemm_step_shapes_cpu.csv"))
    args = p.parse_args()
    shapes = step_shapes()
    machine = machine_description("cpu")
    out = []
    with torch.no_grad():
        for threads in args.threads:
            torch.set_num_threads(threads)
            for rows in args.rows:
                gen = torch.Generator().manual_seed(0)
                totals = {}
                for cin, cout in shapes:
                    x, w, b = (torch.randn(rows, cin, generator=gen), torch.randn(cout, cin, generator=gen),
                               torch.randn(cout, generator=gen))
                    for library, call in library_calls(x, w, b, rows).items():
                        totals[library] = totals.get(library, 0.0) + best_ms(call)
                flops = sum(2 * rows * cin * cout for cin, cout in shapes)
                for library, ms in totals.items():
                    out.append({"threads": threads, "rows": rows, "library": library, "step_gemm_ms": f"{ms:.3f}",
                                "gflops": f"{flops / ms / 1e6:.1f}", "vs_addmm": f"{totals['addmm'] / ms:.2f}",
                                "machine": machine, "torch": torch.__version__})
                    print(f"{threads} threads, {rows:4d} rows  {library:10s} {ms:7.3f} ms  "
                          f"{flops / ms / 1e6:6.1f} GFLOP/s  {totals['addmm'] / ms:.2f}x addmm")
    os.makedirs(os.path.dirname(args.csv) or ".", exist_ok=True)
    write_csv(args.csv, out)
    print(f"wrote {args.csv}")


if __name__ == "__main__":
    main()
