#!/usr/bin/env python3
"""Training cost: causal attention forward+backward, RFA (chunked) vs fairseq's softmax path,
and end-to-end fairseq-train words/s at MT lengths.

Part 1 times one decoder self-attention module (the same call fairseq's decoder layer
makes, with the causal mask) for lengths 64 ... 8192, one fresh process per point so
that peak memory (RSS on CPU, max allocated on CUDA) is that point's own. Part 2 runs
fairseq-train on the embedded synthetic corpus for a few hundred updates per model and
reads the words/s it logs. Writes CSV and a log-log PNG.

    python scripts/benchmark_train.py                          # both parts
    python scripts/benchmark_train.py --lengths 64 512 4096 --skip-e2e
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmark_common import (  # noqa: E402
    DIMS,
    PLUGIN_DIR,
    REPO,
    machine_description,
    peak_memory_mb,
    print_table,
    run_worker,
    write_csv,
)

DEFAULT_LENGTHS = [64, 128, 256, 512, 1024, 2048, 4096, 8192]


def attention_module(kind: str, dims: str, chunk_size: int, gate: bool):
    import types

    from fairseq.modules import MultiheadAttention

    from rfa_fairseq.config import RFA_DEFAULTS
    from rfa_fairseq.modules import RFAAttention

    _, embed, _, heads = DIMS[dims]
    if kind == "softmax":
        return MultiheadAttention(embed, heads, self_attention=True)
    cfg = types.SimpleNamespace(**dict(RFA_DEFAULTS, rfa_chunk_size=chunk_size, rfa_gate=gate))
    return RFAAttention(embed, heads, cfg, self_attention=True, causal=True)


def run_one(args) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    device = args.device
    torch.manual_seed(0)
    module = attention_module(args.kind, args.dims, args.chunk_size, args.kind == "rfa_gated").to(device).train()
    T, B, C = args.length, args.batch, DIMS[args.dims][1]
    x = torch.randn(T, B, C, device=device, requires_grad=True)
    if args.kind == "softmax":  # what fairseq's decoder passes: a materialized T x T future mask
        mask = torch.triu(torch.full((T, T), float("-inf"), device=device), 1)
    else:  # what our decoder passes: a zero-stride stand-in
        mask = torch.zeros((), device=device).expand(T, T)

    def step():
        out, _ = module(query=x, key=x, value=x, attn_mask=mask, need_weights=False)
        out.float().pow(2).mean().backward()
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    step()  # warm-up
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    base_mb = peak_memory_mb(device)
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return {
        "kind": args.kind,
        "length": T,
        "batch": B,
        "ms_fwd_bwd": 1000 * min(times),
        "peak_mem_mb": peak_memory_mb(device),
        "peak_over_start_mb": peak_memory_mb(device) - base_mb if not device.startswith("cuda") else None,
    }


def e2e_words_per_second(model: str, dims: str, updates: int, threads: int) -> dict:
    """fairseq-train on the synthetic corpus; words/s from the final train log line."""
    layers, embed, ffn, heads = DIMS[dims]
    bin_dir = os.path.dirname(sys.executable)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, os.path.join(REPO, "data-prep", "make_synthetic_corpus.py"), f"{tmp}/raw",
                        "--train", "6000", "--valid", "100", "--test", "100"], check=True, capture_output=True)
        subprocess.run([os.path.join(bin_dir, "fairseq-preprocess"), "--source-lang", "src", "--target-lang", "tgt",
                        "--trainpref", f"{tmp}/raw/train", "--validpref", f"{tmp}/raw/valid", "--destdir", f"{tmp}/bin",
                        "--joined-dictionary", "--workers", "1"], check=True, capture_output=True)
        arch = ["--arch", "transformer"] if model == "softmax" else ["--arch", "rfa_transformer"]
        if model == "rfa_gated":
            arch.append("--rfa-gate")
        cmd = [os.path.join(bin_dir, "fairseq-train"), f"{tmp}/bin", "--user-dir", PLUGIN_DIR, *arch,
               "--share-all-embeddings", "--encoder-layers", str(layers), "--decoder-layers", str(layers),
               "--encoder-embed-dim", str(embed), "--decoder-embed-dim", str(embed),
               "--encoder-ffn-embed-dim", str(ffn), "--decoder-ffn-embed-dim", str(ffn),
               "--encoder-attention-heads", str(heads), "--decoder-attention-heads", str(heads),
               "--optimizer", "adam", "--lr", "5e-4", "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "100",
               "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1", "--max-tokens", "4096",
               "--max-update", str(updates), "--num-workers", "0", "--seed", "1", "--log-format", "json",
               "--log-interval", "10", "--no-save", "--disable-validation", "--save-dir", f"{tmp}/ckpt"]
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            raise SystemExit(f"fairseq-train failed for {model}:\n{proc.stderr[-3000:]}")
        wps = [float(m.group(1)) for m in re.finditer(r'"wps": "([0-9.]+)"', proc.stdout + proc.stderr)]
    # skip the first log interval (warm-up) and average the rest
    steady = wps[1:] or wps
    return {"model": model, "dims": dims, "updates": updates, "words_per_s": sum(steady) / len(steady)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kinds", nargs="+", default=["softmax", "rfa", "rfa_gated"], choices=["softmax", "rfa", "rfa_gated"])
    p.add_argument("--lengths", nargs="+", type=int, default=DEFAULT_LENGTHS)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dims", choices=sorted(DIMS), default="base")
    p.add_argument("--chunk-size", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--skip-e2e", action="store_true", help="skip the fairseq-train words/s part")
    p.add_argument("--e2e-dims", choices=sorted(DIMS), default="small")
    p.add_argument("--e2e-updates", type=int, default=200)
    p.add_argument("--out-dir", default=os.path.join(REPO, "outputs", "bench"))
    p.add_argument("--kind", help=argparse.SUPPRESS)
    p.add_argument("--length", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if min(args.lengths + [args.batch, args.chunk_size, args.repeats, args.threads, args.e2e_updates]) <= 0:
        p.error("lengths, --batch, --chunk-size, --repeats, --threads and --e2e-updates must be positive")
    if args.kind:
        print("RESULT " + json.dumps(run_one(args)))
        return 0

    import torch

    torch.set_num_threads(args.threads)
    os.makedirs(args.out_dir, exist_ok=True)
    print(f"# benchmark_train on {args.device}: {machine_description(args.device)}; dims={args.dims} batch={args.batch} "
          f"chunk={args.chunk_size}", flush=True)
    rows = []
    for length in args.lengths:
        for kind in args.kinds:
            cmd = [sys.executable, os.path.abspath(__file__), "--kind", kind, "--length", str(length), "--batch", str(args.batch),
                   "--dims", args.dims, "--chunk-size", str(args.chunk_size), "--repeats", str(args.repeats),
                   "--device", args.device, "--threads", str(args.threads)]
            try:
                row = run_worker(cmd)
            except RuntimeError as exc:  # e.g. softmax running out of memory at long lengths
                print(f"{kind} at {length}: {exc}")
                continue
            rows.append(row)
            print(f"{kind:>10} len {length:>5}: {row['ms_fwd_bwd']:10.2f} ms fwd+bwd, peak {row['peak_mem_mb']:8.0f} MB", flush=True)
    if not rows:
        raise SystemExit("benchmark_train: every configuration failed")
    index = {(r["kind"], r["length"]): r for r in rows}
    for r in rows:
        soft = index.get(("softmax", r["length"]))
        r["speedup_vs_softmax"] = soft["ms_fwd_bwd"] / r["ms_fwd_bwd"] if soft else None
    csv_path = os.path.join(args.out_dir, f"train_attention_{args.device.split(':')[0]}_{args.dims}.csv")
    write_csv(csv_path, rows)
    print()
    print_table(rows, ["kind", "length", "ms_fwd_bwd", "peak_mem_mb", "peak_over_start_mb", "speedup_vs_softmax"])
    print(f"wrote {csv_path}")
    plot(rows, csv_path[:-4] + ".png")

    if not args.skip_e2e:
        e2e = [e2e_words_per_second(m, args.e2e_dims, args.e2e_updates, args.threads) for m in ("softmax", "rfa", "rfa_gated")]
        e2e_path = os.path.join(args.out_dir, f"train_e2e_{args.e2e_dims}.csv")
        write_csv(e2e_path, e2e)
        print()
        print_table(e2e, ["model", "dims", "updates", "words_per_s"])
        print(f"wrote {e2e_path}")
    return 0


def plot(rows, path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no PNG (pip install -e .[bench])")
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for kind in sorted({r["kind"] for r in rows}):
        rs = sorted((r for r in rows if r["kind"] == kind), key=lambda r: r["length"])
        axes[0].plot([r["length"] for r in rs], [r["ms_fwd_bwd"] for r in rs], marker="o", label=kind)
        axes[1].plot([r["length"] for r in rs], [r["peak_mem_mb"] for r in rs], marker="o", label=kind)
    for ax, title in zip(axes, ["causal attention fwd+bwd (ms)", "peak memory (MB)"]):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
