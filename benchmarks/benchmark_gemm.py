#!/usr/bin/env python3
"""The CPU GEMM libraries, on the matrix products of one decoding step: the plugin's own linear layers (the weights
kept once, in its kernels' blocks) against those torch offers.

One step of the default rfa_transformer (D = 32, hedgehog, gated: the fused input projection gives 2 x H x 32 feature
pre-activations + C values + H gate logits) at --size: recipe (Multi30k: 3 layers, C = 256, FFN 1,024, 4 heads,
V = 7,997), base (6 layers, 512, 2,048, 8 heads, V = 32,004) or big (6 layers, 1,024, 4,096, 16 heads, V = 32,004),
is per layer the fused input projection, the self-attention output, the cross-attention query and output, fc1 and
fc2, then the vocabulary projection. Each library runs all of them at each --rows (batch x beam), the best of
--repeats after a warm-up, the libraries in turn per product:

    rfa          the plugin's fp32 linear layers (cpu/native.py: the level's kernels on its blocks): what decodes
    rfa_int8     the same in int8 (--rfa-decode-precision int8), the input rows quantized at each product
    addmm        torch.addmm(b, x, W^T, out=...): torch's BLAS (MKL in the pinned wheel)
    mkl_packed   MKL's packed GEMM (torch.ops.mkl._mkl_linear on cblas-packed weights)
    onednn       oneDNN's linear on weights packed once into its own blocked layout (torch.ops.mkldnn): what the
                 decoding step ran on before its weights were kept once

    python benchmarks/benchmark_gemm.py --size recipe --threads 1 2   # -> benchmarks/results/gemm_step_shapes_cpu_recipe.csv
    python benchmarks/benchmark_gemm.py --size recipe --cpu-isa avx2 --csv FILE   # every library capped to AVX2
"""
import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmark_common import ISA_CAPS, cpu_isa_environment, machine_description, write_csv  # noqa: E402


# size -> (layers, C, FFN, heads, vocabulary)
SIZES = {"recipe": (3, 256, 1024, 4, 7997), "base": (6, 512, 2048, 8, 32004), "big": (6, 1024, 4096, 16, 32004)}


def step_shapes(size="recipe", features=32):
    """(in, out) of the decoding step's products at a size (the default model: D features per head, gated)."""
    layers, embed, ffn, heads, vocab = SIZES[size]
    proj = 2 * heads * features + embed + heads
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


def plugin_kernels(cpu_isa="auto"):
    """The plugin's fp32 and int8 kernel sets (cpu/native.py) at a level (--rfa-cpu-isa's values), or {} where its
    C++ module does not load."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from rfa_fairseq.cpu.extension import load_fused_extension
    from rfa_fairseq.cpu.native import native_kernels

    ext = load_fused_extension()
    if ext is None:
        print("benchmark_gemm: the plugin's C++ module does not load: its rows are left out")
        return {}
    return {name: native_kernels(ext, precision, torch.float16, cpu_isa)
            for name, precision in (("rfa", "fp32"), ("rfa_int8", "int8"))}


def library_calls(x, weight, bias, rows, plugin):
    """{library: a call computing x W^T + b}."""
    out = torch.empty(rows, weight.size(0))
    weight_t = weight.t()
    calls = {}
    for name, kernels in plugin.items():
        packed = kernels.pack_linear(weight, bias)
        calls[name] = (lambda k, p: lambda: k.linear(x, p))(kernels, packed)
    calls["addmm"] = lambda: torch.addmm(bias, x, weight_t, out=out)
    if torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear"):
        packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, rows)
        calls["mkl_packed"] = lambda: torch.ops.mkl._mkl_linear(x, packed, weight, bias, rows)
    if torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        packed_dnn = torch.ops.mkldnn._reorder_linear_weight(weight, rows)
        calls["onednn"] = lambda: torch.ops.mkldnn._linear_pointwise(x, packed_dnn, bias, "none", [], "")
    return calls


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=sorted(SIZES), default="recipe")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--rows", type=int, nargs="+", default=[4, 32, 128, 512])
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--csv", default=None, help="default: benchmarks/results/gemm_step_shapes_cpu_<size>.csv")
    p.add_argument("--cpu-isa", default="", choices=["", *ISA_CAPS],
                   help="every library capped at this instruction-set level: the plugin's kernels at it, oneDNN, "
                        "MKL and torch through their own caps (benchmark_common.ISA_CAPS); default: the CPU's own")
    args = p.parse_args()
    if args.cpu_isa and os.environ.get("RFA_GEMM_CAPPED") != args.cpu_isa:  # the caps are read at start: again
        env = cpu_isa_environment(args.cpu_isa, dict(os.environ, RFA_GEMM_CAPPED=args.cpu_isa))
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    args.csv = args.csv or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                        f"gemm_step_shapes_cpu_{args.size}.csv")
    shapes = step_shapes(args.size)
    plugin = plugin_kernels(args.cpu_isa or "auto")
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
                    for library, call in library_calls(x, w, b, rows, plugin).items():
                        totals[library] = totals.get(library, 0.0) + best_ms(call, repeats=args.repeats)
                flops = sum(2 * rows * cin * cout for cin, cout in shapes)
                for library, ms in totals.items():
                    vs_onednn = f"{totals['onednn'] / ms:.2f}" if "onednn" in totals else ""
                    out.append({"size": args.size, "threads": threads, "rows": rows, "library": library,
                                "step_gemm_ms": f"{ms:.3f}", "gflops": f"{flops / ms / 1e6:.1f}",
                                "vs_addmm": f"{totals['addmm'] / ms:.2f}", "vs_onednn": vs_onednn,
                                "cpu_isa": args.cpu_isa or "native", "machine": machine, "torch": torch.__version__})
                    print(f"{args.size} {threads} threads, {rows:4d} rows  {library:10s} {ms:8.3f} ms  "
                          f"{flops / ms / 1e6:6.1f} GFLOP/s  {totals['addmm'] / ms:.2f}x addmm  {vs_onednn}x oneDNN")
    os.makedirs(os.path.dirname(args.csv) or ".", exist_ok=True)
    write_csv(args.csv, out)
    print(f"wrote {args.csv}")


if __name__ == "__main__":
    main()
