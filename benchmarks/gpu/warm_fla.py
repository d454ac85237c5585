#!/usr/bin/env python3
"""Compile and autotune flash-linear-attention's kernels for RFA's shapes before anything else runs.

fla autotunes its chunked kernels over up to 48 Triton configurations each, and compiles each
one on first use, one after the other: minutes per set of shapes, and again for every
specialization (gated or not, with or without an initial state). Two phases here:

  1. compile: N processes run the same calls, each with a slice of every autotuner's
     configurations, filling Triton's on-disk cache with every binary in parallel (their
     timings are cached under keys of their slice and never reused);
  2. tune: one process runs the calls with all configurations on an otherwise idle GPU:
     binaries come from the cache, and each configuration is timed for 20 ms instead of
     Triton's default 100 ms; fla caches the choices on disk (FLA_CACHE_RESULTS, on by
     default), so later processes neither compile nor autotune.

Triton writes each cache entry (binaries, autotuning results) into a private temporary directory and
renames it into place, taking no lock: the N processes never wait for each other, and one that is
killed leaves at most a tmp.pid_* directory. Each phase is bounded by --phase-timeout-s.

The calls: causal_rfa_fla forward and backward, gated and ungated,
with and without an initial state (gated: forward only where fla refuses its gated backward, see
fla_backend.fla_gated_backward_error), in fla's fp32 (what the model, the tests and the
benchmarks use at these shapes).

    python3 benchmarks/gpu/warm_fla.py --workers 12 --heads 8 --features 64 --head-dim 64
"""
import argparse
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FLA_MODULES = ("fla.ops.common.chunk_h", "fla.ops.common.chunk_o", "fla.ops.utils.cumsum", "fla.ops.common.fused_recurrent")
TUNE_WARMUP_MS, TUNE_REP_MS = 5, 20


def autotuners():
    """The autotuners of the kernels RFA calls (found under triton.heuristics wrappers too)."""
    import importlib

    found = []
    for name in FLA_MODULES:
        for value in vars(importlib.import_module(name)).values():
            while value is not None and not hasattr(value, "configs"):
                value = getattr(value, "fn", None)
            if value is not None and isinstance(getattr(value, "configs", None), list) and value not in found:
                found.append(value)
    return found


def config_slice(configs, index: int, workers: int):
    """This worker's share of an autotuner's configurations. At least two whenever there are two:
    Triton's autotuner skips a configuration that fails to compile or launch only when it has a
    choice; with one it runs it unguarded."""
    if len(configs) < 2:
        return configs
    if len(configs) >= 2 * workers:
        return configs[index::workers]
    return [configs[(2 * index) % len(configs)], configs[(2 * index + 1) % len(configs)]]


def exercise(args) -> int:
    """Every call RFA makes at these shapes; returns how many failed."""
    import torch

    from rfa_fairseq.ops import causal_rfa_fla, fla_gated_backward_error

    B, T, H, F_, d = 2, 200, args.heads, args.features, args.head_dim
    failures = 0
    for gated in (False, True):
        backward = not (gated and fla_gated_backward_error())  # else causal_rfa never asks fla for it
        for with_state in (False, True):
            try:
                q, k = (torch.rand(B, H, T, F_, device="cuda", requires_grad=backward) for _ in range(2))
                v = torch.randn(B, H, T, d, device="cuda", requires_grad=backward)
                log_gate = -torch.rand(B, H, T, device="cuda", requires_grad=backward) if gated else None
                state = torch.rand(B, H, F_, d + 1, device="cuda", requires_grad=backward) if with_state else None
                out, final = causal_rfa_fla(q, k, v, log_gate, state)
                if backward:
                    (out.sum() + final.sum()).backward()
                torch.cuda.synchronize()
            except Exception as error:  # what fails here is compiled (or fails) later, where it is used
                failures += 1
                print(f"gated={gated} initial_state={with_state}: {type(error).__name__}: {error}", flush=True)
    return failures


def worker(args) -> None:
    import triton

    sys.path.insert(0, REPO)
    from rfa_fairseq.ops import fla_import_error

    if fla_import_error():
        raise SystemExit(f"fla does not import: {fla_import_error()}")
    for tuner in autotuners():
        if args.tune:
            tuner.__dict__.pop("do_bench", None)  # a cached_property: set before the first benchmark
            tuner._do_bench = lambda fn, quantiles: triton.testing.do_bench(
                fn, warmup=TUNE_WARMUP_MS, rep=TUNE_REP_MS, quantiles=quantiles)
        else:
            tuner.configs = config_slice(tuner.configs, args.index, args.workers)
    if exercise(args) == 4:
        raise SystemExit(1)


def run_phase(cmds, name: str, timeout_s: float) -> int:
    """Run cmds in parallel; returns how many failed. Processes still running after timeout_s are killed
    (and count as failed)."""
    start = time.time()
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for cmd in cmds]
    failed = 0
    for i, proc in enumerate(procs):
        try:
            output, _ = proc.communicate(timeout=max(0.0, start + timeout_s - time.time()))
        except subprocess.TimeoutExpired:
            proc.kill()
            output, _ = proc.communicate()
            failed += 1
            print(f"warm_fla {name} process {i} did not finish within {timeout_s:g} s (--phase-timeout-s): "
                  f"killed\n{output[-2000:]}", flush=True)
            continue
        if proc.returncode != 0:
            failed += 1
            print(f"warm_fla {name} process {i} failed ({proc.returncode}):\n{output[-2000:]}", flush=True)
        elif output.strip():
            print(output.strip()[-1000:], flush=True)
    print(f"warm_fla {name}: {len(cmds) - failed}/{len(cmds)} processes done in {time.time() - start:.0f} s", flush=True)
    return failed


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=max(1, min(12, (os.cpu_count() or 2) - 2)))
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--features", type=int, default=64)  # the default map: 2 x 32
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--phase-timeout-s", type=float, default=3600,
                   help="kill a phase's processes still running after this many seconds (default 3600)")
    p.add_argument("--index", type=int, help=argparse.SUPPRESS)
    p.add_argument("--tune", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.index is not None or args.tune:
        worker(args)
        return 0
    cmd = [sys.executable, os.path.abspath(__file__), "--workers", str(args.workers), "--heads", str(args.heads),
           "--features", str(args.features), "--head-dim", str(args.head_dim)]
    compile_failed = run_phase([cmd + ["--index", str(i)] for i in range(args.workers)], "compile", args.phase_timeout_s)
    tune_failed = run_phase([cmd + ["--tune"]], "tune", args.phase_timeout_s)
    return 1 if tune_failed or compile_failed == args.workers else 0


if __name__ == "__main__":
    sys.exit(main())
