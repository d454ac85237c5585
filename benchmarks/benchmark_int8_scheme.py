#!/usr/bin/env python3
"""The lever "CTranslate2's int8 activation scheme": the int8 linear layer with each input row quantized to 7-bit codes
(zero point 64, the default) or to 8-bit codes with a +128 shift (zero point 128, oneDNN's compensation for it),
on the default model's step shapes at 128 rows (a batch of 32 sentences x beam 4), one thread: time, and the
relative error against fp32 on random inputs. Quality on real data: benchmarks/int8_quality.py --precision int8_u8.
Writes benchmarks/results/int8_scheme_cpu.csv.

    python benchmarks/benchmark_int8_scheme.py
"""
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmark_common import REPO, machine_description, write_csv  # noqa: E402

sys.path.insert(0, REPO)


def main() -> int:
    from rfa_fairseq.ops.decode_step import OneDNNInt8Linear
    from rfa_fairseq.ops import load_fused_extension

    torch.set_num_threads(1)
    ext = load_fused_extension()
    if ext is None:
        sys.exit("benchmark_int8_scheme: the C++ kernels cannot be built here")
    g = torch.Generator().manual_seed(0)
    rows = []
    for inputs, outputs in ((256, 516), (256, 256), (256, 1024), (1024, 256), (256, 8001)):
        x = torch.randn(128, inputs, generator=g) * (1 + 3 * torch.rand(128, 1, generator=g))
        if inputs == 1024:
            x = x.relu()  # fc2's input, after relu
        w, b = torch.randn(outputs, inputs, generator=g) * 0.05, torch.randn(outputs, generator=g)
        want = torch.addmm(b, x, w.t())
        for zero_point in (64, 128):
            library = OneDNNInt8Linear(ext, zero_point)
            packed = library.pack_linear(w, b)
            got = library.linear(x, packed)
            for _ in range(10):
                library.linear(x, packed)
            best = float("inf")
            for _ in range(5):
                start = time.perf_counter()
                for _ in range(50):
                    library.linear(x, packed)
                best = min(best, (time.perf_counter() - start) / 50)
            rows.append({"shape": f"{inputs}->{outputs}", "rows": 128, "zero_point": zero_point,
                         "codes": "7-bit" if zero_point == 64 else "8-bit, +128 shift", "ms": f"{1e3 * best:.3f}",
                         "relative_error": f"{((got - want).norm() / want.norm()).item():.4f}",
                         "machine": machine_description("cpu"), "torch": torch.__version__})
            print(rows[-1], flush=True)
    path = os.path.join(REPO, "benchmarks", "results", "int8_scheme_cpu.csv")
    write_csv(path, rows)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
