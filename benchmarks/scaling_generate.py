#!/usr/bin/env python3
"""What a second core gives fairseq-generate: N parts at N threads in one process against one thread, and against
N single-thread processes decoding at the same time (what the machine itself gives), with where the difference goes.

For each (precision, batch size) three runs of fairseq-generate on the test set (beam 4, length penalty 1, max length
source + 50), each in a fresh process with the static beam search's calls timed in place:

    one thread      OMP_NUM_THREADS=1: the batches one after the other
    N threads       OMP_NUM_THREADS=N, one process: N parts at once, one thread each (generation/batch_groups.py)
    N processes     N processes of one thread each, started together, each decoding the whole test set

Per run: `span_s` the generator's calls' wall time (fairseq-generate's own timer times the same calls), `work_s`
the parts' decoding time summed over the threads (each part's encoder and search, as timed on its thread),
`tail_s` how long the threads that finished first waited for the last at the end of each call, `minor_faults` the
process's page faults during the calls. `sentences_per_s` is the sentences over the span (the N processes': the sum
of theirs), `scaling` that against one thread's, and `work_vs_one_thread` the summed work against one thread's: what
sharing the machine costs each part. One CSV row per (precision, batch size, run); a run replaces its own rows.

    python benchmarks/scaling_generate.py --prep outputs/multi30k --path CKPT [--threads 2] [--batch-sizes 32 128]
"""
import argparse
import json
import os
import subprocess
import sys
from datetime import datetime, timezone

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmark_common import PLUGIN_DIR, machine_description, write_csv  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "scaling_generate_multi30k_cpu.csv")
MARK = "SCALING_RESULT "
OVERRIDES = {"fp32": "{}", "int8": "{'rfa_decode_precision': 'int8'}"}


def child(prep: str, path: str, batch: int, precision: str) -> None:
    """Runs fairseq-generate in this process with the generator's calls and its parts timed; prints MARK + JSON."""
    import resource
    import threading
    import time

    from fairseq_cli.generate import cli_main
    from rfa_fairseq.generation import static_beam_search

    generator = static_beam_search.StaticBeamSearchGenerator
    parts, calls, faults = [], [], [0]
    decode, generate = generator._decode, generator.generate

    def timed_decode(self, lane, *args, **kwargs):  # one part: its encoder and search, on its thread
        start = time.perf_counter()
        try:
            return decode(self, lane, *args, **kwargs)
        finally:
            parts.append((threading.get_ident(), start, time.perf_counter()))

    def timed_generate(self, *args, **kwargs):
        if kwargs.get("max_steps") is not None:  # the generator's warm-up (a step of one batch): not timed
            return generate(self, *args, **kwargs)
        before, start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
        try:
            return generate(self, *args, **kwargs)
        finally:
            calls.append((start, time.perf_counter()))
            faults[0] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    generator._decode, generator.generate = timed_decode, timed_generate
    sys.argv = ["fairseq-generate", os.path.join(prep, "data-bin"), "--user-dir", PLUGIN_DIR, "--path", path,
                "--gen-subset", "test", "--beam", "4", "--lenpen", "1", "--max-len-a", "1", "--max-len-b", "50",
                "--batch-size", str(batch), "--required-batch-size-multiple", "1", "--cpu", "--num-workers", "0",
                "--model-overrides", OVERRIDES[precision], "--quiet"]
    cli_main()
    tail = work = 0.0
    for start, end in calls:
        inside = [(thread, s, e) for thread, s, e in parts if start <= s and e <= end]  # the call's parts
        work += sum(e - s for _, s, e in inside)
        last = {}  # each thread's last end in the call
        for thread, _, e in inside:
            last[thread] = max(last.get(thread, e), e)
        tail += sum(max(last.values()) - e for e in last.values())
    print(MARK + json.dumps({"span_s": sum(e - s for s, e in calls), "work_s": work, "tail_s": tail,
                             "minor_faults": faults[0]}), flush=True)


def run_children(args, batch: int, precision: str, threads: int, processes: int) -> list:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--prep", args.prep, "--path", args.path,
           "--batch-sizes", str(batch), "--precision", precision]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for _ in range(processes)]
    results = []
    for proc in procs:
        out, err = proc.communicate()
        found = [line[len(MARK):] for line in out.splitlines() if line.startswith(MARK)]
        if proc.returncode != 0 or not found:
            sys.exit(f"scaling_generate: fairseq-generate failed ({proc.returncode}):\n{err[-2000:]}")
        results.append(json.loads(found[-1]))
    return results


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prep", required=True, help="data-prep/prepare-multi30k.sh's output (data-bin inside)")
    p.add_argument("--path", required=True, help="an rfa_transformer checkpoint of that data")
    p.add_argument("--threads", type=int, default=2, help="N (default: 2)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[32, 128])
    p.add_argument("--precisions", nargs="+", choices=sorted(OVERRIDES), default=["fp32", "int8"])
    p.add_argument("--precision", choices=sorted(OVERRIDES), help=argparse.SUPPRESS)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--csv", default=RESULTS)
    args = p.parse_args(argv)
    if not os.path.isdir(os.path.join(args.prep, "data-bin")):
        p.error(f"--prep {args.prep} has no data-bin (data-prep/prepare-multi30k.sh writes it)")
    if not os.path.isfile(args.path):
        p.error(f"--path {args.path} does not exist")
    if args.child:
        child(args.prep, args.path, args.batch_sizes[0], args.precision)
        return 0
    if args.threads < 2:
        p.error(f"--threads must be 2 or more, got {args.threads}")
    import csv

    rows = list(csv.DictReader(open(args.csv, newline=""))) if os.path.exists(args.csv) else []
    N, stamp = args.threads, datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%MZ")
    for precision in args.precisions:
        for batch in args.batch_sizes:
            runs = {"one thread": run_children(args, batch, precision, 1, 1),
                    f"{N} threads": run_children(args, batch, precision, N, 1),
                    f"{N} processes": run_children(args, batch, precision, 1, N)}
            alone = runs["one thread"][0]
            for run, results in runs.items():
                speed = sum(1000 / r["span_s"] for r in results)
                work = sum(r["work_s"] for r in results)  # the work of one test set, or of N (processes)
                sets = len(results)
                row = {"precision": precision, "batch_size": batch, "run": run, "test_sets": sets,
                       "span_s": f"{max(r['span_s'] for r in results):.3f}", "work_s": f"{work:.3f}",
                       "tail_s": f"{sum(r['tail_s'] for r in results):.3f}",
                       "minor_faults": sum(r["minor_faults"] for r in results),
                       "sentences_per_s": f"{speed:.1f}", "scaling": f"{speed * alone['span_s'] / 1000:.3f}",
                       "work_vs_one_thread": f"{work / (sets * alone['work_s']):.3f}",
                       "machine": machine_description("cpu"), "measured_utc": stamp}
                rows = [r for r in rows if (r["precision"], str(r["batch_size"]), r["run"]) !=
                        (precision, str(batch), run)] + [row]
                print(f"{precision} batch {batch:>4} {run:>12}: {row['sentences_per_s']:>7} sentences/s, "
                      f"x{row['scaling']} one thread; work x{row['work_vs_one_thread']}, tail {row['tail_s']} s, "
                      f"{row['minor_faults']} faults", flush=True)
            write_csv(args.csv, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
