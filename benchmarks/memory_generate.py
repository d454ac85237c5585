#!/usr/bin/env python3
"""Where a decoding process's memory goes, at the recipe size and at the sizes users decode: the default
rfa_transformer (fp32 and int8) as fairseq-generate loads and runs it, against CTranslate2's whole process on its
softmax twin.

Each point runs in a process of its own: one engine, precision, size and batch size, decoding the first --sentences
test_2016_flickr sources (beam 4, one thread, every hypothesis forced to --forced-length tokens so that both engines
do the same work whatever the weights: benchmarks/user_size_checkpoints.py says why). It reads its resident memory
(VmRSS, with its anonymous and file-backed parts) and its peak so far (VmHWM) from /proc/self/status after each stage:

  rfa: python -> imports (torch, fairseq, the plugin) -> weights (fairseq's load_model_ensemble_and_task: the
       checkpoint mapped, the parameters its pages) -> runtime (the generator built and one batch decoded: every
       weight packed once, the file pages given back) -> decode (the rest of the sentences)
  ct2: python -> imports (ctranslate2, sentencepiece) -> weights (ctranslate2.Translator) -> decode

and splits it: imports (RSS after them), weights (what loading added), runtime (what building the runtimes and the first
batch added), a batch's working memory (the peak while decoding over the RSS before it), and decoding's own peak (the
process's peak over its imports): what the plugin adds to a process that has torch and fairseq. For rfa it also counts
the bytes the runtimes decode with: the packed linear layers (fp32 blocks, or int8 codes with their scales) and the
embedding table (read row by row, in its checkpoint's mapping).

    python benchmarks/memory_generate.py --prep outputs/multi30k --sizes recipe base big

Checkpoints: the recipe's are benchmark_generate.py's (the quality study's, trained when missing); base and big are
benchmarks/user_size_checkpoints.py's (made when missing). Files: benchmarks/results/memory_generate_cpu.csv (one row
per point; points already there are kept, --redo measures them again).
"""
import argparse
import json
import os
import subprocess
import sys
from datetime import datetime, timezone

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
CSV = os.path.join(REPO, "benchmarks", "results", "memory_generate_cpu.csv")
KEY = ("size", "engine", "precision", "batch_size", "forced_length", "sentences")
FIELDS = [*KEY, "imports_mb", "weights_mb", "runtime_mb", "batch_working_mb", "own_peak_mb", "peak_mb",
          "final_rss_mb", "final_anon_mb", "final_file_mb", "packed_mb", "embedding_mb", "stages", "machine",
          "measured_utc"]
SIZES = ("recipe", "base", "big")


def memory():
    """{rss, peak, anon, file} of this process in MiB (/proc/self/status)."""
    names = {"VmRSS": "rss", "VmHWM": "peak", "RssAnon": "anon", "RssFile": "file"}
    values = {}
    with open("/proc/self/status") as status:
        for line in status:
            name, _, rest = line.partition(":")
            if name in names:
                values[names[name]] = round(int(rest.split()[0]) / 1024, 1)
    return values


def tensor_mb(tensor) -> float:
    return tensor.numel() * tensor.element_size() / 2**20


def rfa_child(args) -> dict:
    stages = [("python", memory())]
    import gc

    import torch

    torch.set_num_threads(1)
    from fairseq import checkpoint_utils

    sys.path.insert(0, REPO)
    import rfa_fairseq  # noqa: F401  (registers the plugin)
    from rfa_fairseq.ops.step import PackedLinear

    stages.append(("imports", memory()))
    models, cfg, task = checkpoint_utils.load_model_ensemble_and_task(
        [args.model], arg_overrides={"data": args.data_bin, "rfa_decode_precision": args.precision})
    model = models[0]
    gc.collect()
    stages.append(("weights", memory()))
    task.load_dataset(args.split)
    generation = cfg.generation
    generation.beam, generation.lenpen = 4, 1.0
    generation.min_len, generation.max_len_a, generation.max_len_b = args.forced_length, 0, args.forced_length
    model.prepare_for_inference_(cfg)
    generator = task.build_generator(models, generation)
    batches = task.get_batch_iterator(dataset=task.dataset(args.split), max_sentences=args.batch_size,
                                      required_batch_size_multiple=1).next_epoch_itr(shuffle=False)
    decoded = 0
    with torch.no_grad():
        for batch in batches:
            task.inference_step(generator, models, batch)
            decoded += batch["nsentences"]
            if len(stages) == 3:
                gc.collect()
                stages.append(("runtime", memory()))
    gc.collect()
    stages.append(("decode", memory()))
    if decoded != args.sentences:
        raise SystemExit(f"memory_generate: decoded {decoded} sentences of the {args.split} split, not {args.sentences}")
    packed = {id(obj): obj for obj in gc.get_objects() if isinstance(obj, PackedLinear)}
    packed_mb = sum(tensor_mb(t) for p in packed.values()
                    for t in (p.weight, p.bias, p.w_scales, p.w_sums) if t is not None)
    return {"stages": stages, "packed_mb": round(packed_mb, 3),
            "embedding_mb": round(tensor_mb(model.decoder.embed_tokens.weight), 3)}


def ct2_child(args) -> dict:
    stages = [("python", memory())]
    import ctranslate2
    import sentencepiece  # noqa: F401  (what a CTranslate2 deployment loads to tokenize)

    stages.append(("imports", memory()))
    translator = ctranslate2.Translator(args.model, device="cpu", compute_type=args.precision.replace("fp32", "float32"),
                                        intra_threads=1, inter_threads=1)
    stages.append(("weights", memory()))
    with open(args.source, encoding="utf-8") as f:
        sources = [line.split() for line in f][: args.sentences]
    translator.translate_batch(sources, max_batch_size=args.batch_size, beam_size=4, length_penalty=1.0,
                               min_decoding_length=args.forced_length, max_decoding_length=args.forced_length)
    stages.append(("decode", memory()))
    return {"stages": stages}


def split_of(stages) -> dict:
    """The stages' split (MiB): imports, weights, runtime (rfa), a batch's working memory, decoding's own peak."""
    at = dict(stages)
    before_decode = at.get("runtime", at["weights"])
    return {"imports_mb": at["imports"]["rss"], "weights_mb": round(at["weights"]["rss"] - at["imports"]["rss"], 1),
            "runtime_mb": round(at["runtime"]["rss"] - at["weights"]["rss"], 1) if "runtime" in at else "",
            "batch_working_mb": round(at["decode"]["peak"] - before_decode["rss"], 1),
            "own_peak_mb": round(at["decode"]["peak"] - at["imports"]["rss"], 1), "peak_mb": at["decode"]["peak"],
            "final_rss_mb": at["decode"]["rss"], "final_anon_mb": at["decode"]["anon"],
            "final_file_mb": at["decode"]["file"]}


def measure(args, size, engine, precision, batch_size, files) -> dict:
    """One point in a process of its own -> its CSV row."""
    model = files["rfa"] if engine == "rfa" else files[f"ct2_{precision}"]
    cmd = [sys.executable, os.path.abspath(__file__), "--child", engine, "--precision", precision, "--model", model,
           "--data-bin", files["data_bin"], "--source", files["source"], "--split", files["split"],
           "--batch-size", str(batch_size), "--forced-length", str(args.forced_length),
           "--sentences", str(args.sentences)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"memory_generate: {size} {engine} {precision} b{batch_size} failed (exit {proc.returncode}):\n"
                         f"{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"size": size, "engine": engine, "precision": precision, "batch_size": batch_size,
            "forced_length": args.forced_length, "sentences": args.sentences, **split_of(result["stages"]),
            "packed_mb": result.get("packed_mb", ""), "embedding_mb": result.get("embedding_mb", ""),
            "stages": json.dumps(result["stages"])}


def size_files(args, size) -> dict:
    """What decodes `size`: the rfa checkpoint, the CTranslate2 conversions of its softmax twin, the data-bin, the
    SentencePiece test sources and the split of --sentences sentences."""
    import user_size_checkpoints

    if size == "recipe":
        import benchmark_generate

        study = argparse.Namespace(study_dir=args.study_dir, prep=args.prep, max_update=args.max_update, seed=args.seed,
                                   device="cpu", variant_override={}, train_timeout=6 * 3600,
                                   study_csv=os.path.join(REPO, "benchmarks", "results", "quality_multi30k_cpu.csv"))
        study.checkpoints = {m: benchmark_generate.checkpoint_of(study, m) for m in ("rfa", "softmax")}
        study.checkpoints.update({m: study.checkpoints["softmax"] for m in benchmark_generate.CT2_MODELS})
        files = {"rfa": study.checkpoints["rfa"], "ct2_fp32": benchmark_generate.ct2_model_of(study, "ct2_softmax"),
                 "ct2_int8": benchmark_generate.ct2_model_of(study, "ct2_softmax_int8"),
                 "data_bin": os.path.join(args.prep, "data-bin"), "source": os.path.join(args.prep, "test.spm.en")}
    else:
        made = user_size_checkpoints.size_files(size, args.prep, args.user_size_dir)
        files = {"rfa": made.checkpoints["rfa"], "ct2_fp32": made.ct2_models["float32"],
                 "ct2_int8": made.ct2_models["int8"], "data_bin": made.data_bin, "source": made.source}
    files["split"] = user_size_checkpoints.test_subset(files["data_bin"], args.sentences)
    return files


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prep", default=os.path.join(REPO, "outputs", "multi30k"),
                   help="output of data-prep/prepare-multi30k.sh")
    p.add_argument("--sizes", nargs="+", default=list(SIZES), choices=SIZES)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32],
                   help="one process per engine, precision, size and batch size (1: a service's one sentence at a time)")
    p.add_argument("--forced-length", type=int, default=16, help="every hypothesis this many tokens")
    p.add_argument("--sentences", type=int, default=100, help="the first test sentences decoded")
    p.add_argument("--study-dir", default=os.path.join(REPO, "outputs", "quality"), help="the quality study's --work-dir")
    p.add_argument("--user-size-dir", default=os.path.join(REPO, "outputs", "user_size"))
    p.add_argument("--max-update", type=int, default=1000, help="the recipe checkpoints' training updates")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--csv", default=CSV)
    p.add_argument("--redo", action="store_true", help="measure the points already in the CSV again")
    for hidden in ("--child", "--precision", "--model", "--data-bin", "--source", "--split"):
        p.add_argument(hidden, help=argparse.SUPPRESS)
    p.add_argument("--batch-size", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps((rfa_child if args.child == "rfa" else ct2_child)(args)))
        return 0
    if args.forced_length < 1 or args.sentences < 1 or min(args.batch_sizes) < 1:
        p.error("--forced-length, --sentences and --batch-sizes must be positive")
    from benchmark_common import write_csv
    from benchmark_generate import machine

    rows = []
    if os.path.exists(args.csv):
        import csv

        with open(args.csv, newline="") as f:
            rows = list(csv.DictReader(f))
    done = {tuple(str(row[k]) for k in KEY) for row in rows}
    now, machine_name = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%MZ"), machine("cpu")
    for size in args.sizes:
        files = None
        for batch_size in args.batch_sizes:
            for engine in ("rfa", "ct2"):
                for precision in ("fp32", "int8"):
                    key = (size, engine, precision, str(batch_size), str(args.forced_length), str(args.sentences))
                    if key in done and not args.redo:
                        continue
                    files = files or size_files(args, size)
                    row = {**measure(args, size, engine, precision, batch_size, files), "machine": machine_name,
                           "measured_utc": now}
                    rows = [r for r in rows if tuple(str(r[k]) for k in KEY) != key] + [row]
                    write_csv(args.csv, [{field: r.get(field, "") for field in FIELDS} for r in rows])
                    print(f"{size:6s} {engine} {precision} b{batch_size:<3d}: imports {row['imports_mb']:7.1f} MiB, "
                          f"own peak {row['own_peak_mb']:7.1f} MiB (weights {row['weights_mb']}, runtime "
                          f"{row['runtime_mb']}, a batch {row['batch_working_mb']}), process peak {row['peak_mb']:7.1f}")
    print(f"memory_generate: {args.csv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
