#!/usr/bin/env python3
"""The linear layers of few rows (cpu/csrc/levels/level_kernels.cpp) against oneDNN's, at every instruction-set level
this CPU runs, on the products of one decoding step at Multi30k dimensions (C = 256, FFN 1,024, the default D = 32's
fused input projection of 516 columns, V = 7,997), at each --rows (a sentence's beam is 4 rows; a source sentence in
the encoder ~14), and the few-rows limit the runtime measures for each product at that level
(cpu/few_rows_limits.py, the rows up to which it takes the kernel).

Each level runs in a process of its own with oneDNN capped to the level (ONEDNN_MAX_CPU_ISA; torch's own operators
too, ATEN_CPU_CAPABILITY): what a CPU of that level would run. Both products through the library's own entry
(`LinearLibrary.linear`: int8 includes quantizing the input rows), the few-rows kernel (its limit set above the rows)
and oneDNN (limit 0) on the same packed layer; best of 5 x 200 calls after 20 warm-up calls, one thread.

    python benchmarks/benchmark_few_rows.py                       # every level -> benchmarks/results/few_rows_cpu.csv
    python benchmarks/benchmark_few_rows.py --levels avx2 --csv FILE
"""
import argparse
import json
import os
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmark_common import cpu_isa_environment, machine_description, write_csv  # noqa: E402

SHAPES = [(256, 516), (256, 256), (256, 1024), (1024, 256), (256, 7997)]  # (in, out)


def best_us(fn, calls=200, repeats=5, warmup=20):
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def measure_level(level, rows_list):
    """The rows of one level (this process runs capped to it)."""
    from rfa_fairseq import torch_internals
    from rfa_fairseq.cpu import few_rows_limits
    from rfa_fairseq.cpu.native import OneDNNInt8Linear, OneDNNLinear
    from rfa_fairseq.cpu.extension import require_fused_extension

    ext = require_fused_extension()
    torch.set_num_threads(1)
    machine = machine_description("cpu")
    out = []
    for precision, packer_class in (("fp32", OneDNNLinear), ("int8", OneDNNInt8Linear)):
        library = ext.LinearLibrary(packer_class.code, torch_internals.onednn_operators(), level)
        packer = packer_class(library)
        gen = torch.Generator().manual_seed(0)
        for cin, cout in SHAPES:
            weight, bias = torch.randn(cout, cin, generator=gen) * 0.05, torch.randn(cout, generator=gen)
            packed = packer.pack_linear(weight, bias)
            limit = few_rows_limits.measure_limit(library, packed)
            for rows in rows_list:
                x = torch.randn(rows, cin, generator=gen)
                times = {}
                for name, rows_limit in (("onednn", 0), ("few_rows", rows)):
                    library.set_few_rows_limit(cin, cout, rows_limit)
                    times[name] = best_us(lambda: library.linear(packed, x))
                row = dict(level=level, precision=precision, in_features=cin, out_features=cout, rows=rows,
                           onednn_us=f"{times['onednn']:.2f}", few_rows_us=f"{times['few_rows']:.2f}",
                           speedup=f"{times['onednn'] / times['few_rows']:.2f}", measured_limit=limit,
                           onednn_isa=os.environ.get("ONEDNN_MAX_CPU_ISA", "(the CPU's)"), machine=machine,
                           torch=torch.__version__)
                out.append(row)
                print(f"{level:12s} {precision} {cin:5d} -> {cout:5d}  rows {rows:4d}: oneDNN {times['onednn']:8.1f} us"
                      f"  few rows {times['few_rows']:8.1f} us  x{row['speedup']}  (limit {limit})", flush=True)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64, 128])
    p.add_argument("--levels", nargs="+", default=None, help="default: every level this CPU runs")
    p.add_argument("--csv", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "few_rows_cpu.csv"))
    p.add_argument("--one-level", help=argparse.SUPPRESS)  # a child: measure this level, print its rows as JSON
    args = p.parse_args()
    if args.one_level:
        print("ROWS " + json.dumps(measure_level(args.one_level, args.rows)))
        return
    from rfa_fairseq.cpu.extension import require_fused_extension

    levels = args.levels or require_fused_extension().runnable_cpu_levels()
    out = []
    for level in levels:
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--one-level", level, "--rows",
                               *map(str, args.rows)], env=cpu_isa_environment(level, dict(os.environ)),
                              stdout=subprocess.PIPE, text=True)
        if proc.returncode != 0:
            sys.exit(f"benchmark_few_rows: the {level} level's run failed ({proc.returncode})")
        rows = next(line for line in proc.stdout.splitlines() if line.startswith("ROWS "))
        out.extend(json.loads(rows[len("ROWS "):]))
        print("\n".join(line for line in proc.stdout.splitlines() if not line.startswith("ROWS ")))
    write_csv(args.csv, out)
    print(f"wrote {args.csv}")


if __name__ == "__main__":
    main()
