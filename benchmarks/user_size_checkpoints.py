#!/usr/bin/env python3
"""Checkpoints at the sizes users decode: transformer base and big with a 32k joint vocabulary, RFA and softmax.

For each --sizes (base, big) this makes, under --out-dir (default outputs/user_size), skipping whatever exists:

  data-bin/                    Multi30k (data-prep/prepare-multi30k.sh's SentencePiece pieces) binarized with a
                               joint dictionary of --vocab-size entries (default 32,000; the model adds fairseq's 4
                               specials): the recipe's real pieces first, then filler symbols `madeupwordNNNNN`
  <size>/rfa/checkpoint.pt     rfa_transformer_wmt_en_de[_big]: the plugin's default RFA options, as the wmt14
                               recipes train them (scripts/train.sh RECIPE=wmt14_en_de[_big] MODEL=rfa)
  <size>/softmax/checkpoint.pt transformer_wmt_en_de[_big], its softmax twin (MODEL=softmax)
  <size>/softmax/ctranslate2_float32/, ctranslate2_int8/   the softmax checkpoint converted by CTranslate2's
                               ct2-fairseq-converter (--quantization float32 / int8)

Each checkpoint is trained --updates updates (default 2) by scripts/train.sh with the recipe's flags on the CPU in
fp32 (FP16=0), --max-tokens --max-tokens (default 1024: cheap; the batch of a few updates does not change what a
decoding step computes), no validation, no optimizer state saved (a release checkpoint's contents).

Why a 32k dictionary of real pieces and fillers, and a few updates, measure what a user's model costs: with every
hypothesis forced to L tokens (fairseq-generate --min-len L --max-len-a 0 --max-len-b L; CTranslate2
min_decoding_length = max_decoding_length = L; benchmark_generate.py --forced-length) every sentence runs the same
L + 1 decoder steps whatever the weights say, each step computes the same products over the same rows (the layers,
the output projection over all 32,004 rows of the vocabulary, the beam's top-k over them), and which tokens win
the beam costs the same. The sources are the real test_2016_flickr sentences, tokenized by the recipe's
SentencePiece model into pieces that are all in the dictionary, so the encoder's work is a real one's. What a
trained WMT model would add is only natural lengths (a batch's finished sentences dropping out early), which the
forced lengths replace by the worst case of a batch whose sentences all run L steps.

    python benchmarks/user_size_checkpoints.py --prep outputs/multi30k                 # base and big
    python benchmarks/user_size_checkpoints.py --prep outputs/multi30k --sizes base    # base only

From Python (benchmark_generate.py --size, memory_generate.py): `size_files(size, prep)` returns a SizeFiles of a
size's checkpoints, data-bin and CTranslate2 directories (made when missing; make=False only names them).
"""
import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLUGIN_DIR = os.path.join(REPO, "rfa_fairseq")
DEFAULT_OUT_DIR = os.path.join(REPO, "outputs", "user_size")
DEFAULT_PREP = os.path.join(REPO, "outputs", "multi30k")
SRC, TGT = "en", "de"
DEFAULT_VOCAB_SIZE = 32000
FILLER = "madeupword{:05d}"  # fairseq pads its dictionaries with madeupwordNNNN the same way
FAIRSEQ_SPECIALS = 4  # <s> <pad> </s> <unk>: fairseq's Dictionary adds them before the file's entries

# size -> (the recipe scripts/train.sh trains, {model: architecture}); the big architectures are
# transformer_wmt_en_de_big's, which differ from the wmt14_en_de_big recipe's *_vaswani_* ones only in dropout
# (training only): the same layers, widths and heads decode
SIZES = {
    "base": ("wmt14_en_de", {"rfa": "rfa_transformer_wmt_en_de", "softmax": "transformer_wmt_en_de"}),
    "big": ("wmt14_en_de_big", {"rfa": "rfa_transformer_wmt_en_de_big", "softmax": "transformer_wmt_en_de_big"}),
}
CT2_QUANTIZATIONS = ("float32", "int8")
TRAIN_TIMEOUT_S = 4 * 3600
CONVERT_TIMEOUT_S = 1800


class UserSizeError(RuntimeError):
    """A step of making the checkpoints failed; the message names the step, its command and its log."""


@dataclasses.dataclass
class SizeFiles:
    """What decodes one size: the binarized data (dictionary and test split), each model's checkpoint, the softmax
    checkpoint's CTranslate2 conversions by quantization, the SentencePiece-encoded test sources and references."""

    size: str
    data_bin: str
    checkpoints: dict  # "rfa" | "softmax" -> checkpoint.pt
    ct2_models: dict  # "float32" | "int8" -> CTranslate2 model directory
    source: str  # test.spm.en (the prep's)
    references: str  # test.raw.de (the prep's)
    vocab_size: int  # dictionary entries without fairseq's specials


def log(message):
    print(f"[{time.strftime('%H:%M:%S')}] user_size_checkpoints: {message}", flush=True)


def padded_dictionary(lines, vocab_size: int, filler: str = FILLER) -> list:
    """A fairseq dictionary file's lines ("symbol count"): `lines` (the recipe's real entries) first, then filler
    symbols with count 0 up to `vocab_size` entries. A ValueError when the real entries are more than vocab_size,
    repeat a symbol, are not "symbol count" lines, or a filler name is already a real symbol."""
    real = []
    for number, line in enumerate(lines, 1):
        parts = line.rstrip("\n").split(" ")
        if len(parts) < 2 or not parts[0] or not parts[1].lstrip("-").isdigit():
            raise ValueError(f"dictionary line {number} is not 'symbol count': {line.rstrip()!r}")
        real.append(line.rstrip("\n"))
    symbols = [line.split(" ")[0] for line in real]
    if len(set(symbols)) != len(symbols):
        repeated = next(s for s in symbols if symbols.count(s) > 1)
        raise ValueError(f"the dictionary repeats the symbol {repeated!r}")
    if len(real) > vocab_size:
        raise ValueError(f"the dictionary has {len(real)} entries, more than the {vocab_size} asked for")
    fillers = [filler.format(i) for i in range(vocab_size - len(real))]
    clash = set(fillers) & set(symbols)
    if clash:
        raise ValueError(f"filler symbol {sorted(clash)[0]!r} is already in the dictionary")
    return real + [f"{name} 0" for name in fillers]


def size_files(size: str, prep: str = DEFAULT_PREP, out_dir: str = DEFAULT_OUT_DIR, make: bool = True,
               vocab_size: int = DEFAULT_VOCAB_SIZE, updates: int = 2, max_tokens: int = 1024) -> SizeFiles:
    """The files that decode `size` (base or big), made first where missing when `make`."""
    if size not in SIZES:
        raise ValueError(f"no size named {size!r} (one of {', '.join(SIZES)})")
    files = SizeFiles(
        size=size, data_bin=os.path.join(out_dir, "data-bin"),
        checkpoints={model: os.path.join(out_dir, size, model, "checkpoint.pt") for model in SIZES[size][1]},
        ct2_models={q: os.path.join(out_dir, size, "softmax", f"ctranslate2_{q}") for q in CT2_QUANTIZATIONS},
        source=os.path.join(prep, f"test.spm.{SRC}"), references=os.path.join(prep, f"test.raw.{TGT}"),
        vocab_size=vocab_size)
    if not make:
        return files
    check_prep(prep)
    check_manifest(out_dir, vocab_size=vocab_size, updates=updates, max_tokens=max_tokens)
    make_data_bin(prep, files.data_bin, vocab_size)
    for model, checkpoint in files.checkpoints.items():
        train_checkpoint(size, model, files.data_bin, checkpoint, updates, max_tokens)
    for quantization, directory in files.ct2_models.items():
        convert_for_ctranslate2(files.checkpoints["softmax"], files.data_bin, quantization, directory)
    return files


def check_prep(prep: str) -> None:
    needed = [f"{split}.spm.{lang}" for split in ("train", "valid", "test") for lang in (SRC, TGT)]
    needed += [f"test.raw.{TGT}", f"data-bin/dict.{SRC}.txt"]
    missing = [name for name in needed if not os.path.exists(os.path.join(prep, name))]
    if missing:
        raise UserSizeError(f"--prep {prep} has no {', '.join(missing)}: prepare it first with "
                            f"data-prep/prepare-multi30k.sh --local-dir /path/to/multi30k {prep}")


def check_manifest(out_dir: str, **settings) -> None:
    """out_dir/manifest.json records the settings its files were made with; other settings are an error (the
    files would not be what they say), not a silent mix."""
    path = os.path.join(out_dir, "manifest.json")
    if os.path.exists(path):
        with open(path) as f:
            recorded = json.load(f)
        differ = {k: (recorded.get(k), v) for k, v in settings.items() if recorded.get(k) != v}
        if differ:
            shown = ", ".join(f"{k}: made with {old}, asked for {new}" for k, (old, new) in differ.items())
            raise UserSizeError(f"{out_dir} was made with other settings ({shown}): pass another --out-dir, or "
                                f"delete {out_dir} to make it again")
        return
    os.makedirs(out_dir, exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(settings, f, indent=1)
    os.replace(path + ".tmp", path)


def run_logged(cmd, log_path: str, step: str, timeout_s: float, env=None) -> None:
    """Run cmd with its output in log_path; a UserSizeError naming the step, command and log when it fails."""
    with open(log_path, "w") as out:
        try:
            proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise UserSizeError(f"{step}: still running after {timeout_s:g} s (stopped): {' '.join(cmd)}; "
                                f"log: {log_path}") from None
    if proc.returncode != 0:
        with open(log_path, errors="replace") as f:
            tail = f.read()[-2000:]
        raise UserSizeError(f"{step} failed (exit {proc.returncode}): {' '.join(cmd)}\nlog {log_path}:\n{tail}")


def tool(name: str) -> str:
    """A console script of this interpreter's environment (fairseq-preprocess, ct2-fairseq-converter)."""
    path = os.path.join(os.path.dirname(sys.executable), name)
    if not os.path.exists(path):
        found = shutil.which(name)
        if found is None:
            raise UserSizeError(f"{name} not found beside {sys.executable} nor on PATH (pip install -e .[bench])")
        path = found
    return path


def make_data_bin(prep: str, data_bin: str, vocab_size: int) -> None:
    """The prep's train / valid / test pieces binarized with the padded joint dictionary (fairseq-preprocess
    --srcdict --joined-dictionary), into data_bin; skipped when data_bin exists."""
    if os.path.exists(os.path.join(data_bin, f"dict.{TGT}.txt")):
        return
    with open(os.path.join(prep, "data-bin", f"dict.{SRC}.txt"), encoding="utf-8") as f:
        lines = padded_dictionary(f.read().splitlines(), vocab_size)
    tmp = data_bin + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    dict_path = os.path.join(tmp, "joint_dict.txt")
    with open(dict_path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    cmd = [tool("fairseq-preprocess"), "--source-lang", SRC, "--target-lang", TGT,
           *(f"--{split}pref={os.path.join(prep, split + '.spm')}" for split in ("train", "valid", "test")),
           "--destdir", tmp, "--joined-dictionary", "--srcdict", dict_path, "--workers", "1"]
    log(f"binarizing {prep}'s pieces with a {vocab_size:,}-entry joint dictionary -> {data_bin}")
    run_logged(cmd, os.path.join(os.path.dirname(data_bin), "preprocess.log"), "fairseq-preprocess", 3600)
    os.remove(dict_path)
    shutil.rmtree(data_bin, ignore_errors=True)
    os.replace(tmp, data_bin)


def add_train_split(prep: str, data_bin: str) -> None:
    """The prep's train pieces binarized into data_bin with its own joint dictionary (fairseq-preprocess --srcdict
    DATA_BIN/dict.SRC.txt --joined-dictionary), as make_data_bin binarizes every split: a data_bin made before
    make_data_bin binarized the train split gets it (rfa-build-shortlist reads it). Skipped when it is there."""
    names = [f"train.{SRC}-{TGT}.{lang}.{ext}" for lang in (SRC, TGT) for ext in ("bin", "idx")]
    if all(os.path.exists(os.path.join(data_bin, name)) for name in names):
        return
    tmp = data_bin + ".train.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    cmd = [tool("fairseq-preprocess"), "--source-lang", SRC, "--target-lang", TGT,
           f"--trainpref={os.path.join(prep, 'train.spm')}", "--destdir", tmp, "--joined-dictionary",
           "--srcdict", os.path.join(data_bin, f"dict.{SRC}.txt"), "--workers", "1"]
    log(f"binarizing {prep}'s train pieces into {data_bin} (its {SRC}/{TGT} dictionary)")
    run_logged(cmd, os.path.join(os.path.dirname(data_bin), "preprocess_train.log"), "fairseq-preprocess (train)", 3600)
    for lang in (SRC, TGT):
        with open(os.path.join(tmp, f"dict.{lang}.txt"), "rb") as made, \
                open(os.path.join(data_bin, f"dict.{lang}.txt"), "rb") as kept:
            if made.read() != kept.read():
                raise UserSizeError(f"binarizing the train split into {data_bin} wrote another dict.{lang}.txt than "
                                    f"the data-bin's (see {tmp})")
    for name in names[::-1]:  # the .idx files last: a train split is whole once both are there
        os.replace(os.path.join(tmp, name), os.path.join(data_bin, name))
    shutil.rmtree(tmp, ignore_errors=True)


def shortlist_of(prep: str, data_bin: str) -> str:
    """The data_bin's vocabulary shortlist (rfa-build-shortlist's default K and N, DATA_BIN/shortlist.SRC-TGT.npz),
    built from its train split (added first where missing); rebuilt only when out of date."""
    add_train_split(prep, data_bin)
    path = os.path.join(data_bin, f"shortlist.{SRC}-{TGT}.npz")
    run_logged([tool("rfa-build-shortlist"), data_bin, "-s", SRC, "-t", TGT, "--quiet"],
               os.path.join(os.path.dirname(data_bin), "build_shortlist.log"), "rfa-build-shortlist", 3600,
               env=dict(os.environ, OMP_NUM_THREADS="1"))
    return path


def train_command(size: str, model: str, data_bin: str, save_dir: str, updates: int, max_tokens: int):
    """(environment, argv) of scripts/train.sh training `model` (rfa or softmax) of `size` for `updates` updates on
    the CPU in fp32: the recipe's flags, then the few-updates run's own (later flags win in fairseq's parser)."""
    recipe, architectures = SIZES[size]
    env = dict(os.environ, DATA=data_bin, RECIPE=recipe, MODEL=model, ARCH=architectures[model], FP16="0",
               MAX_UPDATE=str(updates), SAVE_DIR=save_dir, USER_DIR=PLUGIN_DIR, PYTHON=sys.executable,
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    argv = ["bash", os.path.join(REPO, "scripts", "train.sh"), "--cpu", "--max-tokens", str(max_tokens),
            "--disable-validation", "--no-epoch-checkpoints", "--no-save-optimizer-state", "--num-workers", "0",
            "--log-interval", "1"]
    return env, argv


def train_checkpoint(size: str, model: str, data_bin: str, checkpoint: str, updates: int, max_tokens: int) -> None:
    """checkpoint (<size>/<model>/checkpoint.pt) trained by scripts/train.sh; skipped when it exists. The training
    runs in <size>/<model>/train/ and its checkpoint_last.pt becomes checkpoint.pt once it has `updates` updates."""
    if os.path.exists(checkpoint):
        return
    save_dir = os.path.join(os.path.dirname(checkpoint), "train")
    os.makedirs(save_dir, exist_ok=True)
    last = os.path.join(save_dir, "checkpoint_last.pt")
    # fairseq saves only at the last update here: a checkpoint_last.pt left by a run stopped before the move below is
    # finished; anything else is trained again (without optimizer state, fairseq could not resume it)
    if os.path.exists(last) and updates_in(last) < updates:
        os.remove(last)
    if not os.path.exists(last):
        env, argv = train_command(size, model, data_bin, save_dir, updates, max_tokens)
        log(f"training {size} {model} ({SIZES[size][1][model]}) for {updates} updates on the CPU: {save_dir}")
        run_logged(argv, os.path.join(save_dir, "train_stdout.log"), f"training {size} {model}", TRAIN_TIMEOUT_S,
                   env=env)
    if not os.path.exists(last) or updates_in(last) < updates:
        raise UserSizeError(f"training {size} {model} wrote no {last} of {updates} updates (log: {save_dir}/train.log)")
    os.replace(last, checkpoint)
    log(f"wrote {checkpoint} ({os.path.getsize(checkpoint) / 2**20:,.0f} MiB)")


def updates_in(path: str) -> int:
    """The training updates behind a checkpoint (fairseq's optimizer history), -1 when it is unreadable."""
    sys.path.insert(0, REPO)
    from rfa_fairseq.checkpoints import safe_load

    try:
        history = safe_load(path, mmap=True).get("optimizer_history") or [{}]
    except Exception:  # a file cut short: train it again
        return -1
    return int(history[-1].get("num_updates", -1))


def convert_for_ctranslate2(checkpoint: str, data_bin: str, quantization: str, out: str,
                            vocab_mapping: str = None) -> str:
    """The softmax checkpoint converted by ct2-fairseq-converter (--quantization float32 or int8) into `out`, with
    the vocabulary map `vocab_mapping` (--vocab_mapping: translate with use_vmap=True) where given; skipped when
    out/model.bin exists. A conversion cut short is never taken for a finished one (out.tmp)."""
    if os.path.exists(os.path.join(out, "model.bin")):
        return out
    cmd = [tool("ct2-fairseq-converter"), "--model_path", checkpoint, "--data_dir", data_bin, "--source_lang", SRC,
           "--target_lang", TGT, "--user_dir", PLUGIN_DIR, "--quantization", quantization,
           "--output_dir", out + ".tmp", "--force"]
    if vocab_mapping is not None:
        cmd += ["--vocab_mapping", vocab_mapping]
    log(f"converting {checkpoint} for CTranslate2 ({quantization})")
    run_logged(cmd, out + ".log", f"ct2-fairseq-converter ({quantization})", CONVERT_TIMEOUT_S)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(out + ".tmp", out)
    return out


def test_subset(data_bin: str, sentences: int, split: str = "test") -> str:
    """The gen-subset name of `split`'s first `sentences` pairs in data_bin (written beside it once, as fairseq's
    indexed datasets: `<split>_first<N>`); `split` itself when sentences is 0 or covers the whole split."""
    if sentences < 0:
        raise ValueError(f"sentences must be 0 (all) or positive, got {sentences}")
    from fairseq.data import data_utils, indexed_dataset
    from fairseq.data.dictionary import Dictionary

    name = f"{split}_first{sentences}"
    prefix = os.path.join(data_bin, f"{{}}.{SRC}-{TGT}.{{}}")
    if sentences == 0 or all(os.path.exists(prefix.format(name, lang) + ".idx") for lang in (SRC, TGT)):
        return split if sentences == 0 else name
    for lang in (SRC, TGT):
        dictionary = Dictionary.load(os.path.join(data_bin, f"dict.{lang}.txt"))
        dataset = data_utils.load_indexed_dataset(prefix.format(split, lang), dictionary)
        if dataset is None:
            raise FileNotFoundError(f"{data_bin} has no {split} split for {lang} ({prefix.format(split, lang)}.idx)")
        if sentences >= len(dataset):
            return split
        out = prefix.format(name, lang)
        builder = indexed_dataset.make_builder(out + ".bin.tmp", impl="mmap", vocab_size=len(dictionary))
        for i in range(sentences):
            builder.add_item(dataset[i])
        builder.finalize(out + ".idx.tmp")
        os.replace(out + ".bin.tmp", out + ".bin")
        os.replace(out + ".idx.tmp", out + ".idx")  # the .idx last: its presence says the split is whole
    return name


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prep", default=DEFAULT_PREP, help="output of data-prep/prepare-multi30k.sh (its pieces and "
                   "8k dictionary); default outputs/multi30k")
    p.add_argument("--out-dir", default=DEFAULT_OUT_DIR, help="where the data and checkpoints go (outputs/user_size)")
    p.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    p.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE,
                   help="dictionary entries, fairseq's 4 specials not counted (default 32000)")
    p.add_argument("--updates", type=int, default=2, help="training updates of each checkpoint (default 2)")
    p.add_argument("--max-tokens", type=int, default=1024, help="tokens per training batch (default 1024)")
    args = p.parse_args(argv)
    if args.vocab_size < 1:
        p.error(f"--vocab-size must be positive, got {args.vocab_size}")
    if args.updates < 1:
        p.error(f"--updates must be at least 1, got {args.updates}")
    if args.max_tokens < 1:
        p.error(f"--max-tokens must be positive, got {args.max_tokens}")
    try:
        for size in args.sizes:
            files = size_files(size, args.prep, args.out_dir, vocab_size=args.vocab_size, updates=args.updates,
                               max_tokens=args.max_tokens)
            log(f"{size}: data {files.data_bin}; " + "; ".join(f"{m} {c}" for m, c in files.checkpoints.items())
                + "; CTranslate2 " + ", ".join(files.ct2_models.values()))
    except (UserSizeError, ValueError) as exc:
        print(f"user_size_checkpoints: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
