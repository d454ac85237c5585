#!/usr/bin/env python3
"""Compile flash-linear-attention's kernels for RFA's shapes in parallel, before anything else runs.

fla autotunes its chunked kernels over up to 48 Triton configurations each, compiled one
after the other on first use: minutes for one set of shapes. Here N processes each compile a
slice of every autotuner's configurations (same kernels, same shapes, so the same Triton
cache entries); later processes then find every binary in Triton's on-disk cache and only
time the configurations. The slices' own timings are cached under keys of their slice and
never reused, so the final autotuning is the same as without this warm-up.

    python3 benchmarks/gpu/warm_fla.py --workers 12 --heads 8 --features 128 --head-dim 64
"""
import argparse
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FLA_MODULES = ("fla.ops.common.chunk_h", "fla.ops.common.chunk_o", "fla.ops.utils.cumsum", "fla.ops.common.fused_recurrent")


def autotuners(module):
    """The autotuners of a module's kernels (under triton.heuristics wrappers too)."""
    found = []
    for value in vars(module).values():
        while value is not None and not hasattr(value, "configs"):
            value = getattr(value, "fn", None)
        if value is not None and isinstance(getattr(value, "configs", None), list) and value not in found:
            found.append(value)
    return found


def worker(args) -> None:
    import importlib

    import torch

    sys.path.insert(0, REPO)
    from rfa_fairseq.ops import causal_rfa_fla, causal_rfa_step_fla, fla_import_error

    if fla_import_error():
        raise SystemExit(f"fla does not import: {fla_import_error()}")
    for name in FLA_MODULES:
        for tuner in autotuners(importlib.import_module(name)):
            tuner.configs = config_slice(tuner.configs, args.index, args.workers)
    B, T, H, F_, d = 2, 200, args.heads, args.features, args.head_dim
    failures = 0
    for gated in (False, True):
        try:
            q, k = (torch.rand(B, H, T, F_, device="cuda", requires_grad=True) for _ in range(2))
            v = torch.randn(B, H, T, d, device="cuda", requires_grad=True)
            log_gate = -torch.rand(B, H, T, device="cuda", requires_grad=True) if gated else None
            out, state = causal_rfa_fla(q, k, v, log_gate)
            (out.sum() + state.sum()).backward()
            with torch.no_grad():
                step = [x[:, :, :1].detach() for x in (q, k, v)]
                causal_rfa_step_fla(*step, log_gate[:, :, :1].detach() if gated else None, state.detach())
            torch.cuda.synchronize()
        except Exception as error:  # a slice that cannot run: the later processes compile what is missing
            failures += 1
            print(f"worker {args.index}, gated={gated}: {type(error).__name__}: {error}", flush=True)
    if failures == 2:
        raise SystemExit(1)


def config_slice(configs, index: int, workers: int):
    """This worker's share of an autotuner's configurations. At least two whenever there are two:
    Triton's autotuner skips a configuration that fails to compile or launch only when it has a
    choice; with one it runs it unguarded."""
    if len(configs) < 2:
        return configs
    if len(configs) >= 2 * workers:
        return configs[index::workers]
    return [configs[(2 * index) % len(configs)], configs[(2 * index + 1) % len(configs)]]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=max(1, min(12, (os.cpu_count() or 2) - 2)))
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--features", type=int, default=128)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--index", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.index is not None:
        worker(args)
        return 0
    start = time.time()
    cmd = [sys.executable, os.path.abspath(__file__), "--workers", str(args.workers), "--heads", str(args.heads),
           "--features", str(args.features), "--head-dim", str(args.head_dim)]
    procs = [subprocess.Popen(cmd + ["--index", str(i)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(args.workers)]
    failed = 0
    for i, proc in enumerate(procs):
        output, _ = proc.communicate()
        if proc.returncode != 0:
            failed += 1
            print(f"warm_fla worker {i} failed ({proc.returncode}):\n{output[-2000:]}", flush=True)
    print(f"warm_fla: {args.workers - failed}/{args.workers} workers compiled their slices in {time.time() - start:.0f} s",
          flush=True)
    return 1 if failed == args.workers else 0


if __name__ == "__main__":
    sys.exit(main())
