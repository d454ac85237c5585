#!/usr/bin/env python3
"""The lever "store the causal state in bf16 between steps": the C++ causal step over three layers' states (the
default model's shape: 4 heads, F = 64 features, head dim 64) in fp32 and in bf16 (each state row rounded to bf16
when written, read back into fp32; the update and read-out in fp32), at the rows of a batch of 32 and 128
sentences x beam 4, one thread, with a random beam order. Writes benchmarks/results/state_dtype_cpu.csv.

    python benchmarks/benchmark_state_dtype.py
"""
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmark_common import REPO, machine_description, write_csv  # noqa: E402

sys.path.insert(0, REPO)


def main() -> int:
    from rfa_fairseq.ops import load_fused_extension

    torch.set_num_threads(1)
    ext = load_fused_extension()
    if ext is None:
        sys.exit("benchmark_state_dtype: the C++ kernels cannot be built here")
    none = torch.empty(0)
    rows = []
    for R in (128, 512):
        H, F, d = 4, 64, 64
        g = torch.Generator().manual_seed(0)
        pq, pk = torch.randn(R, H * 32, generator=g), torch.randn(R, H * 32, generator=g)
        v, gate, out = torch.randn(R, H * d, generator=g), torch.randn(R, H, generator=g), torch.empty(R, H * d)
        order = torch.randperm(R, generator=g)
        for dtype in (torch.float32, torch.bfloat16):
            states = [[torch.rand(R, H, F, d + 1, generator=g).to(dtype) for _ in range(2)] for _ in range(3)]

            def step():
                for state_in, state_out in states:
                    ext.causal_layer_step(pq, pk, v, gate, none, state_in, order, state_out, out, 1e-30,
                                          ext.activations["hedgehog"], none, none)

            for _ in range(10):
                step()
            best = float("inf")
            for _ in range(5):
                start = time.perf_counter()
                for _ in range(100):
                    step()
                best = min(best, (time.perf_counter() - start) / 100)
            rows.append({"rows": R, "state_dtype": str(dtype).replace("torch.", ""), "ms_three_layers": f"{1e3 * best:.3f}",
                         "state_mb": f"{sum(s[0].numel() * s[0].element_size() for s in states) / 2**20:.1f}",
                         "machine": machine_description("cpu"), "torch": torch.__version__})
            print(rows[-1], flush=True)
    path = os.path.join(REPO, "benchmarks", "results", "state_dtype_cpu.csv")
    write_csv(path, rows)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
