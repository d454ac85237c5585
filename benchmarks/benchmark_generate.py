#!/usr/bin/env python3
"""fairseq-generate on real data: the default rfa_transformer vs its softmax twin, as a user runs it.

Takes the quality study's Multi30k EN-DE checkpoints (scripts/quality_study.py; trained first when
missing), translates test_2016_flickr with fairseq-generate (beam 4, length penalty 1, max length
source + 50, SentencePiece-decoded) at each --batch-sizes (sentences per batch) and --threads, the
models alternating within each repeat, and writes one CSV row per (device, threads, batch size, model):
sentences/s and tokens/s from fairseq-generate's own timer (generation only, the fastest of
--repeats), the process's peak memory (RSS on CPU, torch's max allocated on CUDA), sacreBLEU, and the
speed ratio to softmax measured in the same repeat loop. `rfa_torch` is the RFA model decoding with the
torch kernels (--rfa-decode-kernel torch) instead of the C++ ones: its row also says how many hypotheses
are identical to the C++ kernels' and the BLEU difference (the C++ kernels' correctness on real data).

`ct2_softmax` and `ct2_softmax_int8` are the same softmax checkpoint converted by CTranslate2's
ct2-fairseq-converter (float32 and int8 weights; converted once, beside the checkpoint) and translated by
CTranslate2 (benchmarks/ctranslate2_generate.py: same beam, length penalty, batch size and threads), the
engine the field uses for fast CPU inference, at its best configuration for the thread count: N threads
within one batch (intra_threads) or N batches at once with one thread each (inter_threads), the faster of
the two in each repeat (the CSV's ct2_config); every row's speed_vs_ct2 (speed_vs_ct2_int8) is its speed
over ct2_softmax's (ct2_softmax_int8's) in the same repeat loop, and a CTranslate2 row's identical_to_softmax says how many of its hypotheses are
fairseq's softmax hypotheses (how faithful the conversion is). The CTranslate2 rows need the `ctranslate2`
package (the bench extra); without it they are left out with a message.

`rfa_shortlist` and `rfa_int8_shortlist` decode the default model (fp32, int8) with a vocabulary shortlist
(--rfa-shortlist: each batch's output projection and log-softmax over its sources' candidates; --shortlist, default
the data-bin's shortlist.en-de.npz built by rfa-build-shortlist, --shortlist-k / --shortlist-n its K and N), and
`ct2_softmax_vmap` / `ct2_softmax_int8_vmap` the CTranslate2 conversions with the same table as its vocabulary map
(ct2-fairseq-converter --vocab_mapping, translated with use_vmap); speed_vs_ct2_vmap (speed_vs_ct2_int8_vmap) is a
row's speed over theirs, and the CSV's shortlist column says which K and N (kK_nN).

--size base / big decodes the users' sizes instead of the recipe model: transformer base / big with a 32k joint
vocabulary, the default rfa_transformer and its softmax twin trained a few updates, made once by
benchmarks/user_size_checkpoints.py (under outputs/user_size), with forced lengths (--forced-length, required there:
the work of a step does not depend on the weights then). --sentences N decodes the first N test sentences only.
--cpu-isa and --forced-length take several values: every point is measured at each (the CSV's cpu_isa and
forced_length columns), `native` being the CPU's own level (no cap).

    python benchmarks/benchmark_generate.py --prep outputs/multi30k                # CPU, batch 32 and 128, 1 and 2 threads
    python benchmarks/benchmark_generate.py --prep outputs/multi30k --device cuda  # on a GPU
    python benchmarks/benchmark_generate.py --size base --sentences 100 --forced-length 16 32 64 \
        --batch-sizes 1 32 128 --threads 1 2 --cpu-isa native avx2                 # the users' base size
    python benchmarks/benchmark_generate.py --size base --forced-length 16 --batch-sizes 1 32 128 --threads 1 2 \
        --models rfa rfa_shortlist rfa_int8 rfa_int8_shortlist ct2_softmax ct2_softmax_int8 ct2_softmax_vmap \
        ct2_softmax_int8_vmap                                                      # the shortlist against use_vmap

Finished rows are kept (the CSV is rewritten whole after each point): a row is done when the CSV has one for its
device, size, instruction-set level, forced length, number of sentences, threads, batch size and model; --redo
measures them again. Files: benchmarks/results/generate_multi30k_<device>[_<isa>][_forced<L>].csv and .png
(--size recipe), benchmarks/results/generate_user_<size>_<device>.csv and .png (--size base / big).
"""
import argparse
import ast
import csv
import datetime
import importlib.util
import itertools
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmark_common import (  # noqa: E402
    ISA_CAPS,
    PLUGIN_DIR,
    REPO,
    cpu_isa_environment,
    detokenized_hypotheses,
    device_tag,
    length_flags,
    pyplot,
    write_csv,
)

import user_size_checkpoints  # noqa: E402

sys.path.insert(0, os.path.join(REPO, "scripts"))
from quality_study import DEFAULT_MODEL_VARIANTS, default_model_variant  # noqa: E402

DEFAULT_VARIANT = default_model_variant()
# model name -> (quality-study variant whose checkpoint it decodes, extra fairseq-generate flags)
MODELS = {
    "softmax": ("softmax", []),
    "rfa": (DEFAULT_VARIANT, []),  # the default model
    "rfa_torch": (DEFAULT_VARIANT, ["--model-overrides", "{'rfa_decode_kernel': 'torch'}"]),
    # the default model with int8 linear layers (--rfa-decode-precision int8, CPU)
    "rfa_int8": (DEFAULT_VARIANT, ["--model-overrides", "{'rfa_decode_precision': 'int8'}"]),
    # CPU: each batch decoded as one part on every thread (intra-op threads), not split into one part per thread
    "rfa_intra": (DEFAULT_VARIANT, ["--model-overrides", "{'rfa_decode_parts': 1}"]),
    "rfa_int8_intra": (DEFAULT_VARIANT, ["--model-overrides", "{'rfa_decode_precision': 'int8', 'rfa_decode_parts': 1}"]),
    # CPU: the default model decoding each batch over its vocabulary shortlist's union (--rfa-shortlist: the file of
    # --shortlist, its first --shortlist-k / --shortlist-n), fp32 and int8
    "rfa_shortlist": (DEFAULT_VARIANT, []),
    "rfa_int8_shortlist": (DEFAULT_VARIANT, ["--model-overrides", "{'rfa_decode_precision': 'int8'}"]),
    # CUDA: the default model with its decoding step run eagerly, not replayed as CUDA graphs (the reference)
    "rfa_eager": (DEFAULT_VARIANT, ["--model-overrides", "{'rfa_cuda_graphs': False}"]),
    # the default model trained at each number of features D (the study's D variants; the default's is also
    # rfa's checkpoint, named for the tables measured when another D was the default)
    **{f"rfa_d{d}": (variant, []) for d, variant in sorted(DEFAULT_MODEL_VARIANTS.items())},
}
# CTranslate2 model name -> (quality-study variant it converts, ct2-fairseq-converter --quantization)
CT2_MODELS = {
    "ct2_softmax": ("softmax", "float32"),
    "ct2_softmax_int8": ("softmax", "int8"),
    # converted with the shortlist's table as CTranslate2's vocabulary map (--vocab_mapping), translated with use_vmap
    "ct2_softmax_vmap": ("softmax", "float32"),
    "ct2_softmax_int8_vmap": ("softmax", "int8"),
}
SHORTLIST_MODELS = ("rfa_shortlist", "rfa_int8_shortlist")  # decode with --rfa-shortlist (the --shortlist file)
VMAP_MODELS = ("ct2_softmax_vmap", "ct2_softmax_int8_vmap")  # CTranslate2 with use_vmap on the same table
DEFAULT_MODELS = ["softmax", "rfa", "rfa_torch", *CT2_MODELS]
# --size: recipe, the quality study's Multi30k checkpoints; base / big, user_size_checkpoints.py's
SIZES = ("recipe", *user_size_checkpoints.SIZES)
# the models of a user size (its two checkpoints decoded each way) and the default ones there
USER_SIZE_MODELS = ("softmax", "rfa", "rfa_torch", "rfa_int8", "rfa_intra", "rfa_int8_intra", "rfa_eager",
                    *SHORTLIST_MODELS, *CT2_MODELS)
DEFAULT_USER_SIZE_MODELS = ["rfa", "rfa_int8", *CT2_MODELS]
NATIVE_ISA = "native"  # --cpu-isa: the CPU's own level, nothing capped (the CSV's cpu_isa column)
# fairseq-generate's summary; its seconds have one decimal, its sentences/s two: the time is taken from the rate
TRANSLATED = re.compile(r"Translated ([\d,]+) sentences \(([\d,]+) tokens\) in ([\d.]+)s \(([\d.]+) sentences/s")
# a row's identity: one is measured once per CSV (rows of CSVs written before a column existed read its default)
KEY = ("device", "size", "cpu_isa", "forced_length", "sentences", "threads", "batch_size", "model", "shortlist")
KEY_DEFAULTS = {"size": "recipe", "cpu_isa": NATIVE_ISA, "forced_length": "0", "shortlist": ""}
# the rfa models whose hypotheses are compared with rfa's (the same checkpoint, another decoding path)
SAME_CHECKPOINT_AS_RFA = ("rfa_torch", "rfa_eager", "rfa_int8", "rfa_intra", "rfa_int8_intra", *SHORTLIST_MODELS)


def generate_flags(model: str, no_triton_self_check: bool = False, cpu_isa: str = "", shortlist=None) -> list:
    """fairseq-generate's flags of a model: MODELS' own, and for an RFA model its --model-overrides with
    rfa_triton_self_check False (no_triton_self_check), rfa_cpu_isa (cpu_isa: a level's name) and, for the shortlist
    models, the shortlist's options (shortlist: {'rfa_shortlist': PATH, ...})."""
    flags = list(MODELS[model][1])
    overrides = {}
    if no_triton_self_check:
        overrides["rfa_triton_self_check"] = False
    if cpu_isa:
        overrides["rfa_cpu_isa"] = cpu_isa
    if model in SHORTLIST_MODELS:
        if not shortlist:
            raise ValueError(f"{model} decodes with a shortlist: give its options")
        overrides.update(shortlist)
    if not overrides or MODELS[model][0] == "softmax":
        return flags
    if "--model-overrides" not in flags:
        return flags + ["--model-overrides", repr(overrides)]
    at = flags.index("--model-overrides") + 1
    flags[at] = repr({**ast.literal_eval(flags[at]), **overrides})
    return flags


def log(message):
    print(f"[{time.strftime('%H:%M:%S')}] benchmark_generate: {message}", flush=True)


def checkpoint_of(args, model) -> str:
    """The study's checkpoint for `model`, trained (scripts/quality_study.py) when missing."""
    variant = args.variant_override.get(model, variant_of(model))
    work = os.path.join(args.study_dir, f"{variant}_u{args.max_update}_s{args.seed}")
    path = os.path.join(work, "checkpoint_best.pt")
    if not os.path.exists(path):
        log(f"{path} is missing: training {variant} ({args.max_update} updates) with scripts/quality_study.py")
        cmd = [sys.executable, os.path.join(REPO, "scripts", "quality_study.py"), "--prep", args.prep, "--variants", variant,
               "--max-update", str(args.max_update), "--seed", str(args.seed), "--work-dir", args.study_dir,
               "--device", args.device.split(":")[0], "--csv", args.study_csv]
        subprocess.run(cmd, check=True, timeout=args.train_timeout)
        if not os.path.exists(path):
            sys.exit(f"benchmark_generate: training {variant} did not write {path}")
    return path


def variant_of(model) -> str:
    return CT2_MODELS[model][0] if model in CT2_MODELS else MODELS[model][0]


def ct2_model_of(args, model) -> str:
    """The CTranslate2 conversion of the model's checkpoint (ct2-fairseq-converter), made once beside it; a vmap
    model's with the shortlist's vocabulary map (ctranslate2_<quantization>_vmap_<shortlist>)."""
    checkpoint = args.checkpoints[model]
    quantization = CT2_MODELS[model][1]
    vmap = args.ct2_vmap if model in VMAP_MODELS else None
    name = f"ctranslate2_{quantization}" + (f"_vmap_{args.shortlist_tag}" if vmap else "")
    out = os.path.join(os.path.dirname(checkpoint), name)
    if os.path.exists(os.path.join(out, "model.bin")):
        return out
    data_bin = getattr(args, "data_bin", None) or os.path.join(args.prep, "data-bin")
    try:
        user_size_checkpoints.convert_for_ctranslate2(checkpoint, data_bin, quantization, out, vocab_mapping=vmap)
    except user_size_checkpoints.UserSizeError as exc:
        sys.exit(f"benchmark_generate: {exc}")
    log(f"converted {checkpoint} for CTranslate2 ({quantization}{', vocabulary map ' + vmap if vmap else ''}): {out}")
    return out


def prepare_shortlist(args) -> None:
    """The shortlist the shortlist and vmap models decode with: --shortlist, else the data-bin's
    (rfa-build-shortlist's defaults, built from its train split, which a user size's data-bin gets first where it has
    none); its --shortlist-k / --shortlist-n as model options (args.shortlist_options), the row's tag (kK_nN) and, for
    the vmap models, the same table as CTranslate2's vocabulary map beside the file (args.ct2_vmap)."""
    from fairseq.data import Dictionary

    from rfa_fairseq import shortlist as shortlists

    args.shortlist_options, args.shortlist_tag, args.ct2_vmap = None, "", None
    if not any(m in SHORTLIST_MODELS or m in VMAP_MODELS for m in args.models):
        return
    path = args.shortlist
    if path is None:
        try:
            path = user_size_checkpoints.shortlist_of(args.prep, args.data_bin)
        except user_size_checkpoints.UserSizeError as exc:
            sys.exit(f"benchmark_generate: {exc}")
    table = shortlists.read(path)
    k = table.header["k"] if args.shortlist_k is None else args.shortlist_k
    n = table.header["n"] if args.shortlist_n is None else args.shortlist_n
    args.shortlist_options = {"rfa_shortlist": os.path.abspath(path), "rfa_shortlist_k": k, "rfa_shortlist_n": n}
    args.shortlist_tag = f"k{k}_n{n}"
    if any(m in VMAP_MODELS for m in args.models):
        src, tgt = user_size_checkpoints.SRC, user_size_checkpoints.TGT
        dictionaries = [Dictionary.load(os.path.join(args.data_bin, f"dict.{lang}.txt")) for lang in (src, tgt)]
        args.ct2_vmap = os.path.splitext(path)[0] + f".{args.shortlist_tag}.ct2_vmap.txt"
        if not os.path.exists(args.ct2_vmap):
            shortlists.check_dictionaries(table, *dictionaries, path)
            shortlists.write_ct2_vmap(args.ct2_vmap, table, *dictionaries, k=k, n=n)
    log(f"shortlist {path} (K={k}, N={n})" + (f"; CTranslate2 vocabulary map {args.ct2_vmap}" if args.ct2_vmap else ""))


def updates_of(path) -> int:
    """Training updates behind a checkpoint (its CSV column: a study run that was cut short shows)."""
    from rfa_fairseq.checkpoints import safe_load

    history = safe_load(path, mmap=True).get("optimizer_history") or [{}]
    return int(history[-1].get("num_updates", -1))


def ct2_configs(threads: int):
    """CTranslate2's ways to use `threads` cores: (intra_threads, inter_threads)."""
    return [(threads, 1)] + ([(1, threads)] if threads > 1 else [])


def generate(args, model, batch_size, threads, hyp_path, ct2_config=(1, 1), cpu_isa="", forced_length=0):
    """One fairseq-generate (or CTranslate2, at ct2_config = (intra_threads, inter_threads)) run over args.subset (the
    first args.sentences test sentences, or all), every library capped at cpu_isa ("" / native: not capped), every
    hypothesis forced_length tokens (0: natural lengths); returns (sentences, tokens, seconds, peak MB, hypotheses by
    id, GEMM backend)."""
    checkpoint = args.checkpoints[model]
    cpu_isa = "" if cpu_isa == NATIVE_ISA else cpu_isa
    if model in CT2_MODELS:
        intra, inter = ct2_config
        cmd = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "ctranslate2_generate.py"),
               "--model", args.ct2_models[model], "--source", args.source,
               "--output", hyp_path + ".txt", "--threads", str(intra), "--inter-threads", str(inter),
               "--batch-size", str(batch_size), "--beam", "4", "--lenpen", "1", "--max-len-b", "50",
               "--forced-length", str(forced_length), "--sentences", str(args.sentences)]
        if model in VMAP_MODELS:
            cmd.append("--use-vmap")
    else:
        # fairseq-generate as a module: the console script need not sit beside this interpreter
        cmd = [sys.executable, "-m", "fairseq_cli.generate", args.data_bin,
               "--user-dir", PLUGIN_DIR, "--path", checkpoint, "--gen-subset", args.subset, "--beam", "4", "--lenpen", "1",
               *length_flags(forced_length), "--batch-size", str(batch_size),
               "--required-batch-size-multiple", "1", "--post-process", "sentencepiece", "--num-workers", "0",
               *generate_flags(model, args.no_triton_self_check, cpu_isa, args.shortlist_options)]
        if args.device == "cpu":
            cmd.append("--cpu")
        if args.fp16:
            cmd.append("--fp16")
    # CT2_VERBOSE: CTranslate2 logs the GEMM backend it picked for this CPU (the CSV's gemm_backend)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), CT2_VERBOSE="1")
    if cpu_isa:  # every library of the process capped at the level, CTranslate2 too
        env = cpu_isa_environment(cpu_isa, env)
    with open(hyp_path + ".log", "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        except BaseException:
            proc.kill()
            raise
    proc.returncode = os.waitstatus_to_exitcode(status)
    text = open(hyp_path + ".log").read()
    if proc.returncode != 0:
        sys.exit(f"benchmark_generate: {' '.join(map(shlex.quote, cmd))} failed ({proc.returncode}):\n{text[-2000:]}")
    found = TRANSLATED.search(text)
    if not found:
        sys.exit(f"benchmark_generate: no 'Translated ...' line in {hyp_path}.log")
    if model in CT2_MODELS:
        with open(hyp_path + ".txt", encoding="utf-8") as f:
            hyps = dict(enumerate(f.read().splitlines()))
    else:
        hyps = detokenized_hypotheses(text)
    sentences, tokens = (int(g.replace(",", "")) for g in found.groups()[:2])
    return sentences, tokens, sentences / float(found.group(4)), usage.ru_maxrss / 1024, hyps, gemm_backend(model, text, args.device)


def gemm_backend(model, log_text, device="cpu") -> str:
    """The GEMM library behind the run's linear layers: cuBLAS on CUDA; on the CPU, CTranslate2 says which in its
    verbose log, and so does an rfa_transformer's decoder (oneDNN with the C++ kernels); torch's own CPU linear
    layers call the BLAS it was built with (MKL in the pinned wheel)."""
    if device.startswith("cuda"):
        return "torch cuBLAS"
    if model in CT2_MODELS:
        kind = "GEMM_S8" if CT2_MODELS[model][1].startswith("int8") else "SGEMM"
        found = re.search(rf"{kind} backend: (.+)", log_text)
        return f"ctranslate2 {found.group(1).strip()}" if found else "ctranslate2 (backend not logged)"
    import torch

    blas = re.search(r"BLAS_INFO=(\w+)", torch.__config__.show())
    blas = f"torch {blas.group(1) if blas else 'default BLAS'}"
    # an rfa_transformer's decoder logs what its decoding step's linear layers run on (the encoder's follow it)
    found = re.search(r"decoding step: [^;]+; linear layers: (.+)", log_text)
    return blas if found is None or found.group(1).strip() == "torch addmm" else found.group(1).strip()


def bleu(hyps, refs) -> float:
    import sacrebleu

    return sacrebleu.corpus_bleu([hyps[i] for i in range(len(refs))], [refs]).score


def plot(rows, png_path):
    """Sentences/s by (threads, batch size) and model: one panel per (instruction-set level, forced length) in rows."""
    plt = pyplot()
    if plt is None:
        return
    panels = sorted({(r.get("cpu_isa") or NATIVE_ISA, int(r.get("forced_length") or 0)) for r in rows})
    points = sorted({(int(r["threads"]), int(r["batch_size"])) for r in rows})
    models = [m for m in [*MODELS, *CT2_MODELS] if any(r["model"] == m for r in rows)]
    fig, axes = plt.subplots(len(panels), 1, figsize=(max(6, 2.2 * len(points)), 4.5 * len(panels)), squeeze=False)
    width = 0.8 / max(1, len(models))
    for ax, (isa, forced) in zip(axes[:, 0], panels):
        panel = [r for r in rows
                 if (r.get("cpu_isa") or NATIVE_ISA) == isa and int(r.get("forced_length") or 0) == forced]
        for j, model in enumerate(models):
            values = []
            for threads, batch in points:
                row = next((r for r in panel if r["model"] == model and int(r["threads"]) == threads
                            and int(r["batch_size"]) == batch), None)
                values.append(float(row["sentences_per_s"]) if row else 0.0)
            bars = ax.bar([i + j * width for i in range(len(points))], values, width, label=model)
            ax.bar_label(bars, labels=[f"{v:.1f}" if v < 10 else f"{v:.0f}" for v in values], fontsize=7)
        ax.set_xticks([i + width * (len(models) - 1) / 2 for i in range(len(points))])
        ax.set_xticklabels([f"batch {b}\n{t} thread{'s' if t > 1 else ''}" for t, b in points])
        ax.set_ylabel("sentences / s (beam 4)")
        size = (panel[0].get("size") or "recipe") if panel else "recipe"
        what = "Multi30k recipe model" if size == "recipe" else f"{size} size, 32k vocabulary"
        lengths = f"forced to {forced} tokens" if forced else "natural lengths"
        sentences = panel[0]["sentences"] if panel else "?"
        ax.set_title(f"{what}, {sentences} test_2016_flickr sentences, {lengths}, {isa}\n{rows[0]['machine']}",
                     fontsize=9)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png_path, dpi=90)
    log(f"wrote {png_path}")


def shortlist_of_model(args, model) -> str:
    """The CSV's shortlist column: the shortlist and vmap models' K and N (kK_nN), empty for the others."""
    return args.shortlist_tag if model in SHORTLIST_MODELS or model in VMAP_MODELS else ""


def row_key(row) -> tuple:
    """A CSV row's identity (KEY), as strings; a column an older CSV lacks reads its KEY_DEFAULTS value."""
    return tuple(str(row.get(k) if row.get(k) not in (None, "") else KEY_DEFAULTS.get(k, "")) for k in KEY)


def models_to_measure(rows, key_of_model, models, redo=False) -> list:
    """The models of one point that have no row yet (all of them with redo); key_of_model(model) is the row_key the
    point's row for that model would have."""
    done = {row_key(r) for r in rows}
    return [m for m in models if redo or key_of_model(m) not in done]


def csv_name(tag: str, size: str, cpu_isas, forced_lengths) -> str:
    """The default CSV's file name. The recipe model's: generate_multi30k_<device> with _<isa> and _forced<L> where
    one level (not native) and one forced length are measured; a user size's: generate_user_<size>_<device>, every
    level and length in one file (its columns say which)."""
    if size != "recipe":
        return f"generate_user_{size}_{tag}.csv"
    suffix = f"_{cpu_isas[0]}" if len(cpu_isas) == 1 and cpu_isas[0] != NATIVE_ISA else ""
    suffix += f"_forced{forced_lengths[0]}" if len(forced_lengths) == 1 and forced_lengths[0] else ""
    return f"generate_multi30k_{tag}{suffix}.csv"


def machine(device) -> str:
    if device.startswith("cuda"):
        from benchmark_common import gpu_name

        return gpu_name()
    try:
        with open("/proc/cpuinfo") as f:
            name = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        name = "cpu"
    return f"{name}, {os.cpu_count()} cores"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prep", default=os.path.join(REPO, "outputs", "multi30k"),
                   help="output of data-prep/prepare-multi30k.sh (data-bin/, test.raw.de)")
    p.add_argument("--size", default="recipe", choices=SIZES,
                   help="recipe (default): the quality study's Multi30k checkpoints; base / big: transformer base / "
                        "big with a 32k joint vocabulary (benchmarks/user_size_checkpoints.py, made when missing under "
                        "--user-size-dir; --forced-length required)")
    p.add_argument("--user-size-dir", default=user_size_checkpoints.DEFAULT_OUT_DIR,
                   help="--size base / big: user_size_checkpoints.py's --out-dir (default outputs/user_size)")
    p.add_argument("--sentences", type=int, default=0,
                   help="decode the first N test_2016_flickr sentences only (0, the default: all 1,000)")
    p.add_argument("--models", nargs="+", default=None, choices=[*MODELS, *CT2_MODELS],
                   help=f"default: {' '.join(DEFAULT_MODELS)}; --size base / big: {' '.join(DEFAULT_USER_SIZE_MODELS)}")
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[32, 128])
    p.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    p.add_argument("--repeats", type=int, default=2, help="runs per point, models alternating; the fastest counts")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--fp16", action="store_true", help="fairseq-generate --fp16 (CUDA)")
    p.add_argument("--study-dir", default=os.path.join(REPO, "outputs", "quality"), help="the quality study's --work-dir")
    p.add_argument("--study-csv", default=os.path.join(REPO, "benchmarks", "results", "quality_multi30k_cpu.csv"),
                   help="where a missing checkpoint's training row goes")
    p.add_argument("--max-update", type=int, default=1000)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--variant", action="append", default=[], metavar="MODEL=VARIANT",
                   help="decode another quality-study variant for a model, e.g. rfa=hedgehog_gate_softmax_cross_d16")
    p.add_argument("--train-timeout", type=float, default=6 * 3600, help="seconds a missing checkpoint may train")
    p.add_argument("--csv", default=None)
    p.add_argument("--redo", action="store_true", help="measure finished rows again")
    p.add_argument("--cpu-isa", nargs="+", default=[NATIVE_ISA], choices=["", NATIVE_ISA, *ISA_CAPS],
                   help="CPU: run every process capped at this instruction-set level (a CPU of that level on one that "
                        "has more): the RFA models with --rfa-cpu-isa, oneDNN, torch, MKL and CTranslate2 through "
                        "their own caps (benchmark_common.ISA_CAPS); native (the default): the CPU's own level. "
                        "Several: each point at each; the CSV's cpu_isa column (and, for the recipe model and one "
                        "level, its name) say which")
    p.add_argument("--forced-length", nargs="+", type=int, default=None,
                   help="every hypothesis exactly this many tokens (fairseq --min-len L --max-len-a 0 --max-len-b L, "
                        "CTranslate2 min/max decoding length): both engines do the same work whatever the checkpoints' "
                        "quality; 0: natural lengths (the default of --size recipe). Several: each point at each")
    p.add_argument("--shortlist", default=None,
                   help="the shortlist file of the shortlist models (rfa_shortlist, rfa_int8_shortlist) and, as "
                        "CTranslate2's vocabulary map, of the vmap models (ct2_softmax_vmap, ct2_softmax_int8_vmap); "
                        "default: the data-bin's shortlist.en-de.npz, built by rfa-build-shortlist with its defaults "
                        "(a user size's data-bin gets its train split binarized first)")
    p.add_argument("--shortlist-k", type=int, default=None, help="its first K candidates (default: the file's K)")
    p.add_argument("--shortlist-n", type=int, default=None, help="its N frequent tokens (default: the file's N)")
    p.add_argument("--no-triton-self-check", action="store_true",
                   help="CUDA: the RFA models decode with --no-rfa-triton-self-check (fairseq-generate's timer would "
                        "count the check; for a GPU checked before: benchmarks/gpu/self_check.py)")
    args = p.parse_args(argv)
    args.cpu_isa = list(dict.fromkeys(isa or NATIVE_ISA for isa in args.cpu_isa))  # "" (the old default): native
    user_size = args.size != "recipe"
    if args.forced_length is None:
        if user_size:
            p.error(f"--size {args.size}: --forced-length L is required (its checkpoints are trained a few updates "
                    f"only: at natural lengths their hypotheses' lengths, hence the work, would be arbitrary)")
        args.forced_length = [0]
    if any(length < 0 for length in args.forced_length):
        p.error(f"--forced-length must be 0 (natural lengths) or positive, got {args.forced_length}")
    if user_size and 0 in args.forced_length:
        p.error(f"--size {args.size}: --forced-length 0 (natural lengths) has no meaning for checkpoints trained a few "
                f"updates; give lengths above 0")
    if args.sentences < 0:
        p.error(f"--sentences must be 0 (all) or positive, got {args.sentences}")
    if min(args.batch_sizes) < 1 or min(args.threads) < 1 or args.repeats < 1:
        p.error("--batch-sizes, --threads and --repeats must be positive")
    if args.device != "cpu" and args.cpu_isa != [NATIVE_ISA]:
        p.error("--cpu-isa caps CPU processes only (--device cpu)")
    if user_size and args.models is not None:
        outside = [m for m in args.models if m not in USER_SIZE_MODELS]
        if outside:
            p.error(f"--size {args.size} decodes its two checkpoints only: {', '.join(outside)} "
                    f"{'is a quality-study variant' if len(outside) == 1 else 'are quality-study variants'}; "
                    f"choose among {', '.join(USER_SIZE_MODELS)}")
    if user_size and args.variant:
        p.error(f"--variant picks quality-study checkpoints: not with --size {args.size}")
    if args.models is None:
        args.models = list(DEFAULT_USER_SIZE_MODELS if user_size else DEFAULT_MODELS)
        if importlib.util.find_spec("ctranslate2") is None:
            args.models = [m for m in args.models if m not in CT2_MODELS]
            log("ctranslate2 is not installed (pip install ctranslate2, or the project's bench extra): "
                "its rows are left out")
    elif any(m in CT2_MODELS for m in args.models) and importlib.util.find_spec("ctranslate2") is None:
        p.error("--models names a CTranslate2 model, but ctranslate2 is not installed (pip install ctranslate2)")
    if args.fp16 and args.device != "cuda":
        p.error("--fp16: fairseq-generate decodes in fp16 on CUDA only (--device cuda)")
    if args.device != "cpu" and any(m in CT2_MODELS for m in args.models):
        p.error("the CTranslate2 rows are measured on the CPU only (leave them out of --models with --device cuda)")
    args.variant_override = {}
    for item in args.variant:
        model, _, variant = item.partition("=")
        if model not in MODELS or model in CT2_MODELS or not variant:
            p.error(f"--variant {item!r}: expected MODEL=VARIANT with MODEL one of {', '.join(MODELS)}")
        args.variant_override[model] = variant
        if model == "rfa":
            for same in SAME_CHECKPOINT_AS_RFA:
                args.variant_override.setdefault(same, variant)
    for needed in ("data-bin/dict.en.txt", "test.raw.de"):
        if not os.path.exists(os.path.join(args.prep, needed)):
            p.error(f"--prep {args.prep} has no {needed}: run data-prep/prepare-multi30k.sh first")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            p.error("--device cuda: no CUDA device")
    tag = device_tag(args.device)
    args.csv = args.csv or os.path.join(REPO, "benchmarks", "results",
                                        csv_name(tag, args.size, args.cpu_isa, args.forced_length))
    args.source = os.path.join(args.prep, "test.spm.en")
    if user_size:
        try:
            files = user_size_checkpoints.size_files(args.size, args.prep, args.user_size_dir)
        except (user_size_checkpoints.UserSizeError, ValueError) as exc:
            sys.exit(f"benchmark_generate: {exc}")
        args.data_bin = files.data_bin
        args.checkpoints = {m: files.checkpoints["softmax" if variant_of(m) == "softmax" else "rfa"]
                            for m in args.models}
        args.ct2_models = {m: files.ct2_models[CT2_MODELS[m][1]] for m in args.models
                           if m in CT2_MODELS and m not in VMAP_MODELS}
        args.size_variant = {m: f"{args.size} 32k: {os.path.relpath(args.checkpoints[m], args.user_size_dir)}"
                             for m in args.models}
    else:
        args.data_bin = os.path.join(args.prep, "data-bin")
        args.checkpoints = {model: checkpoint_of(args, model) for model in args.models}
        # the vmap models' conversions once the shortlist is known (prepare_shortlist, below)
        args.ct2_models = {model: ct2_model_of(args, model) for model in args.models
                           if model in CT2_MODELS and model not in VMAP_MODELS}
        args.size_variant = {}
    prepare_shortlist(args)
    args.ct2_models.update({model: ct2_model_of(args, model) for model in args.models if model in VMAP_MODELS})
    args.updates = {model: updates_of(path) for model, path in args.checkpoints.items()}
    args.subset = user_size_checkpoints.test_subset(args.data_bin, args.sentences)
    for model, updates in args.updates.items():
        if user_size or updates >= args.max_update:
            continue
        last = os.path.join(os.path.dirname(args.checkpoints[model]), "checkpoint_last.pt")
        if os.path.exists(last) and updates_of(last) >= args.max_update:  # the best valid loss came at an earlier epoch
            log(f"{args.checkpoints[model]} is from update {updates} of {args.max_update} (the epoch with the lowest "
                f"valid loss, which the quality study decodes too); the rows say so in checkpoint_updates")
        else:
            log(f"warning: {args.checkpoints[model]} has {updates} of {args.max_update} updates (its training stopped "
                f"early; scripts/quality_study.py resumes it); the rows say so in checkpoint_updates")
    refs = open(os.path.join(args.prep, "test.raw.de")).read().splitlines()
    if args.sentences:
        refs = refs[:args.sentences]

    rows = []
    if os.path.exists(args.csv):
        with open(args.csv, newline="") as f:
            rows = list(csv.DictReader(f))
    description = machine(args.device)
    with tempfile.TemporaryDirectory() as tmp:
        for cpu_isa, forced_length, threads, batch in itertools.product(args.cpu_isa, args.forced_length, args.threads,
                                                                         args.batch_sizes):
            def key_of(model, threads=threads, batch=batch, cpu_isa=cpu_isa, forced_length=forced_length):
                return row_key({"device": tag, "size": args.size, "cpu_isa": cpu_isa, "forced_length": forced_length,
                                "sentences": len(refs), "threads": threads, "batch_size": batch, "model": model,
                                "shortlist": shortlist_of_model(args, model)})

            point = models_to_measure(rows, key_of, args.models, args.redo)
            if not point:
                continue
            where = f"{cpu_isa}, {f'{forced_length} tokens' if forced_length else 'natural lengths'}"
            best, ct2_config = {}, {}
            for repeat in range(args.repeats):
                for model in point:  # alternating: drifting machine load hits every model alike
                    for config in ct2_configs(threads) if model in CT2_MODELS else [None]:
                        result = generate(args, model, batch, threads, os.path.join(tmp, f"{model}.{batch}.{threads}"),
                                          ct2_config=config, cpu_isa=cpu_isa, forced_length=forced_length)
                        if model not in best or result[2] < best[model][2]:
                            best[model], ct2_config[model] = result, config
                        log(f"{where}: threads {threads} batch {batch} {model}"
                            f"{f' intra {config[0]} inter {config[1]}' if config else ''} repeat {repeat + 1}: "
                            f"{result[2]:.1f} s")
            for model in point:
                sentences, tokens, seconds, peak, hyps, backend = best[model]
                row = {
                    "device": tag, "size": args.size, "threads": threads, "batch_size": batch, "model": model,
                    "dtype": "fp16" if args.fp16 else "fp32",
                    "engine": "ctranslate2 " + CT2_MODELS[model][1] if model in CT2_MODELS else "fairseq",
                    "variant": args.size_variant.get(model) or args.variant_override.get(model, variant_of(model)),
                    "checkpoint_updates": args.updates[model],
                    "sentences": sentences, "tokens": tokens, "seconds": f"{seconds:.2f}",
                    "sentences_per_s": f"{sentences / seconds:.2f}", "tokens_per_s": f"{tokens / seconds:.1f}",
                    "peak_rss_mb": f"{peak:.0f}", "bleu": f"{bleu(hyps, refs):.2f}", "repeats": args.repeats,
                    "machine": description, "cpu_isa": cpu_isa,
                    "forced_length": forced_length, "shortlist": shortlist_of_model(args, model),
                    "gemm_backend": backend, "measured_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ"),
                }
                if "softmax" in best:
                    row["speed_vs_softmax"] = f"{best['softmax'][2] / seconds:.3f}"
                if "ct2_softmax" in best:
                    row["speed_vs_ct2"] = f"{best['ct2_softmax'][2] / seconds:.3f}"
                if "ct2_softmax_int8" in best:
                    row["speed_vs_ct2_int8"] = f"{best['ct2_softmax_int8'][2] / seconds:.3f}"
                if "ct2_softmax_vmap" in best:
                    row["speed_vs_ct2_vmap"] = f"{best['ct2_softmax_vmap'][2] / seconds:.3f}"
                if "ct2_softmax_int8_vmap" in best:
                    row["speed_vs_ct2_int8_vmap"] = f"{best['ct2_softmax_int8_vmap'][2] / seconds:.3f}"
                if model in CT2_MODELS:
                    row["ct2_config"] = "intra_threads={} inter_threads={}".format(*ct2_config[model])
                if model in CT2_MODELS and "softmax" in best:
                    fairseq_hyps = best["softmax"][4]
                    same = sum(fairseq_hyps.get(i) == hyps.get(i) for i in range(len(refs)))
                    row["identical_to_softmax"] = f"{same / len(refs):.4f}"
                if model in SAME_CHECKPOINT_AS_RFA and "rfa" in best:
                    cpp = best["rfa"][4]
                    same = sum(cpp.get(i) == hyps.get(i) for i in range(len(refs)))
                    row["identical_to_rfa"] = f"{same / len(refs):.4f}"
                    row["bleu_rfa_minus_this"] = f"{bleu(cpp, refs) - bleu(hyps, refs):.2f}"
                rows = [r for r in rows if row_key(r) != key_of(model)]
                rows.append(row)
            write_csv(args.csv, rows)
            log(f"wrote {args.csv}")
    rows = [r for r in rows if r["device"] == tag]
    if rows:
        plot(rows, os.path.splitext(args.csv)[0] + ".png")
        for r in rows:
            print(f"{r.get('cpu_isa') or NATIVE_ISA:>11} L={r.get('forced_length') or 0:<3} "
                  f"{r['threads']} thr  batch {r['batch_size']:>4}  {r['model']:16s} {float(r['sentences_per_s']):7.1f} sent/s  "
                  f"x{r.get('speed_vs_softmax') or '-':>6} vs softmax  x{r.get('speed_vs_ct2') or '-':>6} vs ct2  "
                  f"x{r.get('speed_vs_ct2_int8') or '-':>6} vs ct2 int8  "
                  f"BLEU {r['bleu']}  peak {r['peak_rss_mb']} MB"
                  + (f"  identical {r['identical_to_rfa']}" if r.get("identical_to_rfa") else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
