#!/usr/bin/env python3
"""Where a beam search's time goes: the default rfa_transformer's static beam search, part by part, against
CTranslate2 on the softmax twin and the GEMM-bound floor, in one process, on the same test set.

The test set is batched as fairseq-generate batches it (--batch-size sentences, sorted by source length, beam 4,
length penalty 1, max length source + 50). After a warm-up pass, one pass is timed as it is (`rfa total`) and one
under torch's profiler, which times the native step's parts (cpu/csrc/decode_program.cpp, native_search.cpp name them):

    encoder                       the encoder pass of each batch (the encoder's native pass, or fairseq's forward)
    decoder: linear layers        the layers' linear layers (oneDNN on packed weights; int8: the quantization too)
    decoder: output projection    the vocabulary projection
    decoder: causal RFA / softmax cross-attention / layer norm / embeddings   the step's kernels
    search: candidates, finalize, reorder   the log-softmax fused with the choice of the candidates, the rest of
                                  the search's step
    other                         the rest (each batch's start: its K/V, buffers; the host's loop; the profiler's
                                  own cost): the profiled pass's total less the parts

`gemm_floor` times the step's linear layers alone, on the same packed weights, at the rows of every step that
was run (each batch's rows shrink as its sentences finish): what a step could take if it were its GEMMs only
(over the full vocabulary's projection, with --shortlist too).
`ctranslate2 total` is CTranslate2 on the same sentences, same batch size, beam and threads, in a process of its
own (benchmarks/ctranslate2_generate.py; its one translate_batch call, warm-up included; no per-part profile:
CTranslate2's Python API has none). Writes one CSV row per (batch size, part).

    python benchmarks/profile_generate.py --prep outputs/multi30k --path CKPT --ct2-model CT2_DIR
    python benchmarks/profile_generate.py ... --decode-precision int8 --ct2-model CT2_INT8_DIR --csv FILE
    python benchmarks/profile_generate.py ... --shortlist DATA/shortlist.en-de.npz --ct2-model CT2_VMAP_DIR \
        --forced-length 16        # the vocabulary shortlist against CTranslate2's use_vmap, 16 tokens each

One precision per run (--decode-precision: the rfa model's linear layers, int8's gemm_floor its quantization
included); a run replaces its own (precision, threads, batch size, shortlist, forced length) rows of the CSV and
keeps the others.
"""
import argparse
import collections
import csv
import functools
import inspect
import os
import re
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmark_common import ISA_CAPS, PLUGIN_DIR, cpu_isa_environment, length_flags, write_csv  # noqa: E402

# the native step's parts (RECORD_FUNCTION names) -> the CSV's parts
NATIVE_PARTS = {"rfa::linear": "decoder: linear layers", "rfa::output_projection": "decoder: output projection",
                "rfa::causal_attention": "decoder: causal RFA", "rfa::cross_attention": "decoder: softmax cross-attention",
                "rfa::layer_norm": "decoder: layer norm", "rfa::embedding": "decoder: embeddings",
                "rfa::search": "search: candidates, finalize, reorder"}


class PartTimer:
    """Sums the wall time of wrapped callables by part (reset between passes)."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.seconds, self.calls = collections.defaultdict(float), collections.Counter()

    def wrap(self, owner, name, part, before=None):
        """before(*args): called first (what a call is about)."""
        original = getattr(owner, name)
        static = isinstance(owner, type) and isinstance(inspect.getattr_static(owner, name), staticmethod)

        @functools.wraps(original)
        def timed(*args, **kwargs):
            if before is not None:
                before(*args)
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[part] += time.perf_counter() - start
                self.calls[part] += 1

        setattr(owner, name, staticmethod(timed) if static else timed)


def load(args):
    from fairseq import checkpoint_utils, options, tasks, utils
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    overrides = {"rfa_decode_precision": args.decode_precision, "rfa_cpu_isa": args.cpu_isa or "auto"}
    if args.shortlist:
        overrides["rfa_shortlist"] = args.shortlist
    parser = options.get_generation_parser()
    gen_args = options.parse_args_and_arch(parser, [
        os.path.join(args.prep, "data-bin"), "--user-dir", PLUGIN_DIR, "--path", args.path, "--gen-subset", "test",
        "--beam", "4", "--lenpen", "1", *length_flags(args.forced_length), "--cpu",
        "--model-overrides", repr(overrides)])
    cfg = convert_namespace_to_omegaconf(gen_args)
    utils.import_user_module(cfg.common)
    task = tasks.setup_task(cfg.task)
    task.load_dataset("test")
    models, _ = checkpoint_utils.load_model_ensemble([args.path], task=task,
                                                     arg_overrides=eval(cfg.common_eval.model_overrides))
    model = models[0].eval()
    generator = task.build_generator(models, cfg.generation)
    if type(generator).__name__ != "StaticBeamSearchGenerator":
        sys.exit(f"profile_generate: {args.path} did not get the static beam search ({type(generator).__name__})")

    def batches(batch_size):
        itr = task.get_batch_iterator(dataset=task.dataset("test"), max_sentences=batch_size,
                                      required_batch_size_multiple=1, disable_iterator_cache=True,
                                      max_positions=utils.resolve_max_positions(task.max_positions(), model.max_positions()))
        return list(itr.next_epoch_itr(shuffle=False))

    return model, generator, batches


def instrument(model):
    """Wraps the parts Python runs once (this process only profiles); -> the timer and the list of every step's rows."""
    from rfa_fairseq.generation import static_beam_search

    timer, rows = PartTimer(), []
    timer.wrap(model.encoder, "forward_torchscript", "encoder")
    # the torch search's steps one by one (every row); the native search's at the end (the rows each step decoded)
    timer.wrap(static_beam_search._Search, "after_step", "steps", before=lambda search, *_: rows.append(search.rows.rows))

    def native_rows(search, *_):
        if search.native is not None:
            rows.extend(search.views.step_rows[: int(search.views.step)].tolist())

    timer.wrap(static_beam_search._Search, "collect", "collect", before=native_rows)
    return timer, rows


def profile_rfa(model, generator, batches, timer, rows):
    """-> {part: seconds}, {part: calls}, the rows of every decoder step, total seconds (unprofiled, profiled)."""
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad():
        for batch in batches:  # warm-up: oneDNN primitives made for every row count
            generator.generate([model], batch)
        start = time.perf_counter()
        for batch in batches:
            generator.generate([model], batch)
        total = time.perf_counter() - start
        timer.reset()
        rows.clear()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            for batch in batches:
                generator.generate([model], batch)
            profiled_total = time.perf_counter() - start
    seconds, calls = {"encoder": timer.seconds["encoder"]}, {"encoder": timer.calls["encoder"]}
    for event in prof.key_averages():
        part = NATIVE_PARTS.get(event.key)
        if part is not None:
            seconds[part] = seconds.get(part, 0.0) + event.cpu_time_total / 1e6
            calls[part] = calls.get(part, 0) + event.count
    parts = sum(seconds.values())
    if parts > profiled_total:  # the regions are exclusive (decode_program.cpp): their sum cannot exceed the pass
        sys.exit(f"profile_generate: the parts add up to {parts:.3f} s, more than the profiled pass's "
                 f"{profiled_total:.3f} s: some region is counted twice")
    seconds["other (profiled pass)"] = profiled_total - parts
    return seconds, calls, list(rows), total, profiled_total


def gemm_floor(model, generator, rows):
    """Seconds of the decoding steps' linear layers alone at each step's rows, on the same packed weights and
    kernels (fp32 or int8: int8's activation quantization included)."""
    with torch.no_grad():
        runtime = model.decoder.decoding_runtime()  # the one the generator decoded on (built for these weights)
    kernels = runtime.kernels
    C, ffn = model.decoder.embed_dim, model.decoder.layers[0].fc1.out_features
    # every linear layer of a step (the cross-attention's K/V projection runs once per batch), with its input width
    weights = []
    for record in runtime.layers:
        weights += [(record.self_attn.proj, C), (record.self_attn.out_proj, C), (record.fc1, C), (record.fc2, ffn)]
        if record.cross is not None:
            weights += [(record.cross.q_proj, C), (record.cross.out_proj, C)]
    weights.append((runtime.output, C))
    inputs = {(r, width): torch.randn(r, width) for r in set(rows) for width in {C, ffn}}
    with torch.no_grad():
        start = time.perf_counter()
        for r in rows:
            for packed, width in weights:
                kernels.linear(inputs[(r, width)], packed)
        return time.perf_counter() - start


def profile_ct2(args, batch_size):
    """CTranslate2's seconds for the test set (benchmarks/ctranslate2_generate.py, in a process of its own: in
    this one, torch's OpenMP threads would still be spinning beside CTranslate2's)."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "ctranslate2_generate.py"),
               "--model", args.ct2_model, "--source", os.path.join(args.prep, "test.spm.en"),
               "--output", os.path.join(tmp, "hyp.txt"), "--threads", str(args.threads), "--batch-size",
               str(batch_size), "--beam", "4", "--lenpen", "1", "--max-len-b", "50",
               "--forced-length", str(args.forced_length)] + (["--use-vmap"] if args.shortlist else [])
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    found = re.search(r"Translated .* in [\d.]+s \(([\d.]+) sentences/s", proc.stdout + proc.stderr)
    if proc.returncode != 0 or found is None:
        sys.exit(f"profile_generate: {' '.join(cmd)} failed:\n{(proc.stdout + proc.stderr)[-2000:]}")
    return len(open(os.path.join(args.prep, "test.spm.en"), encoding="utf-8").read().splitlines()) / float(found.group(1))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prep", required=True, help="output of data-prep/prepare-multi30k.sh (data-bin/, test.spm.en)")
    p.add_argument("--path", required=True, help="the default rfa_transformer checkpoint")
    p.add_argument("--ct2-model", help="CTranslate2 conversion of the softmax twin (benchmark_generate.py makes one)")
    p.add_argument("--decode-precision", choices=["fp32", "int8"], default="fp32",
                   help="the rfa model's --rfa-decode-precision (its linear layers)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[32, 128])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--csv", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                 "profile_generate_multi30k_cpu.csv"))
    p.add_argument("--cpu-isa", default="", choices=["", *ISA_CAPS],
                   help="this process and CTranslate2's capped at this instruction-set level (benchmark_common.ISA_CAPS)")
    p.add_argument("--shortlist", default="",
                   help="decode with this vocabulary shortlist (--rfa-shortlist); CTranslate2 then translates with "
                        "use_vmap (--ct2-model converted with the same table as its vocabulary map)")
    p.add_argument("--forced-length", type=int, default=0,
                   help="every hypothesis exactly this many tokens, in both engines (0: natural lengths)")
    args = p.parse_args()
    if args.forced_length < 0:
        p.error(f"--forced-length must be 0 (natural lengths) or positive, got {args.forced_length}")
    if args.cpu_isa and os.environ.get("RFA_PROFILE_CAPPED") != args.cpu_isa:  # the caps are read at start: again
        env = cpu_isa_environment(args.cpu_isa, dict(os.environ, RFA_PROFILE_CAPPED=args.cpu_isa))
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    torch.set_num_threads(args.threads)
    model, generator, batches_of = load(args)
    generator.parts = 1  # one part on every thread (parts decoded at once would overlap each other's parts' times)
    timer, step_rows = instrument(model)
    out = []
    point = {"decode_precision": args.decode_precision, "threads": args.threads,
             "shortlist": os.path.basename(args.shortlist), "forced_length": args.forced_length}
    for batch_size in args.batch_sizes:
        seconds, calls, rows, total, profiled = profile_rfa(model, generator, batches_of(batch_size), timer, step_rows)
        steps = len(rows)
        at = dict(point, batch_size=batch_size)
        for part, s in sorted(seconds.items(), key=lambda kv: -kv[1]):
            out.append(dict(at, part=part, seconds=f"{s:.6f}", ms_per_step=f"{1e3 * s / steps:.3f}",
                            calls=calls.get(part, "")))
        out.append(dict(at, part="rfa total", seconds=f"{total:.6f}", ms_per_step=f"{1e3 * total / steps:.3f}",
                        calls=steps))
        out.append(dict(at, part="rfa total (profiled pass)", seconds=f"{profiled:.6f}",
                        ms_per_step=f"{1e3 * profiled / steps:.3f}", calls=steps))
        floor = gemm_floor(model, generator, rows)
        out.append(dict(at, part="gemm_floor", seconds=f"{floor:.6f}", ms_per_step=f"{1e3 * floor / steps:.3f}",
                        calls=steps))
        if args.ct2_model:
            ct2 = profile_ct2(args, batch_size)
            out.append(dict(at, part="ctranslate2 total", seconds=f"{ct2:.6f}", ms_per_step="", calls=""))
        for row in out:
            if row["batch_size"] == batch_size:
                print(f"batch {batch_size:4d}  {row['part']:22s} {row['seconds']:>8s} s  {row['ms_per_step']:>8s} ms/step")
    # the CSV keeps other points' rows (one run per precision, thread count, shortlist and length)
    def key(row):
        return (row.get("decode_precision") or "fp32", str(row["threads"]), str(row["batch_size"]),
                row.get("shortlist") or "", str(row.get("forced_length") or 0))

    measured = {key(row) for row in out}
    kept = []
    if os.path.exists(args.csv):
        with open(args.csv, newline="") as f:
            kept = [r for r in csv.DictReader(f) if key(r) not in measured]
    os.makedirs(os.path.dirname(args.csv) or ".", exist_ok=True)
    write_csv(args.csv, kept + out)
    print(f"wrote {args.csv}")


if __name__ == "__main__":
    main()
