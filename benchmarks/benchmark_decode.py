#!/usr/bin/env python3
"""Decoding speed and memory vs output length: RFA vs fairseq's softmax transformer.

Runs fairseq's real beam search (SequenceGenerator) with forced output lengths
(min = max length) on random-weight models of identical size and vocabulary, one
fresh process per configuration so that peak memory is that configuration's own.
`rfa_static` / `rfa_static_eager` decode the default model with the static beam search
instead (what fairseq-generate runs for an rfa_transformer; on CUDA its whole step one
graph, or, _eager, not captured), each length a run of its own after a warm-up run of
that length (graphs captured, kept by the generator).
Reports per length: ms per decoding step, total time, tokens/s, peak memory (RSS on
CPU, max allocated on CUDA), the attention state size (KV cache vs RFA state) and
RFA / softmax ratios; writes CSV and a log-log PNG.

Optional peer, `--models ... ct2 ct2_int8`: the same softmax model (same seed, same weights)
converted with CTranslate2's fairseq converter and decoded by CTranslate2 (beam search,
forced length, float32 or int8, the same number of threads); needs `pip install ctranslate2==4.8.5`.
The converted model is kept in OUT_DIR/ct2_<dims>_vocab<V>_pos<P>/. CTranslate2's cache is
internal, so its attention-state column is empty. `rfa_static_int8` is the default model decoded by the
static beam search with int8 linear layers (--rfa-decode-precision int8, the CPU). --sentences decodes that
many sentences in batches of each --batch-sizes (CTranslate2: max_batch_size), and the summary
`*_crossover.csv` gives, per RFA model and CTranslate2 peer, the first measured output length from which the
RFA model's tokens/s is at least the peer's (and the length interpolated between the points around it).

On CUDA, --one-run decodes once per (model, batch size) to the longest length and reads the
shorter ones on the way: at each of them the GPU is synchronized and the elapsed time, the
peak allocated memory so far and the attention state are recorded (forced lengths make the
first L steps of a long run those of a run of length L). The models of a batch size run one
after the other in one process (CUDA, imports and compiled kernels set up once; peak memory
reset per run). ms_per_step_recent is the mean over the steps since the previous length: the
cost of a step at about that length. --time-budget bounds the whole sweep and --run-budget
each run (a run cut short keeps the lengths it reached), and --max-batch-at L
predicts the largest batch each model fits at L output tokens from the peak memory at two
batch sizes (linear in the batch), optionally checked by decoding that batch (--verify-max-batch).
Files are named by device: decode_cpu_<dims>.csv, decode_cuda_h100_<dims>.csv, ...

    python benchmarks/benchmark_decode.py                                # defaults below
    python benchmarks/benchmark_decode.py --lengths 32 64 128 --batch-sizes 8 32
    python benchmarks/benchmark_decode.py --device cuda --one-run --lengths 64 256 1024 2048 4096 \\
        --batch-sizes 8 64 --models softmax rfa rfa_gated --max-batch-at 2048 --time-budget 300
    python benchmarks/benchmark_decode.py --device cpu --dims small --threads 1 --batch-sizes 32 --sentences 64 \\
        --lengths 16 64 256 1000 --models softmax rfa_static rfa_static_int8 ct2 ct2_int8 --name vs_ct2
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
    DTYPES,
    MODELS,
    PLUGIN_DIR,
    STATIC_SEARCH_MODELS,
    build_model,
    device_tag,
    machine_description,
    make_dictionary,
    peak_memory_mb,
    print_table,
    pyplot,
    run_worker,
    stream_worker,
    tensor_bytes,
    write_csv,
)

DEFAULT_LENGTHS = [32, 64, 128, 256, 512, 1024, 2048, 4096]
# incremental-state entries that hold attention state: fairseq's MultiheadAttention and RFA's
# DecodingState (its KEY; its causal states and cross-attention K/V, not its activations)
ATTENTION_STATE_KEYS = ("attn_state", "rfa_decoding_state")
CT2_COMPUTE_TYPES = {"ct2": "float32", "ct2_int8": "int8"}  # CTranslate2 models -> compute_type
MODEL_CHOICES = sorted(MODELS) + sorted(CT2_COMPUTE_TYPES)
CT2_PIN = "ctranslate2==4.8.5"


def source_tokens(args, sentences=None):
    """The benchmark's sources: (sentences, src_len) ids ending in EOS (fixed seed; default: one batch)."""
    import torch

    dictionary = make_dictionary(args.vocab)
    g = torch.Generator().manual_seed(0)
    src = torch.randint(dictionary.nspecial, len(dictionary), (sentences or args.batch_size, args.src_len), generator=g)
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

    src, dictionary = source_tokens(args, args.sentences or args.batch_size)
    source = [[dictionary[i] for i in row[:-1].tolist()] for row in src]  # CTranslate2 appends </s> itself
    translator = ctranslate2.Translator(
        args.ct2_model, device=args.device.split(":")[0], compute_type=CT2_COMPUTE_TYPES[args.model],
        inter_threads=1, intra_threads=args.threads,
    )

    def generate(length):
        return translator.translate_batch(
            source, beam_size=args.beam, min_decoding_length=length, max_decoding_length=length,
            max_batch_size=args.batch_size,
        )

    generate(min(8, args.length))  # warm-up
    total = math.inf
    for _ in range(args.repeats):
        start = time.perf_counter()
        results = generate(args.length)
        total = min(total, time.perf_counter() - start)
    out_len = sum(len(r.hypotheses[0]) for r in results) / len(results)
    steps = (args.length + 1) * math.ceil(len(source) / args.batch_size)
    return {
        "model": args.model, "batch": args.batch_size, "length": args.length, "out_len": out_len, "total_s": total,
        "ms_per_step": 1000 * total / steps, "tokens_per_s": len(source) * args.length / total,
        "peak_mem_mb": peak_memory_mb(args.device), "attn_state_mb": float("nan"),
    }


def make_generator(model_name: str, model, dictionary, beam: int, length: int):
    """The beam search of a forced-length run: fairseq's SequenceGenerator, or for STATIC_SEARCH_MODELS the static
    beam search (CUDA graphs on or off)."""
    if model_name in STATIC_SEARCH_MODELS:
        from rfa_fairseq.generation import StaticBeamSearchGenerator

        return StaticBeamSearchGenerator(model, dictionary, beam_size=beam, min_len=length, max_len_a=0,
                                         max_len_b=length, cuda_graphs=STATIC_SEARCH_MODELS[model_name])
    from fairseq.sequence_generator import SequenceGenerator

    return SequenceGenerator([model], dictionary, beam_size=beam, min_len=length, max_len_a=0, max_len_b=length)


def grab_decoding_states(model) -> list:
    """The static beam search's DecodingStates, as each batch starts one (their attention tensors: the state's
    size); -> the list they are appended to. (Patches the class: one benchmark run per process.)"""
    from rfa_fairseq.modules.decoding import DecodingState

    states, start = [], DecodingState.start

    def start_and_keep(self, *args, **kwargs):
        states.append(self)
        return start(self, *args, **kwargs)

    DecodingState.start = start_and_keep
    return states


def run_one(args) -> dict:
    """One (model, batch size, length) in this process."""
    import torch

    torch.set_num_threads(args.threads)
    device = args.device
    src, dictionary = source_tokens(args, args.sentences or args.batch_size)
    extra = ["--rfa-num-features", str(args.num_features)] if args.num_features else []
    model = build_model(args.model, args.dims, dictionary, max_positions=args.length + 8, device=device, extra=extra,
                        dtype=args.dtype)
    samples = [{"net_input": {"src_tokens": chunk.to(device),
                              "src_lengths": torch.full((chunk.size(0),), args.src_len, device=device)}}
               for chunk in src.split(args.batch_size)]

    # capture the incremental state to measure what attention keeps between steps
    captured = {}

    decoder_forward = model.decoder.forward  # SequenceGenerator calls .forward directly: no hooks

    def forward_and_grab_state(*fargs, **fkwargs):
        captured["state"] = fkwargs.get("incremental_state")
        return decoder_forward(*fargs, **fkwargs)

    model.decoder.forward = forward_and_grab_state
    states = grab_decoding_states(model) if args.model in STATIC_SEARCH_MODELS else None

    def generate(gen):
        hyps = []
        with torch.inference_mode():
            for sample in samples:
                hyps += gen.generate([model], sample)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        return hyps

    generate(make_generator(args.model, model, dictionary, args.beam, min(8, args.length)))  # warm-up
    # the generator of the timed runs made once (CTranslate2's translator is); the static beam search's first run is a
    # warm-up of this length (its buffers, kept across batches, sized; on CUDA its graphs captured)
    gen = make_generator(args.model, model, dictionary, args.beam, args.length)
    if args.model in STATIC_SEARCH_MODELS:
        generate(gen)
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    total = math.inf
    for _ in range(args.repeats):  # the fastest of --repeats runs: short runs are noisy on a shared CPU
        start = time.perf_counter()
        hyps = generate(gen)
        total = min(total, time.perf_counter() - start)
    out_len = sum(len(h[0]["tokens"]) for h in hyps) / len(hyps)
    state = captured.get("state") or {}
    attn_state = {k: v for k, v in state.items() if k.endswith(ATTENTION_STATE_KEYS)}
    if states:
        attn_state = states[-1].attention_tensors()
    steps = (args.length + 1) * len(samples)  # the extra step is EOS
    return {
        "model": args.model,
        "dtype": args.dtype,
        "batch": args.batch_size,
        "length": args.length,
        "out_len": out_len,
        "total_s": total,
        "ms_per_step": 1000 * total / steps,
        "tokens_per_s": src.size(0) * args.length / total,
        "peak_mem_mb": peak_memory_mb(device),
        "attn_state_mb": tensor_bytes(attn_state) / 2**20,
    }


def attention_state_mb(incremental_state) -> float:
    state = incremental_state or {}
    return tensor_bytes({k: v for k, v in state.items() if k.endswith(ATTENTION_STATE_KEYS)}) / 2**20


class RunBudgetSpent(Exception):
    """Raised from inside beam search when a run has used its --run-budget."""


def run_checkpoints(args) -> None:
    """CUDA, one process for several runs (--runs MODEL:BATCH ...; CUDA, imports and fla's kernels
    are set up once): each decodes once to the longest of --checkpoints and prints a RESULT row at
    each checkpoint; a run past --run-budget seconds stops there and the next one starts."""
    import gc

    import torch

    for run in args.runs:
        model_name, batch = run.rsplit(":", 1)
        try:
            decode = decode_static_lengths if model_name in STATIC_SEARCH_MODELS else decode_with_checkpoints
            decode(args, model_name, int(batch))
        except RunBudgetSpent:
            print(f"# {model_name} batch {batch}: run budget spent", flush=True)
        except torch.cuda.OutOfMemoryError:
            print(f"# {model_name} batch {batch}: CUDA out of memory", flush=True)
            if len(args.runs) == 1:
                raise
        gc.collect()
        torch.cuda.empty_cache()


def decode_static_lengths(args, model_name: str, batch: int) -> None:
    """The static beam search, one timed run per length of --checkpoints after a warm-up run of that length (its
    graphs captured: fairseq-generate's later batches replay them); RESULT rows as decode_with_checkpoints'."""
    import torch

    args.batch_size = batch
    free_mb = torch.cuda.mem_get_info()[0] / 2**20
    src, dictionary = source_tokens(args)
    lengths = sorted(set(args.checkpoints))
    extra = ["--rfa-num-features", str(args.num_features)] if args.num_features else []
    model = build_model(model_name, args.dims, dictionary, max_positions=lengths[-1] + 8, device=args.device,
                        extra=extra, dtype=args.dtype)
    sample = {"net_input": {"src_tokens": src.to(args.device),
                            "src_lengths": torch.full((batch,), args.src_len, device=args.device)}}
    states = grab_decoding_states(model)
    deadline = time.perf_counter() + args.run_budget if args.run_budget > 0 else math.inf
    for length in lengths:
        generator = make_generator(model_name, model, dictionary, args.beam, length)
        with torch.inference_mode():
            generator.generate([model], sample)  # warm-up: graphs captured
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            hyps = generator.generate([model], sample)
            torch.cuda.synchronize()
        total = time.perf_counter() - start
        out_lens = {len(h[0]["tokens"]) for h in hyps}
        if out_lens != {length + 1}:
            raise SystemExit(f"forced length not kept: output lengths {sorted(out_lens)}, expected {length + 1}")
        row = {
            "model": model_name, "dtype": args.dtype, "batch": batch, "length": length, "out_len": length + 1,
            "total_s": total, "ms_per_step": 1000 * total / (length + 1), "ms_per_step_recent": 1000 * total / (length + 1),
            "tokens_per_s": batch * length / total, "peak_mem_mb": torch.cuda.max_memory_allocated() / 2**20,
            "attn_state_mb": tensor_bytes(states[-1].attention_tensors()) / 2**20, "free_mb": free_mb,
        }
        print("RESULT " + json.dumps(row), flush=True)
        del generator
        if time.perf_counter() > deadline:
            raise RunBudgetSpent()


def decode_with_checkpoints(args, model_name: str, batch: int) -> None:
    import torch
    from fairseq.sequence_generator import SequenceGenerator

    device = args.device
    args.batch_size = batch
    free_mb = torch.cuda.mem_get_info()[0] / 2**20  # what this run can allocate, before its model
    src, dictionary = source_tokens(args)
    lengths = sorted(set(args.checkpoints))
    extra = ["--rfa-num-features", str(args.num_features)] if args.num_features else []
    model = build_model(model_name, args.dims, dictionary, max_positions=lengths[-1] + 8, device=device, extra=extra,
                        dtype=args.dtype)
    sample = {"net_input": {"src_tokens": src.to(device), "src_lengths": torch.full((batch,), args.src_len, device=device)}}
    at_call = {length + 1: length for length in lengths}  # decoder call L + 1 ends a run of length L (EOS step)
    clock = {"calls": 0, "start": None, "last_calls": 0, "last_time": None, "deadline": math.inf}
    decoder_forward = model.decoder.forward

    def timed_forward(*fargs, **fkwargs):
        out = decoder_forward(*fargs, **fkwargs)
        if clock["start"] is None:  # warm-up run
            return out
        clock["calls"] += 1
        length = at_call.get(clock["calls"])
        if length is not None:
            torch.cuda.synchronize()
            now = time.perf_counter()
            total = now - clock["start"]
            recent = (now - clock["last_time"]) / (clock["calls"] - clock["last_calls"])
            clock["last_calls"], clock["last_time"] = clock["calls"], now
            row = {
                "model": model_name, "dtype": args.dtype, "batch": batch, "length": length, "out_len": length + 1,
                "total_s": total, "ms_per_step": 1000 * total / (length + 1), "ms_per_step_recent": 1000 * recent,
                "tokens_per_s": batch * length / total, "peak_mem_mb": torch.cuda.max_memory_allocated() / 2**20,
                "attn_state_mb": attention_state_mb(fkwargs.get("incremental_state")), "free_mb": free_mb,
            }
            print("RESULT " + json.dumps(row), flush=True)
        if time.perf_counter() > clock["deadline"]:
            raise RunBudgetSpent()
        return out

    model.decoder.forward = timed_forward

    def generate(length):
        gen = SequenceGenerator([model], dictionary, beam_size=args.beam, min_len=length, max_len_a=0, max_len_b=length)
        with torch.inference_mode():
            return gen.generate([model], sample)

    generate(min(8, lengths[-1]))  # warm-up: kernels compiled and autotuned, allocator primed
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    clock["start"] = clock["last_time"] = time.perf_counter()
    clock["deadline"] = clock["start"] + args.run_budget if args.run_budget > 0 else math.inf
    hyps = generate(lengths[-1])
    out_lens = {len(h[0]["tokens"]) for h in hyps}
    if out_lens != {lengths[-1] + 1}:
        raise SystemExit(f"forced length not kept: output lengths {sorted(out_lens)}, expected {lengths[-1] + 1}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["softmax", "rfa", "rfa_gated", "floor"], choices=MODEL_CHOICES)
    p.add_argument("--lengths", nargs="+", type=int, default=DEFAULT_LENGTHS)
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[8])
    p.add_argument("--sentences", type=int, default=0, help="sentences decoded per point, in batches of each "
                   "--batch-sizes (default: one batch)")
    p.add_argument("--name", default="", help="a suffix of the CSV / PNG names (decode_<device>_<dims>_<name>.csv)")
    p.add_argument("--beam", type=int, default=4)
    p.add_argument("--dims", choices=sorted(DIMS), default="base", help="model size (default: base = wmt_en_de)")
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--src-len", type=int, default=32)
    p.add_argument("--num-features", type=int, default=0, help="RFA D (default: the plugin's default, 64)")
    p.add_argument("--device", default="cuda" if _cuda_available() else "cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="the models' weights (states stay fp32)")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--repeats", type=int, default=1, help="time each point this many times, keep the fastest")
    p.add_argument("--resume", action="store_true", help="keep the points already in the CSV of --out-dir, measure the rest")
    p.add_argument("--softmax-max-length", type=int, default=4096, help="skip softmax/floor*/ct2 above this length (time)")
    p.add_argument("--out-dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    p.add_argument("--one-run", action="store_true",
                   help="CUDA: one run per model and batch to the longest length, read at each length on the way")
    p.add_argument("--time-budget", type=float, default=0, help="seconds for the whole sweep (0: none); cut runs keep their rows")
    p.add_argument("--run-budget", type=float, default=0, help="seconds per run (0: none)")
    p.add_argument("--max-batch-at", type=int, default=0,
                   help="predict the largest batch each model fits at this output length (needs two batch sizes there)")
    p.add_argument("--verify-max-batch", action="store_true", help="decode the predicted largest batch (within the budget)")
    # worker mode: one configuration, JSON on stdout
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--length", type=int, help=argparse.SUPPRESS)
    p.add_argument("--batch-size", type=int, help=argparse.SUPPRESS)
    p.add_argument("--ct2-model", help=argparse.SUPPRESS)
    p.add_argument("--checkpoints", nargs="+", type=int, help=argparse.SUPPRESS)
    p.add_argument("--runs", nargs="+", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.num_features < 0:
        p.error("--num-features must be positive (0: the plugin default)")
    if args.sentences < 0:
        p.error("--sentences must be positive (0: one batch)")
    for name in ("beam", "vocab", "src_len", "threads", "repeats"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    if any(x <= 0 for x in args.lengths + args.batch_sizes):
        p.error("--lengths and --batch-sizes must be positive")

    if args.one_run and not args.device.startswith("cuda"):
        p.error("--one-run reads the GPU's peak memory at each length: CUDA only")
    if args.one_run and (set(args.models) & set(CT2_COMPUTE_TYPES) or args.softmax_max_length < max(args.lengths)):
        p.error("--one-run decodes every model to the longest length with fairseq: no ct2, no --softmax-max-length")
    if args.runs and args.checkpoints:
        run_checkpoints(args)
        return 0
    if args.model:
        print("RESULT " + json.dumps(run_one_ct2(args) if args.model in CT2_COMPUTE_TYPES else run_one(args)))
        return 0

    os.makedirs(args.out_dir, exist_ok=True)
    print(f"# benchmark_decode on {args.device}: {machine_description_for(args)}; dims={args.dims} vocab={args.vocab} "
          f"beam={args.beam} src_len={args.src_len}", flush=True)
    dtype_tag = ("" if args.dtype == "fp32" else f"_{args.dtype}") + (f"_{args.name}" if args.name else "")
    csv_path = os.path.join(args.out_dir, f"decode_{device_tag(args.device)}_{args.dims}{dtype_tag}.csv")
    rows = read_csv_rows(csv_path) if args.resume and os.path.exists(csv_path) else []
    if set(args.models) & set(CT2_COMPUTE_TYPES):
        ensure_ct2_model(args)
    done = {(r["model"], r["batch"], r["length"]) for r in rows}
    budget_end = time.time() + args.time_budget if args.time_budget > 0 else math.inf

    def add_row(row):
        rows.append(row)
        print_row(row)
        add_ratios(rows)
        write_csv(csv_path, rows)  # after every point: a long run stopped early keeps its rows

    for batch in args.batch_sizes:
        todo = [(model, length) for length in args.lengths for model in args.models
                if not (model in SOFTMAX_LIKE and length > args.softmax_max_length) and (model, batch, length) not in done]
        if not todo:
            continue
        if time.time() >= budget_end:
            print(f"# time budget spent: skipped batch {batch}", flush=True)
            continue
        if args.one_run:  # one process, one run per model (in --models order), each to its longest length
            models = [m for m in args.models if any(model == m for model, _ in todo)]
            lengths = sorted({n for _, n in todo})
            status = stream_worker(one_run_cmd(args, [f"{m}:{batch}" for m in models], lengths), budget_end, add_row)
            if status != "ok":
                print(f"# batch {batch}: {status}", flush=True)
            continue
        for model, length in todo:
            if time.time() >= budget_end:
                print(f"# time budget spent: skipped {model} batch {batch} length {length}", flush=True)
                continue
            add_row(run_worker(worker_cmd(args, model, batch, length)))
    if not rows:
        print("benchmark_decode: no point measured (time budget?)")
        return 1
    add_ratios(rows)
    write_csv(csv_path, rows)
    print()
    print_table(rows, ["model", "batch", "length", "ms_per_step", "ms_per_step_recent", "total_s", "tokens_per_s",
                       "peak_mem_mb", "attn_state_mb", "time_vs_softmax", "state_vs_softmax", "step_vs_floor", "step_vs_floor_proj"])
    print(f"\nwrote {csv_path}")
    png = plot(rows, csv_path[:-4] + ".png", args)
    if png:
        print(f"wrote {png}")
    crossover = crossover_rows(rows)
    if crossover:
        write_csv(csv_path[:-4] + "_crossover.csv", crossover)
        print_table(crossover, list(crossover[0]))
        print(f"wrote {csv_path[:-4]}_crossover.csv")
    if args.max_batch_at:
        max_batch(args, rows, os.path.join(args.out_dir, f"decode_max_batch_{device_tag(args.device)}_{args.dims}.csv"), budget_end)
    return 0


SOFTMAX_LIKE = ("softmax", "floor", "floor_proj", "ct2", "ct2_int8")


def crossover_rows(rows) -> list:
    """Per RFA model and batch size, against CTranslate2 at the same precision (an int8 model against ct2_int8, the
    others against ct2): the first measured length from which the RFA model's tokens/s is at least the peer's at
    every longer measured length, and the length where the ratio crosses 1 by linear interpolation in log length
    (empty where it never passes, or passes at the shortest length measured)."""
    out = []
    index = {(r["model"], r["batch"], r["length"]): r for r in rows}
    for model, batch in sorted({(r["model"], r["batch"]) for r in rows if r["model"].startswith("rfa")}):
        peer = "ct2_int8" if "int8" in model else "ct2"
        points = sorted((length, index[(model, batch, length)]["tokens_per_s"] / index[(peer, batch, length)]["tokens_per_s"])
                        for (m, b, length) in index if (m, b) == (model, batch) and (peer, batch, length) in index)
        if not points:
            continue
        passes = [i for i in range(len(points)) if all(ratio >= 1.0 for _, ratio in points[i:])]
        first = points[passes[0]][0] if passes else None
        interpolated = None
        if passes and passes[0] > 0:
            (l0, r0), (l1, r1) = points[passes[0] - 1], points[passes[0]]
            w = (1.0 - r0) / (r1 - r0)
            interpolated = round(math.exp(math.log(l0) + w * (math.log(l1) - math.log(l0))))
        out.append({"model": model, "peer": peer, "batch": batch,
                    "ratios": " ".join(f"{length}:{ratio:.2f}" for length, ratio in points),
                    "passes_from_length": first, "crossover_interpolated": interpolated})
    return out


def common_worker_args(args):
    return ["--beam", str(args.beam), "--dims", args.dims, "--vocab", str(args.vocab), "--src-len", str(args.src_len),
            "--device", args.device, "--threads", str(args.threads), "--num-features", str(args.num_features),
            "--repeats", str(args.repeats), "--dtype", args.dtype, "--sentences", str(args.sentences)]


def worker_cmd(args, model, batch, length):
    cmd = [sys.executable, os.path.abspath(__file__), "--model", model, "--batch-size", str(batch), "--length", str(length),
           *common_worker_args(args)]
    if model in CT2_COMPUTE_TYPES:
        cmd += ["--ct2-model", ct2_model_dir(args)]
    return cmd


def one_run_cmd(args, runs, checkpoints):
    return [sys.executable, os.path.abspath(__file__), "--runs", *runs, "--checkpoints", *map(str, checkpoints),
            "--run-budget", str(args.run_budget), *common_worker_args(args)]


def max_batch(args, rows, path, budget_end) -> None:
    """Largest batch (sentences, each decoded with --beam beams) per model at --max-batch-at tokens:
    peak allocated memory is linear in the batch, fitted through the smallest and largest batch
    measured at that length, solved for the memory a fresh process can allocate (free_mb).
    Allocator fragmentation makes the real limit somewhat lower: --verify-max-batch decodes the
    predicted batch (rows reached: verified_length; out of memory: "oom")."""
    length = args.max_batch_at
    results = []
    for model in sorted({r["model"] for r in rows if r["model"] not in ("floor", "floor_proj", *CT2_COMPUTE_TYPES)}):
        points = sorted({(r["batch"], r["peak_mem_mb"]) for r in rows if r["model"] == model and r["length"] == length})
        capacity = min((float(r.get("free_mb") or math.inf) for r in rows if r["model"] == model), default=math.inf)
        if len(points) < 2 or not math.isfinite(capacity):
            print(f"# max batch: {model} needs two batch sizes at length {length} (and --one-run's free_mb)", flush=True)
            continue
        (b1, m1), (b2, m2) = points[0], points[-1]
        per_sentence = (m2 - m1) / (b2 - b1)
        fixed = m1 - per_sentence * b1
        predicted = int((capacity - fixed) / per_sentence) if per_sentence > 0 else None
        results.append({"model": model, "length": length, "beam": args.beam, "batch_a": b1, "peak_a_mb": m1,
                        "batch_b": b2, "peak_b_mb": m2, "mb_per_sentence": per_sentence, "fixed_mb": fixed,
                        "capacity_mb": capacity, "predicted_max_batch": predicted, "verified": ""})
    if not results:
        return
    if args.verify_max_batch:
        for r in results:
            if time.time() >= budget_end or not r["predicted_max_batch"]:
                r["verified"] = "not run (time budget)" if r["predicted_max_batch"] else ""
                continue
            reached = []
            checkpoints = sorted({n for n in (64, 256, 1024, length) if n <= length})
            whole_run = argparse.Namespace(**{**vars(args), "run_budget": 0})  # only the sweep's budget applies
            status = stream_worker(one_run_cmd(whole_run, [f"{r['model']}:{r['predicted_max_batch']}"], checkpoints),
                                   budget_end, reached.append)
            longest = max((x["length"] for x in reached), default=0)
            r["verified"] = ("fits" if longest == length else
                             "oom" if "OutOfMemory" in status or "out of memory" in status else
                             f"time budget spent after {longest} tokens" if status == "timeout" else
                             f"{status} after {longest} tokens")
            print(f"# max batch {r['model']}: batch {r['predicted_max_batch']}: {r['verified']}", flush=True)
    write_csv(path, results)
    print()
    print_table(results, ["model", "length", "batch_a", "peak_a_mb", "batch_b", "peak_b_mb", "mb_per_sentence",
                          "capacity_mb", "predicted_max_batch", "verified"])
    print(f"wrote {path}")


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
        for key in ("ms_per_step_recent", "free_mb"):  # --one-run columns
            r[key] = float(r[key]) if r.get(key) else None
    return rows


def print_row(row) -> None:
    print(f"{row['model']:>10} batch {row['batch']:>3} len {row['length']:>5}: {row['ms_per_step']:8.2f} ms/step "
          f"{row['total_s']:8.2f} s  peak {row['peak_mem_mb']:7.0f} MB  attn state {row['attn_state_mb']:8.2f} MB", flush=True)


def add_ratios(rows) -> None:
    index = {(r["model"], r["batch"], r["length"]): r for r in rows}
    for r in rows:
        soft = index.get(("softmax", r["batch"], r["length"]))
        floor = index.get(("floor", r["batch"], r["length"]))
        # per step: a point measured on fewer sentences (--sentences) compares as one on more
        r["time_vs_softmax"] = r["ms_per_step"] / soft["ms_per_step"] if soft else None
        r["state_vs_softmax"] = r["attn_state_mb"] / soft["attn_state_mb"] if soft and soft["attn_state_mb"] else None
        r["step_vs_floor"] = r["ms_per_step"] / floor["ms_per_step"] if floor else None
        floor_proj = index.get(("floor_proj", r["batch"], r["length"]))
        r["step_vs_floor_proj"] = r["ms_per_step"] / floor_proj["ms_per_step"] if floor_proj else None


def plot(rows, path, args):
    plt = pyplot()
    if plt is None:
        return None
    fig, axes = plt.subplots(1, 4, figsize=(20, 4.2))
    colors = {"softmax": "tab:red", "rfa": "tab:orange", "rfa_gated": "tab:green", "floor": "tab:blue", "floor_proj": "tab:cyan",
              "rfa_torch": "tab:brown", "ct2": "tab:purple", "ct2_int8": "violet", "rfa_static_int8": "tab:green", "rfa_d16": "tab:olive", "rfa_d32": "tab:pink", "rfa_d64": "tab:gray",
              "rfa_paper": "gold", "rfa_paper_gated": "darkkhaki", "rfa_rfa_cross": "navy", "rfa_static": "black",
              "rfa_static_eager": "dimgray", "rfa_eager": "tab:pink"}
    styles = ["-", "--", ":", "-."]
    batches = sorted({r["batch"] for r in rows})
    for (model, batch) in sorted({(r["model"], r["batch"]) for r in rows}):
        style = dict(color=colors.get(model), linestyle=styles[batches.index(batch) % len(styles)], marker="o")
        rs = sorted((r for r in rows if r["model"] == model and r["batch"] == batch), key=lambda r: r["length"])
        x = [r["length"] for r in rs]
        label = f"{model} (batch {batch})"
        axes[0].plot(x, [r.get("ms_per_step_recent") or r["ms_per_step"] for r in rs], label=label, **style)
        axes[1].plot(x, [r["total_s"] for r in rs], label=label, **style)
        axes[2].plot(x, [r["peak_mem_mb"] for r in rs], label=label, **style)
        if model not in ("floor", "floor_proj", *CT2_COMPUTE_TYPES):
            axes[3].plot(x, [max(r["attn_state_mb"], 1e-3) for r in rs], label=label, **style)
    peak = "peak allocated memory (MB)" if args.device.startswith("cuda") else "peak RSS (MB)"
    step = "ms per decoding step" + (" (steps since the previous length)" if any(r.get("ms_per_step_recent") for r in rows) else "")
    for ax, title in zip(axes, [step, "total decoding time (s)", peak, "attention state (MB)"]):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("output length (tokens)")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"beam {args.beam}, {args.dims} dims, vocab {args.vocab}, {machine_description_for(args)}")
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
