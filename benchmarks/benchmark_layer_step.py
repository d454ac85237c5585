#!/usr/bin/env python3
"""One decoder layer's RFA self-attention decoding step (beam reorder + step), fused C++ step vs the
torch fallback, alternating twice, on a random-weight base-size model:

    python benchmarks/benchmark_layer_step.py --rows 128 --threads 2
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmark_common import build_model, make_dictionary  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=128, help="batch x beam (a multiple of 4)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--steps", type=int, default=200)
    args = p.parse_args()
    if args.rows <= 0 or args.rows % 4 or args.threads <= 0 or args.steps <= 0:
        p.error("--rows must be a positive multiple of 4; --threads and --steps positive")
    import torch

    import rfa_fairseq.ops.fused_step as fused_step

    torch.set_num_threads(args.threads)
    model = build_model("rfa", "base", make_dictionary(8000), 200, "cpu")
    attn = model.decoder.layers[0].self_attn
    x = torch.randn(1, args.rows, attn.embed_dim)
    order = torch.arange(args.rows).view(-1, 4)[:, [1, 0, 0, 2]].reshape(-1)  # beams reordered within sentences
    fused_loader = fused_step.load_fused_extension
    for label, loader in (("torch", lambda: None), ("fused", fused_loader)) * 2:
        fused_step.load_fused_extension = loader
        state = {}
        with torch.inference_mode():
            for _ in range(8):
                attn(query=x, key=x, value=x, incremental_state=state)

            def step():
                attn.reorder_incremental_state(state, order)
                attn(query=x, key=x, value=x, incremental_state=state)

            for _ in range(5):
                step()
            start = time.perf_counter()
            for _ in range(args.steps):
                step()
        ms = (time.perf_counter() - start) / args.steps * 1000
        print(f"{label:>5} rows {args.rows} threads {args.threads}: {ms:.3f} ms per layer step (reorder + self-attn)")
    fused_step.load_fused_extension = fused_loader
    return 0


if __name__ == "__main__":
    sys.exit(main())
