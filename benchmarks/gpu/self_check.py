#!/usr/bin/env python3
"""The Triton kernels' self-check on this GPU as a model runs them: outcome and cost of each check, in a CSV.

Each --models model of the benchmarks' size (benchmark_common.build_model, random weights) in each --dtypes trains a
step's forward and backward on padded batches of short and long targets (both chunk sizes of the chunked kernels),
scores them without gradients and decodes a few steps with the static beam search (fairseq-generate's generator, its
steps captured as CUDA graphs after each shape's first): every Triton variant met is checked once
(rfa_fairseq/gpu/triton_self_check.py). Writes gpu_self_check_<gpu>.csv, a row per check (the model and dtype that
met it first, the kernel, its variant and input dtypes, the outcome, the largest difference and its tensor, the
tolerance, the milliseconds) with the GPU and the versions. Exits 1 when a check failed: run_all.sh then lets the
later stages check for themselves instead of passing them the skip option.

    python benchmarks/gpu/self_check.py --out-dir OUT [--dims base] [--dtypes fp16 bf16] [--models rfa rfa_paper]
"""
import argparse
import csv
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

FIELDS = ["gpu", "triton", "torch", "model", "dtype", "kernel", "variant", "dtypes", "outcome", "largest_error",
          "worst", "tolerance", "milliseconds"]


def exercise(model, dictionary, batch: int, source_len: int, device: str = "cuda") -> None:
    """A training step's forward and backward and a scoring pass over right-padded targets of 10 and 40 tokens, then
    four decoding steps of beam search."""
    import torch

    from rfa_fairseq.generation import StaticBeamSearchGenerator

    g = torch.Generator().manual_seed(0)
    words = (dictionary.nspecial, len(dictionary))
    src = torch.randint(*words, (batch, source_len), generator=g).to(device)
    src_lengths = torch.full((batch,), source_len).to(device)
    for target_len in (10, 40):
        prev = torch.randint(*words, (batch, target_len), generator=g).to(device)
        prev[0, target_len - target_len // 4:] = dictionary.pad()  # fairseq pads targets on the right
        model.train()
        model(src, src_lengths, prev)[0].float().sum().backward()
        model.eval()
        with torch.no_grad():
            model(src, src_lengths, prev)
    generator = StaticBeamSearchGenerator(model, dictionary, beam_size=4, min_len=4, max_len_a=0, max_len_b=4)
    with torch.inference_mode():
        generator.generate([model], {"net_input": {"src_tokens": src, "src_lengths": src_lengths}})


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["rfa", "rfa_paper"], help="benchmark_common.MODELS' rfa models")
    p.add_argument("--dims", default="base", help="benchmark_common.DIMS")
    p.add_argument("--dtypes", nargs="+", default=["fp16"], choices=["fp16", "bf16", "fp32"],
                   help="the models' weights (default: fp16, the GPU benchmarks' precision)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--out-dir", required=True)
    args = p.parse_args()

    import torch
    import triton

    from benchmark_common import build_model, device_tag, make_dictionary

    if not torch.cuda.is_available():
        raise SystemExit("self_check.py: no CUDA device (tests/test_triton_self_check.py runs the check in Triton's "
                         "interpreter on the CPU)")
    from rfa_fairseq.gpu import triton_self_check

    os.makedirs(args.out_dir, exist_ok=True)
    path = os.path.join(args.out_dir, f"gpu_self_check_{device_tag('cuda')}.csv")
    with open(path, "w", newline="") as f:
        csv.DictWriter(f, FIELDS).writeheader()
    dictionary = make_dictionary(8000)
    rows, start = [], time.perf_counter()
    for name in args.models:
        for dtype in args.dtypes:
            seen = len(triton_self_check.checks())
            model = build_model(name, args.dims, dictionary, max_positions=64, device="cuda", dtype=dtype,
                                extra=["--rfa-triton-self-check"])
            exercise(model, dictionary, args.batch, source_len=12)
            torch.cuda.synchronize()
            for record in triton_self_check.checks()[seen:]:
                rows.append({"gpu": record.device, "triton": triton.__version__, "torch": torch.__version__,
                             "model": name, "dtype": dtype, "kernel": record.kernel, "variant": record.variant,
                             "dtypes": record.dtypes, "outcome": record.outcome,
                             "largest_error": f"{record.largest_error:.2e}", "worst": record.worst,
                             "tolerance": f"{record.tolerance:.0e}", "milliseconds": f"{record.milliseconds:.1f}"})
                print(f"{name} {dtype}: {record.kernel} ({record.variant}) {record.dtypes}: {record.outcome}, "
                      f"largest difference {record.largest_error:.1e} ({record.worst}), {record.milliseconds:.0f} ms",
                      flush=True)
                with open(path, "a", newline="") as f:  # row by row: a run cut short keeps its checks
                    csv.DictWriter(f, FIELDS).writerow(rows[-1])
            del model
            torch.cuda.empty_cache()
    failed = [row for row in rows if row["outcome"] != "passed"]
    checked_ms = sum(float(row["milliseconds"]) for row in rows)
    print(f"{len(rows)} checks, {len(failed)} failed, {checked_ms:.0f} ms in checks of "
          f"{time.perf_counter() - start:.1f} s in all: {path}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
