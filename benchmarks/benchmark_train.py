#!/usr/bin/env python3
"""Training cost: causal attention forward+backward, RFA vs softmax, and end-to-end
fairseq-train words/s at MT lengths.

Part 1 times one decoder self-attention module (the same call fairseq's decoder layer
makes, with the causal mask) for lengths 64 ... 8192. Kinds: softmax (fairseq's
MultiheadAttention, materialized T x T mask), softmax_sdpa (the same projections around
torch's scaled_dot_product_attention(is_causal=True): flash / memory-efficient kernels on
CUDA), rfa and rfa_gated (the plugin's dispatch: the Triton kernels on CUDA, chunked torch
otherwise), rfa_torch and rfa_gated_torch (the chunked torch path on any device), rfa_fla (CUDA, the
peer: flash-linear-attention's chunk_simple_gla in place of the plugin's kernels, ungated: fla 0.6 refuses its
gated backward on Hopper under Triton < 3.7.1). On the
CPU one fresh process per point, so that peak RSS is that point's own; on CUDA one process
per kind, peak allocated memory reset before each length. Part 2 runs fairseq-train on
the embedded synthetic corpus for a few hundred updates per model and reads the words/s
it logs. Writes CSV and a log-log PNG named by device (train_attention_cuda_h100_base.csv).

    python benchmarks/benchmark_train.py                          # both parts
    python benchmarks/benchmark_train.py --lengths 64 512 4096 --skip-e2e
    python benchmarks/benchmark_train.py --device cuda --kinds softmax_sdpa rfa rfa_gated \\
        --lengths 512 1024 2048 4096 8192 16384 --skip-e2e --time-budget 90
"""
import argparse
import json
import math
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
    device_tag,
    machine_description,
    peak_memory_mb,
    print_table,
    pyplot,
    run_worker,
    stream_worker,
    write_csv,
)

DEFAULT_LENGTHS = [64, 128, 256, 512, 1024, 2048, 4096, 8192]
KINDS = ["softmax", "softmax_sdpa", "rfa", "rfa_gated", "rfa_torch", "rfa_gated_torch", "rfa_fla"]
DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
# bounds of the end-to-end part's commands (generous: a few hundred updates take minutes on a CPU)
PREP_TIMEOUT_S = 900
E2E_TRAIN_TIMEOUT_S = 4 * 3600


def bounded_run(cmd, timeout_s, env=None, check=True):
    """subprocess.run with captured output that fails, naming the command, on an error or after timeout_s."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise SystemExit(f"{' '.join(cmd)}: did not finish within {timeout_s:g} s (killed)") from None
    if check and proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc


def attention_module(kind: str, dims: str, chunk_size: int, gate: bool):
    from fairseq.modules import MultiheadAttention

    from rfa_fairseq.config import RFAConfig
    from rfa_fairseq.modules import RFAAttention

    _, embed, _, heads = DIMS[dims]
    if kind == "softmax":
        return MultiheadAttention(embed, heads, self_attention=True)
    if kind == "softmax_sdpa":
        return SDPAAttention(embed, heads)
    sequence_kernel = "torch" if kind.endswith("_torch") else "auto"  # *_torch: CUDA tensors on the torch path too
    if kind.endswith("_fla"):
        import rfa_fairseq.modules.rfa_attention as rfa_attention

        rfa_attention.causal_rfa = fla_causal_rfa  # this worker process times the peer's kernels
    return RFAAttention(embed, heads, self_attention=True, causal=True,
                        rfa=RFAConfig(rfa_chunk_size=chunk_size, rfa_gate=gate, rfa_sequence_kernel=sequence_kernel))


def fla_causal_rfa(phi_q, phi_k, v, log_gate=None, state=None, *, chunk_size, sequence_kernel, eps, self_check):
    """Causal RFA through flash-linear-attention's scalar-gated linear attention: S_t = exp(g_t) S_t-1 + k_t (x) [v_t, 1],
    o_t = q_t S_t (fla's (B, T, H, .) layout, fp32 inputs), normalized as the plugin's kernels normalize."""
    from fla.ops.simple_gla import chunk_simple_gla

    from rfa_fairseq.ops.rfa import normalize, with_ones

    q, k = phi_q.float().transpose(1, 2), phi_k.float().transpose(1, 2)  # (B, T, H, F)
    va = with_ones(v.float()).transpose(1, 2)  # (B, T, H, d + 1)
    g = log_gate.float().transpose(1, 2) if log_gate is not None else None  # (B, T, H)
    out, final = chunk_simple_gla(q, k, va, g=g, scale=1.0, initial_state=state, output_final_state=True)
    return normalize(out.transpose(1, 2), eps), final


def _sdpa_module_class():
    import torch

    class SDPAAttention(torch.nn.Module):
        """Causal softmax self-attention with MultiheadAttention's projections and call signature,
        on torch's scaled_dot_product_attention (is_causal: no mask in memory)."""

        def __init__(self, embed_dim: int, num_heads: int):
            super().__init__()
            self.num_heads, self.head_dim = num_heads, embed_dim // num_heads
            self.q_proj, self.k_proj, self.v_proj, self.out_proj = (torch.nn.Linear(embed_dim, embed_dim) for _ in range(4))

        def forward(self, query, key, value, attn_mask=None, **kwargs):
            T, B, C = query.shape

            def heads(x):  # (T, B, C) -> (B, H, T, d)
                return x.view(T, B, self.num_heads, self.head_dim).permute(1, 2, 0, 3)

            q, k, v = heads(self.q_proj(query)), heads(self.k_proj(key)), heads(self.v_proj(value))
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, d)
            return self.out_proj(out.permute(2, 0, 1, 3).reshape(T, B, C)), None

    return SDPAAttention


def SDPAAttention(embed_dim: int, num_heads: int):
    return _sdpa_module_class()(embed_dim, num_heads)


def build_module(args):
    import torch

    torch.manual_seed(0)
    module = attention_module(args.kind, args.dims, args.chunk_size, args.kind.startswith("rfa_gated"))
    return module.to(args.device, getattr(torch, DTYPES[args.dtype])).train()


def measure(args, module, length: int) -> dict:
    """Forward + backward of `module` on (length, batch, C) inputs: the fastest of --repeats."""
    import torch

    device, dtype = args.device, getattr(torch, DTYPES[args.dtype])
    T, B, C = length, args.batch, DIMS[args.dims][1]
    x = torch.randn(T, B, C, device=device, dtype=dtype, requires_grad=True)
    if args.kind == "softmax":  # what fairseq's decoder passes: a materialized T x T future mask
        mask = torch.triu(torch.full((T, T), float("-inf"), device=device, dtype=dtype), 1)
    else:  # causal inside scaled_dot_product_attention; RFA's causal self-attention is causal by construction
        mask = None

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
        "dtype": args.dtype,
        "ms_fwd_bwd": 1000 * min(times),
        "peak_mem_mb": peak_memory_mb(device),
        "peak_over_start_mb": peak_memory_mb(device) - base_mb if not device.startswith("cuda") else None,
    }


def run_one(args) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    return measure(args, build_module(args), args.length)


def run_lengths(args) -> None:
    """CUDA: every length in this process (peak memory reset per length), a RESULT row each;
    stops at the first length that runs out of memory (longer ones would too)."""
    import torch

    torch.set_num_threads(args.threads)
    module = build_module(args)
    for length in args.worker_lengths:
        try:
            row = measure(args, module, length)
        except torch.cuda.OutOfMemoryError:
            print(f"{args.kind}: out of memory at {length} tokens", file=sys.stderr, flush=True)
            return
        print("RESULT " + json.dumps(row), flush=True)
        module.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()


def e2e_words_per_second(model: str, dims: str, updates: int, threads: int) -> dict:
    """fairseq-train on the synthetic corpus; words/s from the final train log line."""
    layers, embed, ffn, heads = DIMS[dims]
    bin_dir = os.path.dirname(sys.executable)
    with tempfile.TemporaryDirectory() as tmp:
        bounded_run([sys.executable, os.path.join(REPO, "data-prep", "make_synthetic_corpus.py"), f"{tmp}/raw",
                     "--train", "6000", "--valid", "100", "--test", "100"], PREP_TIMEOUT_S)
        bounded_run([os.path.join(bin_dir, "fairseq-preprocess"), "--source-lang", "src", "--target-lang", "tgt",
                     "--trainpref", f"{tmp}/raw/train", "--validpref", f"{tmp}/raw/valid", "--destdir", f"{tmp}/bin",
                     "--joined-dictionary", "--workers", "1"], PREP_TIMEOUT_S)
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
        proc = bounded_run(cmd, E2E_TRAIN_TIMEOUT_S, env=env, check=False)
        if proc.returncode != 0:
            raise SystemExit(f"fairseq-train failed for {model}:\n{proc.stderr[-3000:]}")
        wps = [float(m.group(1)) for m in re.finditer(r'"wps": "([0-9.]+)"', proc.stdout + proc.stderr)]
    # skip the first log interval (warm-up) and average the rest
    steady = wps[1:] or wps
    return {"model": model, "dims": dims, "updates": updates, "words_per_s": sum(steady) / len(steady)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kinds", nargs="+", default=["softmax", "rfa", "rfa_gated"], choices=KINDS)
    p.add_argument("--lengths", nargs="+", type=int, default=DEFAULT_LENGTHS)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dims", choices=sorted(DIMS), default="base")
    p.add_argument("--chunk-size", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="module and input dtype (RFA's states stay fp32)")
    p.add_argument("--time-budget", type=float, default=0, help="seconds for part 1 (0: none); what is measured is kept")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--skip-e2e", action="store_true", help="skip the fairseq-train words/s part")
    p.add_argument("--e2e-dims", choices=sorted(DIMS), default="small")
    p.add_argument("--e2e-updates", type=int, default=200)
    p.add_argument("--out-dir", default=os.path.join(REPO, "benchmarks", "results"))
    p.add_argument("--kind", help=argparse.SUPPRESS)
    p.add_argument("--length", type=int, help=argparse.SUPPRESS)
    p.add_argument("--worker-lengths", nargs="+", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if min(args.lengths + [args.batch, args.chunk_size, args.repeats, args.threads, args.e2e_updates]) <= 0:
        p.error("lengths, --batch, --chunk-size, --repeats, --threads and --e2e-updates must be positive")
    if args.kind and args.worker_lengths:
        run_lengths(args)
        return 0
    if args.kind:
        print("RESULT " + json.dumps(run_one(args)))
        return 0

    import torch

    torch.set_num_threads(args.threads)
    os.makedirs(args.out_dir, exist_ok=True)
    print(f"# benchmark_train on {args.device}: {machine_description(args.device)}; dims={args.dims} batch={args.batch} "
          f"chunk={args.chunk_size} dtype={args.dtype}", flush=True)
    suffix = "" if args.dtype == "fp32" else f"_{args.dtype}"
    csv_path = os.path.join(args.out_dir, f"train_attention_{device_tag(args.device)}_{args.dims}{suffix}.csv")
    budget_end = time.time() + args.time_budget if args.time_budget > 0 else math.inf
    rows = []

    def add_row(row):
        rows.append(row)
        print(f"{row['kind']:>16} len {row['length']:>5}: {row['ms_fwd_bwd']:10.2f} ms fwd+bwd, peak {row['peak_mem_mb']:8.0f} MB",
              flush=True)
        add_speedups(rows)
        write_csv(csv_path, rows)

    def worker(kind, *extra):
        return [sys.executable, os.path.abspath(__file__), "--kind", kind, "--batch", str(args.batch), "--dims", args.dims,
                "--chunk-size", str(args.chunk_size), "--repeats", str(args.repeats), "--device", args.device,
                "--threads", str(args.threads), "--dtype", args.dtype, *extra]

    if args.device.startswith("cuda"):  # one process per kind, every length in it
        for kind in args.kinds:
            if time.time() >= budget_end:
                print(f"# time budget spent: skipped {kind}", flush=True)
                continue
            status = stream_worker(worker(kind, "--worker-lengths", *map(str, args.lengths)), budget_end, add_row)
            if status != "ok":
                print(f"# {kind}: {status}", flush=True)
    else:
        for length in args.lengths:
            for kind in args.kinds:
                if time.time() >= budget_end:
                    print(f"# time budget spent: skipped {kind} at {length}", flush=True)
                    continue
                try:
                    add_row(run_worker(worker(kind, "--length", str(length))))
                except RuntimeError as exc:  # e.g. softmax running out of memory at long lengths
                    print(f"{kind} at {length}: {exc}")
    if not rows:
        raise SystemExit("benchmark_train: every configuration failed")
    add_speedups(rows)
    write_csv(csv_path, rows)
    print()
    print_table(rows, ["kind", "length", "ms_fwd_bwd", "peak_mem_mb", "peak_over_start_mb", "speedup_vs_softmax",
                       "speedup_vs_sdpa"])
    print(f"wrote {csv_path}")
    plot(rows, csv_path[:-4] + ".png", f"{machine_description(args.device)}, {args.dims} dims, batch {args.batch}, {args.dtype}")

    if not args.skip_e2e:
        e2e = [e2e_words_per_second(m, args.e2e_dims, args.e2e_updates, args.threads) for m in ("softmax", "rfa", "rfa_gated")]
        e2e_path = os.path.join(args.out_dir, f"train_e2e_{args.e2e_dims}.csv")
        write_csv(e2e_path, e2e)
        print()
        print_table(e2e, ["model", "dims", "updates", "words_per_s"])
        print(f"wrote {e2e_path}")
    return 0


def add_speedups(rows) -> None:
    index = {(r["kind"], r["length"]): r for r in rows}
    for r in rows:
        for column, reference in (("speedup_vs_softmax", "softmax"), ("speedup_vs_sdpa", "softmax_sdpa")):
            ref = index.get((reference, r["length"]))
            r[column] = ref["ms_fwd_bwd"] / r["ms_fwd_bwd"] if ref else None


def plot(rows, path, title="") -> None:
    plt = pyplot()
    if plt is None:
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
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
