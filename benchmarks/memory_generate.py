#!/usr/bin/env python3
"""Where a decoding process's memory goes: the default rfa_transformer (fp32 and int8) against CTranslate2 on its
softmax twin, stage by stage, as a deployment loads and runs them.

Each engine runs in a process of its own that decodes test_2016_flickr (beam 4, max length source + 50, batches of
each of --batch-sizes sentences in turn, one thread) and reads its resident memory (VmRSS) and its peak so far (VmHWM) from
/proc/self/status after each stage:

  rfa: python -> import torch -> import fairseq and the plugin -> load the checkpoint (fairseq's
       load_model_ensemble_and_task) -> load the test set -> build the generator (weights packed, one warm-up step)
       -> decode the test set
  ct2: python -> import ctranslate2 and sentencepiece -> load the model (ctranslate2.Translator) -> read the test set
       -> decode the test set

and, for rfa, the tensors behind it after decoding: the model's parameters and buffers, and what the packed linear
layers hold beside them (the library's packed weights, int8 codes, the few-rows kernels' blocks), by module.
One CSV row per (engine, precision, stage or tensor group).

    python benchmarks/memory_generate.py --prep outputs/multi30k --study-dir outputs/quality

The checkpoints and CTranslate2 conversions are benchmark_generate.py's (`checkpoint_of`, `ct2_model_of`: trained and
converted there when missing). Files: benchmarks/results/memory_generate_multi30k_cpu.csv (rewritten whole; a run is
about a minute per batch size).
"""
import argparse
import json
import os
import subprocess
import sys
from datetime import datetime, timezone

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIELDS = ["engine", "precision", "batch_size", "kind", "stage", "rss_mb", "peak_mb", "mb", "machine", "measured_utc"]


def memory_mb():
    """(VmRSS, VmHWM) of this process, in MB."""
    values = {}
    with open("/proc/self/status") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name in ("VmRSS", "VmHWM"):
                values[name] = int(rest.split()[0]) / 1024
    return values["VmRSS"], values["VmHWM"]


def stage(stages, name):
    rss, peak = memory_mb()
    stages.append({"stage": name, "rss_mb": round(rss, 1), "peak_mb": round(peak, 1)})


def tensor_mb(tensor) -> float:
    """The bytes behind a tensor, in MB: its storage's, or for oneDNN's opaque packed tensors its elements'."""
    try:
        return tensor.untyped_storage().nbytes() / 2**20
    except NotImplementedError:  # OpaqueTensorImpl: no storage to ask
        return tensor.numel() * tensor.element_size() / 2**20


def tensor_key(tensor) -> int:
    try:
        return tensor.untyped_storage().data_ptr()
    except NotImplementedError:
        return id(tensor)


def rfa_child(args) -> dict:
    """The rfa stages in this process (one thread); -> {"stages": [...], "tensors": {group: MB}}."""
    stages = []
    stage(stages, "python")
    import gc

    import torch

    torch.set_num_threads(1)
    stage(stages, "import torch")
    from fairseq import checkpoint_utils

    sys.path.insert(0, REPO)
    import rfa_fairseq  # noqa: F401  (registers the plugin)
    from rfa_fairseq.ops.step import PackedLinear

    stage(stages, "import fairseq and the plugin")
    models, cfg, task = checkpoint_utils.load_model_ensemble_and_task(
        [args.model], arg_overrides={"data": os.path.join(args.prep, "data-bin"), "rfa_decode_precision": args.precision})
    model = models[0]
    gc.collect()
    stage(stages, "load the checkpoint")
    task.load_dataset("test")
    stage(stages, "load the test set")
    generation = cfg.generation
    generation.beam, generation.lenpen, generation.max_len_a, generation.max_len_b = 4, 1, 1, 50
    model.prepare_for_inference_(cfg)
    generator = task.build_generator(models, generation)
    gc.collect()
    stage(stages, "build the generator")
    batches = task.get_batch_iterator(dataset=task.dataset("test"), max_sentences=args.batch_size,
                                      required_batch_size_multiple=1).next_epoch_itr(shuffle=False)
    with torch.no_grad():
        for batch in batches:
            task.inference_step(generator, models, batch)
    gc.collect()
    stage(stages, "decode the test set")

    tensors = {"parameters and buffers": sum(tensor_mb(t) for t in list(model.parameters()) + list(model.buffers()))}
    seen, parameters = set(), {tensor_key(p) for p in model.parameters()}
    for obj in gc.get_objects():
        if not isinstance(obj, PackedLinear):
            continue
        for field in ("weight", "rows_weight", "bias", "w_scales", "rows_sums"):
            tensor = getattr(obj, field)
            if tensor is None or tensor_key(tensor) in seen or tensor_key(tensor) in parameters:
                continue  # counted, or a parameter itself (the torch library packs nothing)
            seen.add(tensor_key(tensor))
            group = {"weight": "packed weights (the library's layout or int8 codes)",
                     "rows_weight": "few-rows blocks (a second layout of the weights)"}.get(field, "scales, sums, biases")
            tensors[group] = tensors.get(group, 0.0) + tensor_mb(tensor)
    return {"stages": stages, "tensors": {k: round(v, 3) for k, v in tensors.items()}}


def ct2_child(args) -> dict:
    stages = []
    stage(stages, "python")
    import ctranslate2
    import sentencepiece  # noqa: F401  (what a CTranslate2 deployment loads to tokenize)

    stage(stages, "import ctranslate2 and sentencepiece")
    translator = ctranslate2.Translator(args.model, device="cpu", compute_type=args.precision.replace("fp32", "float32"),
                                        intra_threads=1, inter_threads=1)
    stage(stages, "load the model")
    with open(os.path.join(args.prep, "test.spm.en")) as f:
        sources = [line.split() for line in f]
    stage(stages, "load the test set")
    translator.translate_batch(sources, max_batch_size=args.batch_size, beam_size=4, length_penalty=1.0,
                               max_decoding_length=max(len(s) for s in sources) + 50)
    stage(stages, "decode the test set")
    return {"stages": stages, "tensors": {}}


def measure(engine: str, precision: str, model: str, batch_size: int, args) -> dict:
    """One engine's stages at batches of `batch_size`, in a process of its own; model: the rfa checkpoint or the
    CTranslate2 directory."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", engine, "--precision", precision, "--model", model,
           "--prep", args.prep, "--batch-size", str(batch_size)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"memory_generate: {engine} {precision} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prep", default="outputs/multi30k", help="output of data-prep/prepare-multi30k.sh")
    p.add_argument("--study-dir", default=os.path.join(REPO, "outputs", "quality"), help="the quality study's --work-dir")
    p.add_argument("--max-update", type=int, default=1000, help="the checkpoints' training updates")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32],
                   help="one process per engine, precision and batch size (1: a service's one sentence at a time)")
    p.add_argument("--batch-size", type=int, help=argparse.SUPPRESS)  # the child's
    p.add_argument("--csv", default=os.path.join(REPO, "benchmarks", "results", "memory_generate_multi30k_cpu.csv"))
    p.add_argument("--child", choices=["rfa", "ct2"], help=argparse.SUPPRESS)
    p.add_argument("--precision", choices=["fp32", "int8"], help=argparse.SUPPRESS)  # the child's
    p.add_argument("--model", help=argparse.SUPPRESS)  # the child's checkpoint or CTranslate2 directory
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps((rfa_child if args.child == "rfa" else ct2_child)(args)))
        return 0
    if not os.path.exists(os.path.join(args.prep, "test.spm.en")):
        raise SystemExit(f"memory_generate: {args.prep}/test.spm.en is missing: run data-prep/prepare-multi30k.sh first")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import benchmark_generate
    from benchmark_common import write_csv

    # benchmark_generate's study arguments, for its checkpoint_of / ct2_model_of
    study = argparse.Namespace(study_dir=args.study_dir, prep=args.prep, max_update=args.max_update, seed=args.seed,
                               device="cpu", variant_override={}, train_timeout=6 * 3600,
                               study_csv=os.path.join(REPO, "benchmarks", "results", "quality_multi30k_cpu.csv"))
    study.checkpoints = {m: benchmark_generate.checkpoint_of(study, m) for m in ("rfa", *benchmark_generate.CT2_MODELS)}
    models = {("rfa", "fp32"): study.checkpoints["rfa"], ("rfa", "int8"): study.checkpoints["rfa"],
              ("ct2", "fp32"): benchmark_generate.ct2_model_of(study, "ct2_softmax"),
              ("ct2", "int8"): benchmark_generate.ct2_model_of(study, "ct2_softmax_int8")}
    now, machine = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%MZ"), benchmark_generate.machine("cpu")
    rows = []
    for batch_size in args.batch_sizes:
        for engine in ("rfa", "ct2"):
            for precision in ("fp32", "int8"):
                result = measure(engine, precision, models[engine, precision], batch_size, args)
                common = {"engine": engine, "precision": precision, "batch_size": batch_size, "machine": machine,
                          "measured_utc": now}
                before, name = 0.0, f"{engine} {precision} b{batch_size}"
                for s in result["stages"]:
                    rows.append({**common, "kind": "stage", **s, "mb": round(s["rss_mb"] - before, 1)})
                    before = s["rss_mb"]
                    print(f"{name}: {s['stage']:<40} RSS {s['rss_mb']:7.1f} MB  peak {s['peak_mb']:7.1f} MB")
                for group, mb in result["tensors"].items():
                    rows.append({**common, "kind": "tensors", "stage": group, "mb": round(mb, 1)})
                    print(f"{name}:   tensors: {group:<50} {mb:7.1f} MB")
    write_csv(args.csv, [{field: row.get(field, "") for field in FIELDS} for row in rows])
    print(f"memory_generate: wrote {args.csv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
