#!/usr/bin/env python3
"""The linear layers of few rows (ops/csrc/few_rows.cpp, AVX-512; int8 on VNNI) against oneDNN's, on the products of
one decoding step at Multi30k dimensions (C = 256, FFN 1,024, the default D = 32's fused input projection of 516
columns, V = 7,997), at each --rows (a sentence's beam is 4 rows; a source sentence in the encoder ~14): where the
C++ LinearLibrary's threshold (decode_program.cpp, LinearLibrary::few_rows) comes from.

Both run through the library's own entry (`LinearLibrary.linear`: int8 includes quantizing the input rows), the
few-rows kernel on the same packed layer, oneDNN on it without its few-rows blocks; best of 5 x 300 calls after 20
warm-up calls, one thread.

    python benchmarks/benchmark_few_rows.py    # -> benchmarks/results/few_rows_cpu.csv
"""
import argparse
import dataclasses
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmark_common import machine_description, write_csv  # noqa: E402

SHAPES = [(256, 516), (256, 256), (256, 1024), (1024, 256), (256, 7997)]  # (in, out)


def best_us(fn, calls=300, repeats=5, warmup=20):
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64, 128])
    p.add_argument("--csv", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "few_rows_cpu.csv"))
    args = p.parse_args()
    from rfa_fairseq import torch_internals
    from rfa_fairseq.ops.decode_step import OneDNNInt8Linear, OneDNNLinear
    from rfa_fairseq.ops.extension import require_fused_extension

    ext = require_fused_extension()
    torch.set_num_threads(1)
    machine = machine_description("cpu")
    out = []
    for precision, library_class, code in (("fp32", OneDNNLinear, "onednn"), ("int8", OneDNNInt8Linear, "onednn_int8")):
        if not ext.few_rows_available(int8=precision == "int8"):
            print(f"benchmark_few_rows: no few-rows kernel for {precision} on this CPU (AVX-512{' VNNI' if precision == 'int8' else ''})")
            continue
        library = ext.LinearLibrary(code, torch_internals.onednn_operators())
        gen = torch.Generator().manual_seed(0)
        for cin, cout in SHAPES:
            weight, bias = torch.randn(cout, cin, generator=gen) * 0.05, torch.randn(cout, generator=gen)
            packed = library_class(ext).pack_linear(weight, bias)
            plain = dataclasses.replace(packed, rows_weight=None, rows_sums=None)
            for rows in args.rows:
                x = torch.randn(rows, cin, generator=gen)
                times = {}
                for name, layer in (("onednn", plain), ("few_rows", packed)):
                    if name == "few_rows" and rows > 8 and not (rows <= 32 and cout <= 1024):  # the library takes oneDNN there (LinearLibrary::few_rows): the kernel itself
                        y = torch.empty(rows, cout)
                        if precision == "fp32":
                            call = lambda: ext.few_rows_linear_fp32(x, packed.rows_weight, bias, None, False, y)  # noqa: E731
                        else:
                            codes, scales = torch.empty(rows, cin, dtype=torch.uint8), torch.empty(rows)

                            def call():
                                ext.quantize_rows(x, codes, scales)
                                ext.few_rows_linear_int8(codes, scales, packed.rows_weight, packed.rows_sums,
                                                         packed.w_scales, packed.bias, None, False, y)
                    else:
                        call = (lambda layer=layer: library.linear(layer, x))  # noqa: E731
                    times[name] = best_us(call)
                row = dict(precision=precision, in_features=cin, out_features=cout, rows=rows,
                           onednn_us=f"{times['onednn']:.2f}", few_rows_us=f"{times['few_rows']:.2f}",
                           speedup=f"{times['onednn'] / times['few_rows']:.2f}", machine=machine,
                           torch=torch.__version__)
                out.append(row)
                print(f"{precision} {cin:5d} -> {cout:5d}  rows {rows:4d}: oneDNN {times['onednn']:8.1f} us  "
                      f"few rows {times['few_rows']:8.1f} us  x{row['speedup']}")
    write_csv(args.csv, out)
    print(f"wrote {args.csv}")


if __name__ == "__main__":
    main()
