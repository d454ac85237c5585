#!/usr/bin/env python3
"""The users' sizes against CTranslate2, in one command: checkpoints, every benchmark point, the weight floor.

1. benchmarks/user_size_checkpoints.py: transformer base and big with a 32k joint vocabulary, the default
   rfa_transformer and its softmax twin (a few updates), the twin converted for CTranslate2 (float32, int8);
2. benchmarks/benchmark_generate.py --size <size> per size: fairseq-generate (rfa fp32 and int8) against
   CTranslate2 (float32 and int8 at its best split of the threads: intra x inter) at every forced length, batch
   size, thread count and instruction-set level (native: the CPU's own; capped: benchmark_common.ISA_CAPS), beam 4,
   the first --sentences test_2016_flickr sources, each engine's process's peak RSS per point
   -> <results-dir>/generate_user_<size>_cpu.csv and .png;
3. benchmarks/weight_floor.py: the batch-1 step against the weights' reading floor
   -> <results-dir>/weight_floor_cpu.csv.

Every step skips what is done (checkpoints that exist, CSV rows already measured), so an interrupted run continues.

    python benchmarks/user_size_benchmarks.py                  # the whole matrix (hours: docs/benchmarks.md)
    python benchmarks/user_size_benchmarks.py --dry-run        # the runs it would make, nothing measured
    python benchmarks/user_size_benchmarks.py --shortlist      # also the shortlist models against use_vmap
    python benchmarks/user_size_benchmarks.py --sizes base --forced-lengths 16 --batch-sizes 1 32 --threads 1 \\
        --sentences 20 --results-dir outputs/user_size_check  # a small slice
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchmark_generate  # noqa: E402
import user_size_checkpoints  # noqa: E402
from benchmark_common import ISA_CAPS, REPO  # noqa: E402

# precision -> (the plugin's model, CTranslate2's) in benchmark_generate.py; with --shortlist also the plugin's
# shortlist model and CTranslate2's use_vmap on the same table
PRECISION_MODELS = {"fp32": ("rfa", "ct2_softmax"), "int8": ("rfa_int8", "ct2_softmax_int8")}
SHORTLIST_PRECISION_MODELS = {"fp32": ("rfa_shortlist", "ct2_softmax_vmap"),
                              "int8": ("rfa_int8_shortlist", "ct2_softmax_int8_vmap")}
DEFAULTS = {"sizes": ["base", "big"], "forced_lengths": [16, 32, 64], "batch_sizes": [1, 32, 128], "threads": [1, 2],
            "cpu_isas": ["native", "avx2"], "precisions": ["fp32", "int8"], "sentences": 100, "repeats": 2}


def models_of(args) -> list:
    """benchmark_generate.py's models of the precisions (and, with --shortlist, their shortlist and vmap twins)."""
    tables = [PRECISION_MODELS] + ([SHORTLIST_PRECISION_MODELS] if args.shortlist else [])
    return [m for precision in args.precisions for table in tables for m in table[precision]]


def shortlist_tag(args) -> str:
    """The shortlist column of the shortlist models' rows: the data-bin's file is built with rfa-build-shortlist's
    defaults (benchmark_generate.py's --shortlist default)."""
    from rfa_fairseq.cli.build_shortlist import DEFAULT_K, DEFAULT_N

    return f"k{DEFAULT_K}_n{DEFAULT_N}"


def generate_argv(args, size: str) -> list:
    """benchmark_generate.py's arguments for one size."""
    models = models_of(args)
    return ["--size", size, "--prep", args.prep, "--user-size-dir", args.user_size_dir, "--models", *models,
            "--sentences", str(args.sentences), "--forced-length", *map(str, args.forced_lengths),
            "--batch-sizes", *map(str, args.batch_sizes), "--threads", *map(str, args.threads),
            "--cpu-isa", *args.cpu_isas, "--repeats", str(args.repeats), "--csv", csv_path(args, size)]


def csv_path(args, size: str) -> str:
    return os.path.join(args.results_dir, f"generate_user_{size}_cpu.csv")


def planned_runs(args, size: str, rows=()) -> int:
    """The engine processes benchmark_generate.py will start for one size: per point not yet in `rows` (CSV rows),
    one per model and repeat, CTranslate2 once per split of the threads."""
    models = models_of(args)
    runs = 0
    for cpu_isa in args.cpu_isas:
        for length in args.forced_lengths:
            for threads in args.threads:
                for batch in args.batch_sizes:
                    def key_of(model):
                        shortlisted = model in benchmark_generate.SHORTLIST_MODELS + benchmark_generate.VMAP_MODELS
                        return benchmark_generate.row_key({
                            "device": "cpu", "size": size, "cpu_isa": cpu_isa, "forced_length": length,
                            "sentences": args.sentences, "threads": threads, "batch_size": batch, "model": model,
                            "shortlist": shortlist_tag(args) if shortlisted else ""})

                    todo = benchmark_generate.models_to_measure(list(rows), key_of, models)
                    runs += args.repeats * sum(len(benchmark_generate.ct2_configs(threads))
                                               if m in benchmark_generate.CT2_MODELS else 1 for m in todo)
    return runs


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prep", default=user_size_checkpoints.DEFAULT_PREP,
                   help="output of data-prep/prepare-multi30k.sh (default outputs/multi30k)")
    p.add_argument("--user-size-dir", default=user_size_checkpoints.DEFAULT_OUT_DIR,
                   help="the checkpoints' folder (user_size_checkpoints.py --out-dir; default outputs/user_size)")
    p.add_argument("--sizes", nargs="+", default=DEFAULTS["sizes"], choices=list(user_size_checkpoints.SIZES))
    p.add_argument("--forced-lengths", nargs="+", type=int, default=DEFAULTS["forced_lengths"])
    p.add_argument("--batch-sizes", nargs="+", type=int, default=DEFAULTS["batch_sizes"])
    p.add_argument("--threads", nargs="+", type=int, default=DEFAULTS["threads"])
    p.add_argument("--cpu-isas", nargs="+", default=DEFAULTS["cpu_isas"], choices=["native", *ISA_CAPS],
                   help="native: the CPU's own level; others: every library capped there (default: native avx2)")
    p.add_argument("--precisions", nargs="+", default=DEFAULTS["precisions"], choices=list(PRECISION_MODELS))
    p.add_argument("--shortlist", action="store_true",
                   help="also the default model with its vocabulary shortlist (rfa_shortlist, rfa_int8_shortlist: the "
                        "data-bin's, rfa-build-shortlist's defaults) and CTranslate2 with use_vmap on the same table "
                        "(ct2_softmax_vmap, ct2_softmax_int8_vmap)")
    p.add_argument("--sentences", type=int, default=DEFAULTS["sentences"],
                   help="the first N test_2016_flickr sources (default 100)")
    p.add_argument("--repeats", type=int, default=DEFAULTS["repeats"], help="runs per point; the fastest counts")
    p.add_argument("--results-dir", default=os.path.join(REPO, "benchmarks", "results"),
                   help="where the CSVs and PNGs go (default benchmarks/results)")
    p.add_argument("--no-floor", action="store_true", help="skip benchmarks/weight_floor.py")
    p.add_argument("--dry-run", action="store_true", help="print the runs each size needs; measure nothing")
    args = p.parse_args(argv)
    for name in ("forced_lengths", "batch_sizes", "threads"):
        if min(getattr(args, name)) < 1:
            p.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.sentences < 1 or args.repeats < 1:
        p.error(f"--sentences and --repeats must be positive, got {args.sentences} and {args.repeats}")
    return args


def main(argv=None) -> int:
    import csv

    args = parse_args(argv)

    total = 0
    for size in args.sizes:
        rows = []
        if os.path.exists(csv_path(args, size)):
            with open(csv_path(args, size), newline="") as f:
                rows = list(csv.DictReader(f))
        runs = planned_runs(args, size, rows)
        total += runs
        print(f"user_size_benchmarks: {size}: {runs} engine runs to make -> {csv_path(args, size)}", flush=True)
    if args.dry_run:
        for size in args.sizes:
            print("python benchmarks/benchmark_generate.py " + " ".join(generate_argv(args, size)))
        print(f"user_size_benchmarks: {total} runs in all (dry run: nothing measured)")
        return 0
    os.makedirs(args.results_dir, exist_ok=True)
    for size in args.sizes:
        try:
            user_size_checkpoints.size_files(size, args.prep, args.user_size_dir)
        except (user_size_checkpoints.UserSizeError, ValueError) as exc:
            print(f"user_size_benchmarks: error: {exc}", file=sys.stderr)
            return 1
    for size in args.sizes:
        status = benchmark_generate.main(generate_argv(args, size))
        if status:
            return status
    if not args.no_floor:
        import weight_floor

        floor_argv = ["--sizes", "recipe", *args.sizes, "--cpu-isa", *args.cpu_isas,
                      "--csv", os.path.join(args.results_dir, "weight_floor_cpu.csv")]
        for size in args.sizes:
            floor_argv += ["--generate-csv", f"{size}={csv_path(args, size)}"]
        return weight_floor.main(floor_argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
