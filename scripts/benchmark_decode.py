#!/usr/bin/env python3
"""Decoding speed and memory vs output length: RFA vs fairseq's softmax transformer.

Runs fairseq's real beam search (SequenceGenerator) with forced output lengths
(min = max length) on random-weight models of identical size and vocabulary, one
fresh process per configuration so that peak memory is that configuration's own.
Reports per length: ms per decoding step, total time, tokens/s, peak memory (RSS on
CPU, max allocated on CUDA), the attention state size (KV cache vs RFA state) and
RFA / softmax ratios; writes CSV and a log-log PNG.

Optional peer, `--models ... ct2`: the same softmax model (same seed, same weights)
converted with CTranslate2's fairseq converter and decoded by CTranslate2 (beam search,
forced length, fp32, the same number of threads); needs `pip install ctranslate2==4.8.5`.
The converted model is kept in OUT_DIR/ct2_<dims>_vocab<V>_pos<P>/. CTranslate2's cache is
internal, so its attention-state column is empty.

    python scripts/benchmark_decode.py                                # defaults below
    python scripts/benchmark_decode.py --lengths 32 64 128 --batch-sizes 8 32
"""
import argparse
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmark_common import (  # noqa: E402
    DIMS,
    MODELS,
    PLUGIN_DIR,
    build_model,
    machine_description,
    make_dictionary,
    peak_memory_mb,
    print_table,
    run_worker,
    tensor_bytes,
    write_csv,
)

DEFAULT_LENGTHS = [32, 64, 128, 256, 512, 1024, 2048, 4096]
MODEL_CHOICES = sorted(MODELS) + ["ct2"]
CT2_PIN = "ctranslate2==4.8.5"


def source_tokens(args):
    """The benchmark's source batch: (batch, src_len) ids ending in EOS (fixed seed)."""
    import torch

    dictionary = make_dictionary(args.vocab)
    g = torch.Generator().manual_seed(0)
    src = torch.randint(dictionary.nspecial, len(dictionary), (args.batch_size, args.src_len), generator=g)
    src[:, -1] = dictionary.eos()
    return src, dictionary


def ct2_model_dir(args) -> str:
    positions = max(max(args.lengths), 4096) + 8
    return os.path.join(os.path.abspath(args.out_dir), f"ct2_{args.dims}_vocab{args.vocab}_pos{positions}")


def ensure_ct2_model(args) -> str:
    """Convert the softmax benchmark model with CTranslate2's fairseq converter (once)."""
    import tempfile

    import torch

    try:
        from ctranslate2.converters import FairseqConverter
    except ImportError:
        sys.exit(f"benchmark_decode: --models ct2 needs CTranslate2: pip install {CT2_PIN}")
    path = ct2_model_dir(args)
    if os.path.exists(os.path.join(path, "model.bin")):
        return path
    positions = int(path.rsplit("_pos", 1)[1])
    dictionary = make_dictionary(args.vocab)
    model = build_model("softmax", args.dims, dictionary, max_positions=positions, device="cpu")
    model_args = model.build_args
    with tempfile.TemporaryDirectory() as tmp:
        model_args.data, model_args.source_lang, model_args.target_lang = tmp, "src", "tgt"
        for lang in ("src", "tgt"):
            dictionary.save(os.path.join(tmp, f"dict.{lang}.txt"))
        checkpoint = os.path.join(tmp, "checkpoint.pt")
        torch.save({"args": model_args, "model": model.state_dict()}, checkpoint)
        # the plugin (user_dir) allowlists argparse.Namespace for torch.load(weights_only=True)
        converter = FairseqConverter(checkpoint, tmp, user_dir=PLUGIN_DIR, source_lang="src", target_lang="tgt")
        converter.convert(path + ".partial", force=True)
    os.replace(path + ".partial", path)
    print(f"# converted the softmax model for CTranslate2: {path}", flush=True)
    return path


def run_one_ct2(args) -> dict:
    import ctranslate2

    src, dictionary = source_tokens(args)
    source = [[dictionary[i] for i in row[:-1].tolist()] for row in src]  # CTranslate2 appends </s> itself
    translator = ctranslate2.Translator(
        args.ct2_model, device=args.device.split(":")[0], compute_type="float32",
        inter_threads=1, intra_threads=args.threads,
    )

    def generate(length):
        return translator.translate_batch(
            source, beam_size=args.beam, min_decoding_length=length, max_decoding_length=length, max_batch_size=0
        )

    generate(min(8, args.length))  # warm-up
    total = math.inf
    for _ in range(args.repeats):
        start = time.perf_counter()
        results = generate(args.length)
        total = min(total, time.perf_counter() - start)
    out_len = sum(len(r.hypotheses[0]) for r in results) / len(results)
    steps = args.length + 1
    return {
        "model": "ct2", "batch": args.batch_size, "length": args.length, "out_len": out_len, "total_s": total,
        "ms_per_step": 1000 * total / steps, "tokens_per_s": args.batch_size * args.length / total,
        "peak_mem_mb": peak_memory_mb(args.device), "attn_state_mb": float("nan"),
    }


def run_one(args) -> dict:
    """One (model, batch size, length) in this process."""
    import torch
    from fairseq.sequence_generator import SequenceGenerator

    torch.set_num_threads(args.threads)
    device = args.device
    src, dictionary = source_tokens(args)
    extra = ["--rfa-num-features", str(args.num_features)] if args.num_features else []
    model = build_model(args.model, args.dims, dictionary, max_positions=args.length + 8, device=device, extra=extra)
    sample = {"net_input": {"src_tokens": src.to(device), "src_lengths": torch.full((args.batch_size,), args.src_len, device=device)}}

    # capture the incremental state to measure what attention keeps between steps
    captured = {}

    decoder_forward = model.decoder.forward  # SequenceGenerator calls .forward directly: no hooks

    def forward_and_grab_state(*fargs, **fkwargs):
        captured["state"] = fkwargs.get("incremental_state")
        return decoder_forward(*fargs, **fkwargs)

    model.decoder.forward = forward_and_grab_state

    def generate(length):
        gen = SequenceGenerator([model], dictionary, beam_size=args.beam, min_len=length, max_len_a=0, max_len_b=length)
        with torch.inference_mode():
            hyps = gen.generate([model], sample)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        return hyps

    generate(min(8, args.length))  # warm-up
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    total = math.inf
    for _ in range(args.repeats):  # the fastest of --repeats runs: short runs are noisy on a shared CPU
        start = time.perf_counter()
        hyps = generate(args.length)
        total = min(total, time.perf_counter() - start)
    out_len = sum(len(h[0]["tokens"]) for h in hyps) / len(hyps)
    state = captured.get("state") or {}
    attn_state = {k: v for k, v in state.items() if k.endswith(("attn_state", "rfa_state"))}
    steps = args.length + 1  # the extra step is EOS
    return {
        "model": args.model,
        "batch": args.batch_size,
        "length": args.length,
        "out_len": out_len,
        "total_s": total,
        "ms_per_step": 1000 * total / steps,
        "tokens_per_s": args.batch_size * args.length / total,
        "peak_mem_mb": peak_memory_mb(device),
        "attn_state_mb": tensor_bytes(attn_state) / 2**20,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["softmax", "rfa", "rfa_gated", "floor"], choices=MODEL_CHOICES)
    p.add_argument("--lengths", nargs="+", type=int, default=DEFAULT_LENGTHS)
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[8])
    p.add_argument("--beam", type=int, default=4)
    p.add_argument("--dims", choices=sorted(DIMS), default="base", help="model size (default: base = wmt_en_de)")
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--src-len", type=int, default=32)
    p.add_argument("--num-features", type=int, default=0, help="RFA D (default: the plugin's default, 64)")
    p.add_argument("--device", default="cuda" if _cuda_available() else "cpu")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--repeats", type=int, default=1, help="time each point this many times, keep the fastest")
    p.add_argument("--resume", action="store_true", help="keep the points already in the CSV of --out-dir, measure the rest")
    p.add_argument("--softmax-max-length", type=int, default=4096, help="skip softmax/floor*/ct2 above this length (time)")
    p.add_argument("--out-dir", default=os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "outputs", "bench"))
    # worker mode: one configuration, JSON on stdout
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--length", type=int, help=argparse.SUPPRESS)
    p.add_argument("--batch-size", type=int, help=argparse.SUPPRESS)
    p.add_argument("--ct2-model", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.num_features < 0:
        p.error("--num-features must be positive (0: the plugin default)")
    for name in ("beam", "vocab", "src_len", "threads", "repeats"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    if any(x <= 0 for x in args.lengths + args.batch_sizes):
        p.error("--lengths and --batch-sizes must be positive")

    if args.model:
        print("RESULT " + json.dumps(run_one_ct2(args) if args.model == "ct2" else run_one(args)))
        return 0

    os.makedirs(args.out_dir, exist_ok=True)
    print(f"# benchmark_decode on {args.device}: {machine_description_for(args)}; dims={args.dims} vocab={args.vocab} "
          f"beam={args.beam} src_len={args.src_len}", flush=True)
    csv_path = os.path.join(args.out_dir, f"decode_{args.device.split(':')[0]}_{args.dims}.csv")
    rows = read_csv_rows(csv_path) if args.resume and os.path.exists(csv_path) else []
    if "ct2" in args.models:
        ensure_ct2_model(args)
    done = {(r["model"], r["batch"], r["length"]) for r in rows}
    for batch in args.batch_sizes:
        for length in args.lengths:
            for model in args.models:
                if model in ("softmax", "floor", "floor_proj", "ct2") and length > args.softmax_max_length or (model, batch, length) in done:
                    continue
                cmd = [sys.executable, os.path.abspath(__file__), "--model", model, "--length", str(length),
                       "--batch-size", str(batch), "--beam", str(args.beam), "--dims", args.dims,
                       "--vocab", str(args.vocab), "--src-len", str(args.src_len), "--device", args.device,
                       "--threads", str(args.threads), "--num-features", str(args.num_features),
                       "--repeats", str(args.repeats)]
                if model == "ct2":
                    cmd += ["--ct2-model", ct2_model_dir(args)]
                row = run_worker(cmd)
                rows.append(row)
                print_row(row)
                add_ratios(rows)
                write_csv(csv_path, rows)  # after every point: a long run stopped early keeps its rows
    add_ratios(rows)
    write_csv(csv_path, rows)
    print()
    print_table(rows, ["model", "batch", "length", "ms_per_step", "total_s", "tokens_per_s", "peak_mem_mb",
                       "attn_state_mb", "time_vs_softmax", "state_vs_softmax", "step_vs_floor", "step_vs_floor_proj"])
    print(f"\nwrote {csv_path}")
    png = plot(rows, csv_path[:-4] + ".png", args)
    if png:
        print(f"wrote {png}")
    return 0


def machine_description_for(args) -> str:
    import torch

    torch.set_num_threads(args.threads)
    return machine_description(args.device)


def read_csv_rows(path):
    """Rows of an earlier run, numbers parsed back (ratio columns are recomputed)."""
    import csv

    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        for key in ("batch", "length"):
            r[key] = int(r[key])
        for key in ("out_len", "total_s", "ms_per_step", "tokens_per_s", "peak_mem_mb", "attn_state_mb"):
            r[key] = float(r[key])
    return rows


def print_row(row) -> None:
    print(f"{row['model']:>10} batch {row['batch']:>3} len {row['length']:>5}: {row['ms_per_step']:8.2f} ms/step "
          f"{row['total_s']:8.2f} s  peak {row['peak_mem_mb']:7.0f} MB  attn state {row['attn_state_mb']:8.2f} MB", flush=True)


def add_ratios(rows) -> None:
    index = {(r["model"], r["batch"], r["length"]): r for r in rows}
    for r in rows:
        soft = index.get(("softmax", r["batch"], r["length"]))
        floor = index.get(("floor", r["batch"], r["length"]))
        r["time_vs_softmax"] = r["total_s"] / soft["total_s"] if soft else None
        r["state_vs_softmax"] = r["attn_state_mb"] / soft["attn_state_mb"] if soft and soft["attn_state_mb"] else None
        r["step_vs_floor"] = r["ms_per_step"] / floor["ms_per_step"] if floor else None
        floor_proj = index.get(("floor_proj", r["batch"], r["length"]))
        r["step_vs_floor_proj"] = r["ms_per_step"] / floor_proj["ms_per_step"] if floor_proj else None


def plot(rows, path, args):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no PNG (pip install -e .[bench])")
        return None
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    colors = {"softmax": "tab:red", "rfa": "tab:orange", "rfa_gated": "tab:green", "floor": "tab:blue", "floor_proj": "tab:cyan", "ct2": "tab:purple"}
    styles = ["-", "--", ":", "-."]
    batches = sorted({r["batch"] for r in rows})
    for (model, batch) in sorted({(r["model"], r["batch"]) for r in rows}):
        style = dict(color=colors.get(model), linestyle=styles[batches.index(batch) % len(styles)], marker="o")
        rs = sorted((r for r in rows if r["model"] == model and r["batch"] == batch), key=lambda r: r["length"])
        x = [r["length"] for r in rs]
        label = f"{model} (batch {batch})"
        axes[0].plot(x, [r["ms_per_step"] for r in rs], label=label, **style)
        axes[1].plot(x, [r["total_s"] for r in rs], label=label, **style)
        if model not in ("floor", "floor_proj", "ct2"):
            axes[2].plot(x, [max(r["attn_state_mb"], 1e-3) for r in rs], label=label, **style)
    for ax, title in zip(axes, ["ms per decoding step", "total decoding time (s)", "attention state (MB)"]):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("output length (tokens)")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"beam {args.beam}, {args.dims} dims, vocab {args.vocab}, {args.device}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


if __name__ == "__main__":
    sys.exit(main())
