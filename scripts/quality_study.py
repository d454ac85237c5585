"""Multi30k quality study: named variants of rfa_transformer vs the softmax twin, one budget, EN-DE or EN-FR.

    python scripts/quality_study.py --prep outputs/multi30k --variants softmax rfa hedgehog_gate
    python scripts/quality_study.py --pair en-fr --prep outputs/multi30k_en_fr --max-update 2000 --seed 2
    python scripts/quality_study.py --prep outputs/multi30k --fast            # 300 updates, to rank ideas
    python scripts/quality_study.py --list                                    # the variants and their flags

Every run trains with scripts/train.sh (RECIPE=multi30k_en_de or, with --pair en-fr, multi30k_en_fr: 256
dims, 3+3 layers, joint 8k SentencePiece) at one shared budget: --max-update N (default 1,000) with --lr 0.001
--warmup-updates 800 (the recipe's 4,000-update warm-up does not finish in a CPU budget), seed 1,
then translates test_2016_flickr and the valid split with scripts/generate.sh (beam 4, checkpoint_best.pt)
and scores each with scripts/score.sh (sacreBLEU, chrF) against its published reference. One CSV row per
(variant, budget, seed): valid loss after every epoch, the final and best valid loss, BLEU and chrF on
test_2016_flickr and on valid (valid_bleu, valid_chrf: a second sample of the same distribution, since
the gaps at stake are smaller than what one 1,000-sentence set moves), training time and words/s, the
decoding time fairseq-generate reports for the test split, the device and how many runs shared it. The CSV
is rewritten whole after every finished run (no half-written rows; under a lock, so studies side by side on one
CSV keep each other's rows) and finished rows are skipped, so the study can be stopped and continued; an
unfinished training resumes from its checkpoint_last.pt, and a longer budget continues the furthest shorter run
of the same variant and seed on disk (the inverse-sqrt schedule does not depend on --max-update, so this is the
run trained from scratch, without repeating its updates). Each pair has its own CSV (EN-FR: the EN-DE name
with _en_fr before the suffix). Two PNGs are drawn at the end: the valid-loss curves of the CSV, and BLEU
against updates per model and pair from both pairs' CSVs (--bleu-png).

--conversion runs the conversion study instead (docs/quality.md, "Converting a softmax model"): the softmax
recipe model trained for each --teacher-updates (the study's own softmax run) is converted into the default
rfa_transformer by rfa-convert-transformer with attention distillation (ce or mse loss) or by a plain swap,
translated as converted and after each --finetune-updates budget of scripts/train.sh FINETUNE_FROM (one run
per method, continued from budget to budget), beside the default model trained from scratch for the
teacher's updates plus the same budget. One row per (teacher, seed, method, D, fine-tuning learning rate,
budget) in benchmarks/results/conversion_multi30k.csv, skipped when present; a PNG of BLEU against budget.
--num-features picks D of the converted and from-scratch models (default: rfa_transformer's), --finetune-lr
the fine-tuning runs' peak learning rate (default: scripts/train.sh's recipe). A longer teacher or
from-scratch run continues the study's shorter run of the same model instead of repeating its updates.

--parallel N trains N variants at once (on a GPU, small models leave it mostly idle; timings from
such runs are marked with the number of runs sharing the device and are only comparable within it).

No run waits forever: a training that is still going after --train-timeout-h hours, or a translation
or scoring after --decode-timeout-h, is stopped (SIGTERM to its whole process group, SIGKILL 30 s
later) and reported as that variant's failure, naming the command and the limit; the other variants go
on. Ctrl-C stops every running command the same way.
"""
import argparse
import concurrent.futures
import csv
import datetime
import fcntl
import glob
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_CSV = os.path.join(REPO, "benchmarks", "results", "quality_multi30k.csv")
PAIRS = ("en-de", "en-fr")
# shared by every variant: a warm-up that ends inside the budget (see the module docstring)
BUDGET_ARGS = ["--lr", "0.001", "--warmup-updates", "800", "--no-epoch-checkpoints"]

# name -> (MODEL for train.sh, extra fairseq-train flags, what it tests). Every RFA variant spells out
# the feature map, the gate, the cross-attention and D, so a row keeps its meaning when defaults change.
def _rfa(feature_map, gate, cross, *more):
    d = [] if "--rfa-num-features" in more else ["--rfa-num-features", "64"]  # D = 64 unless a variant says
    return [
        "--rfa-feature-map", feature_map, "--rfa-gate" if gate else "--no-rfa-gate",
        "--rfa-softmax-cross-attn" if cross == "softmax" else "--no-rfa-softmax-cross-attn", *d, *more,
    ]


VARIANTS = {
    "softmax": ("softmax", [], "the softmax transformer twin (fairseq's transformer, same sizes)"),
    "rfa_paper": ("rfa", _rfa("sincos", False, "rfa"),
                  "the paper's setup (the default before this study): sincos random features, D = 64, learned sigma, "
                  "redrawn orthogonal matrices, RFA cross-attention"),
    "rfa_paper_gate": ("rfa", _rfa("sincos", True, "rfa"), "the paper's gated RFA"),
    "sincos_arccos": ("rfa", _rfa("arccos", False, "rfa"), "the paper's arc-cosine features"),
    "sincos_d128": ("rfa", _rfa("sincos", False, "rfa", "--rfa-num-features", "128"), "sincos with D = 128"),
    "sincos_gaussian": ("rfa", _rfa("sincos", False, "rfa", "--rfa-random-matrix", "gaussian"), "i.i.d. Gaussian matrices"),
    "sincos_fixed_matrix": ("rfa", _rfa("sincos", False, "rfa", "--rfa-fixed-random-matrix"), "no redraw in training"),
    "sincos_log_sigma": ("rfa", _rfa("sincos", False, "rfa", "--rfa-sigma", "log"),
                         "sigma = exp(10 theta): log sigma learns 10x faster"),
    "sincos_gate_softmax_cross": ("rfa", _rfa("sincos", True, "softmax"),
                                  "gated sincos RFA decoder self-attention, softmax cross-attention"),
    "positive_sigma2": ("rfa", _rfa("positive", False, "rfa", "--rfa-temperature", "0.25"),
                        "FAVOR+ positive features at sigma = 2 (softmax-like sharpness), fixed guard"),
    "positive_log_sigma_gate": ("rfa", _rfa("positive", True, "rfa", "--rfa-sigma", "log"),
                                "FAVOR+ with a fast-learning sigma and the gate"),
    "hedgehog": ("rfa", _rfa("hedgehog", False, "rfa"), "learned [softmax(Wx), softmax(-Wx)] map, 2 x 64 features"),
    "hedgehog_gate": ("rfa", _rfa("hedgehog", True, "rfa"), "hedgehog map and the gate, RFA everywhere in the decoder"),
    "hedgehog_gate_softmax_cross": ("rfa", _rfa("hedgehog", True, "softmax"),
                                    "hedgehog + gate in the decoder self-attention, softmax cross-attention "
                                    "(the rfa_transformer default)"),
    "hedgehog_gate_softmax_cross_d32": ("rfa", _rfa("hedgehog", True, "softmax", "--rfa-num-features", "32"),
                                        "the default model with D = 32 (2 x 32 features per head: half the state)"),
    "hedgehog_gate_softmax_cross_d16": ("rfa", _rfa("hedgehog", True, "softmax", "--rfa-num-features", "16"),
                                        "the default model with D = 16 (2 x 16 features per head: a quarter of the state)"),
    "relu_gate": ("rfa", _rfa("relu", True, "rfa", "--rfa-num-features", "128"),
                  "T2R's learned relu(Wx + b) map, 128 features, and the gate"),
    "elu_gate": ("rfa", _rfa("elu", True, "rfa"), "elu(x) + 1 (64 features) and the gate"),
}

# the default model (hedgehog map, gate, softmax cross-attention) at each D
DEFAULT_MODEL_VARIANTS = {64: "hedgehog_gate_softmax_cross", 32: "hedgehog_gate_softmax_cross_d32",
                          16: "hedgehog_gate_softmax_cross_d16"}


def default_model_variant() -> str:
    """The variant of rfa_transformer's default model: the default map at rfa_fairseq's default D."""
    sys.path.insert(0, REPO)
    from rfa_fairseq.config import RFA_DEFAULTS

    return DEFAULT_MODEL_VARIANTS[RFA_DEFAULTS["rfa_num_features"]]

FIELDS = [
    "variant", "max_update", "seed", "bleu", "chrf", "valid_loss", "best_valid_loss", "valid_loss_by_epoch",
    "train_seconds", "train_wps", "decode_seconds", "device", "runs_sharing_device", "flags", "finished_utc",
    "bleu_signature", "chrf_signature", "valid_bleu", "valid_chrf",
]
# the fairseq subsets every row is translated and scored on, each against the <subset>.raw.<tgt> reference that
# prepare-multi30k.sh writes; valid is a second sample of test_2016_flickr's distribution (checkpoint_best.pt
# is picked on its loss, not on its BLEU)
SCORED_SPLITS = ("test", "valid")


def recipe_of(pair):
    """scripts/train.sh's RECIPE for a Multi30k language pair: en-fr -> multi30k_en_fr."""
    return "multi30k_" + pair.replace("-", "_")


def csv_for_pair(csv_path, pair):
    """The pair's CSV: EN-DE keeps the name it had before EN-FR existed, EN-FR adds _en_fr before the suffix."""
    if pair == "en-de":
        return csv_path
    stem, ext = os.path.splitext(csv_path)
    return f"{stem}_{pair.replace('-', '_')}{ext}"


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] quality_study: {message}", flush=True)


# the commands running now, each the leader of its own process group (see run)
RUNNING = set()
RUNNING_LOCK = threading.Lock()
STOPPING = threading.Event()  # set by stop_all: no new command starts
STOP_GRACE_S = 30


def stop(proc) -> None:
    """SIGTERM to proc's process group (train.sh and the fairseq-train it started), then SIGKILL to
    whatever is left of it once proc has exited or STOP_GRACE_S have passed."""
    for sig, grace in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:  # the whole group is gone
            break
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass


def stop_all() -> None:
    with RUNNING_LOCK:
        STOPPING.set()
        running = list(RUNNING)
    for proc in running:
        stop(proc)


def run(cmd, env=None, log_path=None, timeout_s=None, limit_name=""):
    """Run a command; its output goes to log_path (appended). Fails loudly with the log's tail, and after
    timeout_s seconds (the option limit_name) stops it and fails naming the command and the limit."""
    with open(log_path, "a") if log_path else open(os.devnull, "w") as out:
        out.write(f"$ {' '.join(shlex.quote(c) for c in cmd)}\n")
        out.flush()
        # its own process group: a timeout must stop the fairseq process under the bash script too
        with RUNNING_LOCK:
            if STOPPING.is_set():
                raise RuntimeError(f"{' '.join(cmd[:2])} not started: the study is stopping")
            proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                                    start_new_session=True)
            RUNNING.add(proc)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            stop(proc)
            raise RuntimeError(f"{' '.join(cmd[:2])} did not finish within {timeout_s / 3600:g} h ({limit_name}): "
                               f"stopped; log {log_path}") from None
        finally:
            if proc.poll() is None:  # an exception while waiting: never leave it running
                stop(proc)
            with RUNNING_LOCK:
                RUNNING.discard(proc)
    if proc.returncode != 0:
        tail = open(log_path).read().splitlines()[-25:] if log_path else []
        raise RuntimeError(f"{cmd[0]} exited with {proc.returncode}; log {log_path}:\n" + "\n".join(tail))


def train_seconds_of(log_text: str) -> float:
    """Training seconds of every fairseq-train run in a train.log (train.sh appends one per run, each starting
    with a `train.sh: <UTC time>:` line; a continued run's log starts with its shorter run's): fairseq's own
    "done training in N seconds", or for a run that was killed, its first to its last time-stamped line."""
    total = 0.0
    for run_log in re.split(r"^(?=train\.sh: )", log_text, flags=re.M):
        done = re.search(r"done training in ([\d.]+) seconds", run_log)
        if done:
            total += float(done.group(1))
            continue
        stamps = re.findall(r"^(?:train\.sh: )?(\d{4}-\d\d-\d\d)[ T](\d\d:\d\d:\d\d)", run_log, flags=re.M)
        if len(stamps) >= 2:
            first, last = (datetime.datetime.fromisoformat(f"{day}T{time}") for day, time in (stamps[0], stamps[-1]))
            total += (last - first).total_seconds()
    return total


def parse_train_log(text: str):
    """Valid loss after each epoch and the training words/s fairseq logged at each epoch's end."""
    valid = {int(m.group(2)): float(m.group(1))  # by update: a resumed run may repeat an epoch
             for m in re.finditer(r"valid on 'valid' subset \| loss ([\d.]+) \|.*?\| num_updates (\d+)", text)}
    wps = [float(m.group(1)) for m in re.finditer(r"\| train \|.*?\| wps ([\d.]+) \|", text)]
    return sorted(valid.items()), wps


def translate_and_score(checkpoint, work, args, shared_env, tag="test", subset="test"):
    """Translate the fairseq `subset` (test: test_2016_flickr) with `checkpoint` (beam 4) into
    work/<tag>.hyp.<tgt> and score it against args.prep/<subset>.raw.<tgt>:
    {bleu, chrf, decode_seconds, bleu_signature, chrf_signature} as strings for a CSV row."""
    tgt = getattr(args, "pair", "en-de").split("-")[1]
    hyp = os.path.join(work, f"{tag}.hyp.{tgt}")
    gen = ["bash", os.path.join(REPO, "scripts", "generate.sh"), "--data-bin", os.path.join(args.prep, "data-bin"),
           "--checkpoint", checkpoint, "--recipe", "multi30k", "--beam", "4", "--max-tokens", "8192",
           "--subset", subset, "--output", hyp]
    if args.device == "cpu":
        gen.append("--cpu")
    run(gen, env=shared_env, log_path=os.path.join(work, f"{tag}.generate.log"), timeout_s=args.decode_timeout_h * 3600,
        limit_name="--decode-timeout-h")
    translated = re.search(r"Translated [\d,]+ sentences .*? in ([\d.]+)s", open(hyp + ".generate.log").read())
    scores_json = os.path.join(work, f"{tag}.scores.json")
    run(["bash", os.path.join(REPO, "scripts", "score.sh"), "--hyp", hyp, "--ref", os.path.join(args.prep, f"{subset}.raw.{tgt}"),
         "--json", scores_json], env=shared_env, log_path=os.path.join(work, f"{tag}.score.log"),
        timeout_s=args.decode_timeout_h * 3600, limit_name="--decode-timeout-h")
    scores = json.load(open(scores_json))
    return {"bleu": f"{scores['bleu']['score']:.2f}", "chrf": f"{scores['chrf']['score']:.2f}",
            "decode_seconds": translated.group(1) if translated else "",
            "bleu_signature": scores["bleu"].get("signature", ""), "chrf_signature": scores["chrf"].get("signature", "")}


def train_and_score(name, args, shared_env, runs_sharing):
    model, flags, _ = VARIANTS[name]
    work = os.path.join(args.work_dir, f"{name}_u{args.max_update}_s{args.seed}")
    # a longer budget continues the furthest shorter run of this variant and seed (same flags: same name)
    shorter = glob.glob(os.path.join(args.work_dir, f"{glob.escape(name)}_u*_s{args.seed}"))
    _continue_from(work, [d for d in shorter if re.fullmatch(rf"{re.escape(name)}_u\d+_s{args.seed}", os.path.basename(d))],
                   args.max_update)
    os.makedirs(work, exist_ok=True)
    train_log = os.path.join(work, "train.log")  # written by train.sh (appended on resume)
    env = dict(shared_env, DATA=os.path.join(args.prep, "data-bin"), RECIPE=recipe_of(getattr(args, "pair", "en-de")),
               MODEL=model)
    extra = BUDGET_ARGS + ["--seed", str(args.seed)] + flags + shlex.split(args.train_args)
    extra += ["--cpu"] if args.device == "cpu" else []
    train_seconds = _train_to(env, extra, work, args.max_update, args)
    log_text = open(train_log).read()
    valid, wps = parse_train_log(log_text)
    # the whole run's time, also for a continued or resumed one (fairseq's `wall` restarts at 0 on resume)
    train_seconds = train_seconds_of(log_text) or train_seconds
    if not valid:
        raise RuntimeError(f"{name}: no validation results in {train_log}")

    best = os.path.join(work, "checkpoint_best.pt")
    by_split = {subset: translate_and_score(best, work, args, shared_env, tag=subset, subset=subset)
                for subset in SCORED_SPLITS}
    scores, valid_scores = by_split["test"], by_split["valid"]
    return {
        "variant": name, "max_update": args.max_update, "seed": args.seed, "bleu": scores["bleu"], "chrf": scores["chrf"],
        "valid_loss": f"{valid[-1][1]:.3f}", "best_valid_loss": f"{min(v for _, v in valid):.3f}",
        "valid_loss_by_epoch": " ".join(f"{u}:{v:.3f}" for u, v in valid),
        "train_seconds": f"{train_seconds:.0f}", "train_wps": f"{sum(wps) / len(wps):.0f}" if wps else "",
        "decode_seconds": scores["decode_seconds"],
        "device": args.device_name, "runs_sharing_device": runs_sharing,
        "flags": " ".join(flags), "finished_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ"),
        "bleu_signature": scores["bleu_signature"], "chrf_signature": scores["chrf_signature"],
        "valid_bleu": valid_scores["bleu"], "valid_chrf": valid_scores["chrf"],
    }


def read_rows(path):
    if not os.path.exists(path):
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def write_rows(path, rows, fields=None):
    """Whole file to a temporary name, then renamed: a crash never leaves a half-written CSV."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields or FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    os.replace(tmp, path)


def put_row(path, row, row_key, fields=None):
    """`row` into the CSV at `path`, replacing the row with its key, and the file's rows after. The read and the
    write hold an exclusive lock on path + ".lock": studies started side by side on one CSV (one per core) finish
    at about the same time, and a row read before the other's write would drop it."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        rows = [r for r in read_rows(path) if row_key(r) != row_key(row)] + [row]
        write_rows(path, rows, fields)
    return rows


def key(row):
    return (row["variant"], int(row["max_update"]), int(row["seed"]))


def _pyplot():
    """matplotlib.pyplot drawing to files, or None (logged) when matplotlib is not installed."""
    try:
        import logging

        logging.getLogger("matplotlib").setLevel(logging.WARNING)  # before the import, which logs too: fairseq's setup prints debug lines
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is not installed: no PNG")
        return None
    return plt


def plot(rows, png_path, pair="en-de"):
    plt = _pyplot()
    if plt is None:
        return
    budgets = sorted({int(r["max_update"]) for r in rows})
    fig, axes = plt.subplots(1, len(budgets), figsize=(7 * len(budgets), 5), squeeze=False)
    for ax, budget in zip(axes[0], budgets):
        for row in sorted((r for r in rows if int(r["max_update"]) == budget), key=lambda r: -float(r["bleu"])):
            points = [tuple(map(float, p.split(":"))) for p in row["valid_loss_by_epoch"].split()]
            style = dict(color="black", linewidth=2.5) if row["variant"] == "softmax" else dict(linewidth=1.2)
            ax.plot([u for u, _ in points], [v for _, v in points], marker=".",
                    label=f"{row['variant']} s{row['seed']} (BLEU {row['bleu']})", **style)
        ax.set_title(f"Multi30k {pair.upper()}, {budget} updates: valid loss")
        ax.set_xlabel("updates")
        ax.set_ylabel("valid loss (label-smoothed CE, base 2)")
        ax.set_ylim(top=min(9, ax.get_ylim()[1]))
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png_path, dpi=90)
    log(f"wrote {png_path}")


RULE_TOLERANCE = 0.5  # BLEU: the default D's mean over seeds may trail softmax's by at most this (docs/quality.md)


def rule_table(csv_by_pair, tolerance=RULE_TOLERANCE):
    """The D rule's inputs: for each pair, budget and D of the default model, the mean BLEU over the seeds that
    both it and softmax have at that budget (paired seeds only), the gap, and each seed's gap (the seeds spread
    more than the D values do, so the table shows how far one seed moves the mean). Also the verdict: the smallest
    (fastest) D whose gap is at most `tolerance` at each pair's longest budget with a paired D (holds_at_longest:
    a pair where that D has no row counts when a smaller D holds there), or None.
    valid_gap: the same gap on the valid split over the paired seeds whose rows have its BLEU (None without)
    and valid_seeds those seeds; shown beside the rule, which stays on test_2016_flickr."""
    table, longest = [], {}
    for pair, path in csv_by_pair.items():
        bleu, valid_bleu = {}, {}  # (variant, budget) -> {seed: BLEU}
        for r in read_rows(path):
            at = (r["variant"], int(r["max_update"]))
            bleu.setdefault(at, {})[int(r["seed"])] = float(r["bleu"])
            if r.get("valid_bleu"):
                valid_bleu.setdefault(at, {})[int(r["seed"])] = float(r["valid_bleu"])
        for d, variant in sorted(DEFAULT_MODEL_VARIANTS.items()):
            for budget in sorted({b for (v, b) in bleu if v == variant}):
                seeds = sorted(set(bleu[(variant, budget)]) & set(bleu.get(("softmax", budget), {})))
                if not seeds:
                    continue
                softmax = sum(bleu[("softmax", budget)][s] for s in seeds) / len(seeds)
                default = sum(bleu[(variant, budget)][s] for s in seeds) / len(seeds)
                seed_gaps = [bleu[(variant, budget)][s] - bleu[("softmax", budget)][s] for s in seeds]
                on_valid = [valid_bleu.get(m, {}) for m in ((variant, budget), ("softmax", budget))]
                valid_seeds = [s for s in seeds if all(s in v for v in on_valid)]
                valid_gap = (sum(on_valid[0][s] - on_valid[1][s] for s in valid_seeds) / len(valid_seeds)
                             if valid_seeds else None)
                table.append(dict(pair=pair, max_update=budget, d=d, seeds=seeds, softmax=softmax, default=default,
                                  gap=default - softmax, seed_gaps=seed_gaps, within=default - softmax >= -tolerance,
                                  valid_gap=valid_gap, valid_seeds=valid_seeds))
                longest[pair] = max(longest.get(pair, 0), budget)
    table.sort(key=lambda r: (list(csv_by_pair).index(r["pair"]), r["max_update"], r["d"]))
    passing = None
    if len(longest) == len(csv_by_pair):
        for d in sorted(DEFAULT_MODEL_VARIANTS):
            if all(holds_at_longest(table, longest, d, pair) is not None for pair in longest):
                passing = d
                break
    return table, longest, passing


def holds_at_longest(table, longest, d, pair):
    """Which D's rows show that D holds on `pair` at its longest budget: d itself when d has rows there (within the
    tolerance or not), else the smallest smaller D that holds there (more features are trained only where fewer
    miss: a larger D is taken to hold where a smaller one does), else None."""
    at_longest = {r["d"]: r for r in table if r["pair"] == pair and r["max_update"] == longest[pair]}
    if d in at_longest:
        return d if at_longest[d]["within"] else None
    return next((smaller for smaller in sorted(at_longest) if smaller < d and at_longest[smaller]["within"]), None)


def print_rule(csv_by_pair, tolerance=RULE_TOLERANCE):
    table, longest, passing = rule_table(csv_by_pair, tolerance)
    with_valid = any(r["valid_gap"] is not None for r in table)
    valid_head = f" {'valid gap (seeds)':>17s}" if with_valid else ""
    print(f"{'pair':6s} {'updates':>7s} {'D':>3s} {'seeds':8s} {'softmax':>8s} {'default':>8s} {'gap':>6s}{valid_head}"
          f"  gap per seed")
    for r in table:
        mark = "  <- longest budget" if r["max_update"] == longest[r["pair"]] else ""
        valid = ""
        if with_valid:
            valid = (f" {r['valid_gap']:+6.2f} ({','.join(map(str, r['valid_seeds']))})".ljust(18)
                     if r["valid_gap"] is not None else f" {'—':>6s}".ljust(18))
        print(f"{r['pair']:6s} {r['max_update']:7d} {r['d']:3d} {','.join(map(str, r['seeds'])):8s} {r['softmax']:8.2f} "
              f"{r['default']:8.2f} {r['gap']:+6.2f}{valid}  {' '.join(f'{g:+.2f}' for g in r['seed_gaps'])}{mark}")
    unmeasured = [pair for pair in csv_by_pair if pair not in longest]
    if unmeasured:
        print(f"no verdict: no budget with both softmax and the default model for {', '.join(unmeasured)} "
              f"(in {', '.join(csv_by_pair[p] for p in unmeasured)})")
    elif passing is None:
        print(f"no D is within {tolerance} BLEU of softmax at the longest budget of every pair")
    else:
        print(f"the rule picks D = {passing}: the fastest D within {tolerance} BLEU of softmax (mean over paired seeds) "
              f"at the longest budget of every pair ({', '.join(f'{p} {b}' for p, b in longest.items())} updates)")
        for pair in longest:
            shown_by = holds_at_longest(table, longest, passing, pair)
            if shown_by != passing:
                print(f"  {pair}: D = {passing} has no row at {longest[pair]} updates; D = {shown_by} holds there")
    return passing


def plot_bleu_by_updates(csv_by_pair, png_path, variants=("softmax",) + tuple(DEFAULT_MODEL_VARIANTS.values())):
    """BLEU on test_2016_flickr against training updates, one panel per pair, one line per variant (the mean over
    seeds, each seed's row as a dot): the softmax twin and the default model at each D."""
    plt = _pyplot()
    if plt is None:
        return
    csv_by_pair = {pair: path for pair, path in csv_by_pair.items() if os.path.exists(path)}
    fig, axes = plt.subplots(1, len(csv_by_pair), figsize=(7 * len(csv_by_pair), 5), squeeze=False)
    for ax, (pair, path) in zip(axes[0], csv_by_pair.items()):
        rows = [r for r in read_rows(path) if r["variant"] in variants]
        for variant in [v for v in variants if any(r["variant"] == v for r in rows)]:
            by_budget = {}
            for r in rows:
                if r["variant"] == variant:
                    by_budget.setdefault(int(r["max_update"]), []).append(float(r["bleu"]))
            budgets = sorted(by_budget)
            style = dict(color="black", linewidth=2.5) if variant == "softmax" else dict(linewidth=1.5)
            line, = ax.plot(budgets, [sum(by_budget[b]) / len(by_budget[b]) for b in budgets], marker="o",
                            label=f"{variant} (mean of seeds)", **style)
            for b in budgets:
                ax.scatter([b] * len(by_budget[b]), by_budget[b], color=line.get_color(), s=12, alpha=0.6)
        ax.set_title(f"Multi30k {pair.upper()}: BLEU, test_2016_flickr (beam 4)")
        ax.set_xlabel("training updates")
        ax.set_ylabel("BLEU")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png_path, dpi=90)
    log(f"wrote {png_path}")


# ---------------------------------------------------------------- --conversion: softmax -> RFA


CONVERSION_CSV = os.path.join(REPO, "benchmarks", "results", "conversion_multi30k.csv")
CONVERSION_FIELDS = [
    "teacher_updates", "seed", "method", "num_features", "finetune_lr", "finetune_updates", "bleu", "chrf", "teacher_bleu",
    "attention_cosine_before", "attention_cosine_after", "attention_top1_before", "attention_top1_after",
    "teacher_forced_kl", "teacher_forced_top1", "convert_seconds", "train_seconds", "device", "finished_utc",
]
# method -> rfa-convert-transformer flags (None: the default model trained from scratch, for comparison)
CONVERSION_METHODS = {
    "distill_ce": ["--distill-loss", "ce"],
    "distill_mse": ["--distill-loss", "mse"],
    "swap": ["--distill-steps", "0"],
    "scratch": None,
}
CONVERTING = [m for m, flags in CONVERSION_METHODS.items() if flags is not None]


# rows written before these columns existed: D = 64 (the default then) and train.sh's fine-tuning learning rate
LEGACY_NUM_FEATURES = "64"


def _train_sh_finetune_lr() -> str:
    """The peak learning rate of scripts/train.sh's fine-tuning recipe (FINETUNE_ARGS), read from the script."""
    text = open(os.path.join(REPO, "scripts", "train.sh")).read()
    found = re.search(r"^FINETUNE_ARGS=\(.*?--lr (\S+?)[ )]", text, re.MULTILINE)
    if not found:
        raise RuntimeError("scripts/train.sh has no FINETUNE_ARGS=(... --lr X ...) line")
    return found.group(1)


DEFAULT_FINETUNE_LR = _train_sh_finetune_lr()


def conversion_key(row):
    """(teacher updates, seed, method, D, fine-tuning lr, fine-tuning updates). D and the learning rate are
    empty where they do not apply: the teacher has no D, and only fine-tuned rows (budget > 0 of a
    converted model) have a fine-tuning learning rate."""
    method, budget = row["method"], int(row["finetune_updates"])
    features = "" if method == "teacher" else (row.get("num_features") or LEGACY_NUM_FEATURES)
    lr = (row.get("finetune_lr") or DEFAULT_FINETUNE_LR) if method in CONVERTING and budget > 0 else ""
    return (int(row["teacher_updates"]), int(row["seed"]), method, features, lr, budget)


def _load(checkpoint):
    sys.path.insert(0, REPO)
    from rfa_fairseq.checkpoints import safe_load

    return safe_load(checkpoint, mmap=True)


def _updates_of(checkpoint):
    history = _load(checkpoint).get("optimizer_history") or [{}]
    return int(history[-1].get("num_updates", -1))


def _train_to(env, extra, work, updates, args):
    """train.sh up to `updates` in `work` (resuming its checkpoint_last.pt); refuses a checkpoint already past it."""
    last = os.path.join(work, "checkpoint_last.pt")
    reached = _updates_of(last) if os.path.exists(last) else 0
    if reached > updates:
        raise RuntimeError(f"{last} is past {updates} updates ({reached}): its row for {updates} cannot "
                           f"be measured any more; delete {work} to redo the run")
    if reached == updates:  # rerunning fairseq-train on a finished run would add an update
        return 0.0
    start = time.time()
    run(["bash", os.path.join(REPO, "scripts", "train.sh"), *extra], env=dict(env, SAVE_DIR=work, MAX_UPDATE=str(updates)),
        log_path=os.path.join(work, "train_sh.log"), timeout_s=args.train_timeout_h * 3600, limit_name="--train-timeout-h")
    return time.time() - start


def _continue_from(work, sources, updates):
    """Start `work` from the furthest of `sources` (run directories of the same model, flags and seed) whose
    checkpoint_last.pt stands at no more than `updates` updates, when `work` has no checkpoint yet: its
    checkpoint_last.pt and train.log are copied and train.sh continues from there. The run is the one that
    would be trained from scratch (fairseq restores model, optimizer, schedule and data position; the
    inverse-sqrt schedule does not depend on --max-update), without repeating its first updates."""
    if os.path.exists(os.path.join(work, "checkpoint_last.pt")):
        return
    reached = {}
    for source in sources:
        last = os.path.join(source, "checkpoint_last.pt")
        if os.path.abspath(source) != os.path.abspath(work) and os.path.exists(last):
            reached[source] = _updates_of(last)
    usable = [source for source, n in reached.items() if n <= updates]
    if not usable:
        return
    source = max(usable, key=reached.get)
    os.makedirs(work, exist_ok=True)
    for name in ("train.log", "checkpoint_best.pt", "checkpoint_last.pt"):  # the checkpoint last: it marks a copy done
        if os.path.exists(os.path.join(source, name)):
            shutil.copyfile(os.path.join(source, name), os.path.join(work, name + ".tmp"))
            os.replace(os.path.join(work, name + ".tmp"), os.path.join(work, name))
    log(f"{work}: continues {source} (at {reached[source]} updates)")


def conversion_study(args, shared_env):
    """Teachers = the softmax recipe model at each --teacher-updates; each is converted by every method (into the
    default model with D = --num-features) and fine-tuned at --finetune-lr; each (teacher, method, D, learning
    rate, fine-tuning updates) is one CSV row, written as soon as it is scored."""
    rows = read_rows(args.csv)
    done = {conversion_key(r) for r in rows}
    data_bin = os.path.join(args.prep, "data-bin")
    finished = lambda: datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ")  # noqa: E731
    cpu = ["--cpu"] if args.device == "cpu" else []
    features = str(args.num_features)
    d_flags = ["--rfa-num-features", features]
    lr = args.finetune_lr

    def row_key(teacher_updates, method, budget):
        return conversion_key(dict(teacher_updates=teacher_updates, seed=args.seed, method=method, num_features=features,
                                   finetune_lr=lr, finetune_updates=budget))

    def record(row):
        nonlocal rows
        row.update(device=args.device_name, finished_utc=finished())
        if row["method"] != "teacher":
            row["num_features"] = features
        if row["method"] in CONVERTING and int(row["finetune_updates"]) > 0:
            row["finetune_lr"] = lr
        rows = put_row(args.csv, row, conversion_key, CONVERSION_FIELDS)
        log(f"teacher {row['teacher_updates']} {row['method']} D={features} +{row['finetune_updates']}: "
            f"BLEU {row['bleu']} chrF {row['chrf']}")

    for teacher_updates in args.teacher_updates:
        teacher_args = argparse.Namespace(**{**vars(args), "max_update": teacher_updates})
        teacher_dir = os.path.join(args.work_dir, f"softmax_u{teacher_updates}_s{args.seed}")
        teacher = os.path.join(teacher_dir, "checkpoint_best.pt")
        base = dict(teacher_updates=teacher_updates, seed=args.seed)
        converting = [m for m in args.methods if m in CONVERTING
                      and any(row_key(teacher_updates, m, b) not in done for b in args.finetune_updates)]
        # the teacher is trained only when a conversion needs it (a scratch run can go on beside its training)
        if converting and (row_key(teacher_updates, "teacher", 0) not in done or not os.path.exists(teacher)):
            # any shorter run of the teacher, from this call's --teacher-updates or an earlier one
            shorter = glob.glob(os.path.join(args.work_dir, f"softmax_u*_s{args.seed}"))
            _continue_from(teacher_dir, shorter, teacher_updates)
            last = os.path.join(teacher_dir, "checkpoint_last.pt")
            if os.path.exists(teacher) and os.path.exists(last) and _updates_of(last) >= teacher_updates:
                # trained already (by the quality study): fairseq-train would add an update when rerun
                row = dict(translate_and_score(teacher, teacher_dir, args, shared_env), train_seconds="")
            else:
                row = train_and_score("softmax", teacher_args, shared_env, 1)
            record(dict(base, method="teacher", finetune_updates=0, bleu=row["bleu"], chrf=row["chrf"],
                        teacher_bleu=row["bleu"], train_seconds=row["train_seconds"]))
            done.add(row_key(teacher_updates, "teacher", 0))
        teacher_bleu = next((r["bleu"] for r in read_rows(args.csv)
                             if conversion_key(r) == row_key(teacher_updates, "teacher", 0)), "")
        # D = 64 keeps the directories of the runs made before D was a study option
        d_tag = "" if features == LEGACY_NUM_FEATURES else f"_d{features}"
        work_root = os.path.join(args.work_dir, f"conversion_u{teacher_updates}_s{args.seed}{d_tag}")
        for method in args.methods:
            work = os.path.join(work_root, method)
            todo = [b for b in sorted(args.finetune_updates) if row_key(teacher_updates, method, b) not in done]
            if not todo:
                continue
            os.makedirs(work, exist_ok=True)
            env = dict(shared_env, DATA=data_bin, RECIPE=recipe_of("en-de"), MODEL="rfa")
            if method == "scratch":  # the default model from scratch: the same total number of updates
                variant = DEFAULT_MODEL_VARIANTS.get(args.num_features)
                variant_flags = VARIANTS[variant][1] if variant else VARIANTS["hedgehog_gate_softmax_cross"][1] + d_flags
                extra = BUDGET_ARGS + ["--seed", str(args.seed)] + variant_flags + cpu
                # the same model trained by the quality study, or for a smaller teacher here, is continued
                sources = (glob.glob(os.path.join(args.work_dir, f"{variant}_u*_s{args.seed}")) if variant else []) + \
                    glob.glob(os.path.join(args.work_dir, f"conversion_u*_s{args.seed}{d_tag}", method))
                _continue_from(work, sources, teacher_updates + todo[0])
                for budget in todo:
                    seconds = _train_to(env, extra, work, teacher_updates + budget, args)
                    scores = translate_and_score(os.path.join(work, "checkpoint_last.pt"), work, args, shared_env,
                                                 tag=f"test_u{teacher_updates + budget}")
                    record(dict(base, method=method, finetune_updates=budget, bleu=scores["bleu"], chrf=scores["chrf"],
                                teacher_bleu=teacher_bleu, train_seconds=f"{seconds:.0f}"))
                continue
            converted = os.path.join(work, "rfa_init.pt")
            if not os.path.exists(converted):
                start = time.time()
                run([sys.executable, "-m", "rfa_fairseq.cli.convert", "--input", teacher, "--output", converted,
                     "--calibration-data", data_bin, *d_flags, *CONVERSION_METHODS[method]], env=shared_env,
                    log_path=os.path.join(work, "convert.log"), timeout_s=args.train_timeout_h * 3600,
                    limit_name="--train-timeout-h")
                with open(os.path.join(work, "convert_seconds.txt"), "w") as f:
                    f.write(f"{time.time() - start:.0f}\n")
            info = _load(converted).get("rfa_conversion") or {}
            layers = (info.get("distillation") or {}).get("layers") or {}
            mean = lambda when, what: (f"{sum(l[when][what] for l in layers.values()) / len(layers):.3f}"  # noqa: E731
                                       if layers else "")
            calibration = info.get("calibration") or {}
            fidelity = dict(
                attention_cosine_before=mean("before", "output_cosine"), attention_cosine_after=mean("after", "output_cosine"),
                attention_top1_before=mean("before", "top1_agreement"), attention_top1_after=mean("after", "top1_agreement"),
                teacher_forced_kl=f"{calibration.get('kl', float('nan')):.4f}",
                teacher_forced_top1=f"{calibration.get('top1_agreement', float('nan')):.3f}",
                convert_seconds=open(os.path.join(work, "convert_seconds.txt")).read().strip(),
            )
            # one fine-tuning run per learning rate, continued from budget to budget
            finetune_dir = os.path.join(work, "finetune" if lr == DEFAULT_FINETUNE_LR else f"finetune_lr{lr}")
            os.makedirs(finetune_dir, exist_ok=True)
            extra = ["--seed", str(args.seed), "--no-epoch-checkpoints"] + cpu
            if lr != DEFAULT_FINETUNE_LR:
                extra += ["--lr", lr]  # after train.sh's FINETUNE_ARGS: the last --lr wins
            for budget in todo:
                seconds = 0.0
                checkpoint = converted
                test_tag = f"test_ft{budget}"
                if budget > 0:
                    seconds = _train_to(dict(env, FINETUNE_FROM=converted), extra, finetune_dir, budget, args)
                    checkpoint = os.path.join(finetune_dir, "checkpoint_last.pt")
                    test_tag += "" if lr == DEFAULT_FINETUNE_LR else f"_lr{lr}"
                scores = translate_and_score(checkpoint, work, args, shared_env, tag=test_tag)
                record(dict(base, method=method, finetune_updates=budget, bleu=scores["bleu"], chrf=scores["chrf"],
                            teacher_bleu=teacher_bleu, train_seconds=f"{seconds:.0f}", **fidelity))
    plot_conversion(read_rows(args.csv), os.path.splitext(args.csv)[0] + ".png")
    return 0


def plot_conversion(rows, png_path):
    plt = _pyplot()
    if plt is None:
        return
    teachers = sorted({int(r["teacher_updates"]) for r in rows})
    if not teachers:
        return
    fig, axes = plt.subplots(1, len(teachers), figsize=(7 * len(teachers), 5), squeeze=False)
    for ax, teacher in zip(axes[0], teachers):
        mine = [r for r in rows if int(r["teacher_updates"]) == teacher]
        # one line per (method, D, fine-tuning lr); a converted model's budget-0 point starts each of its lines
        curves = {}
        for r in mine:
            if r["method"] == "teacher":
                continue
            _, _, method, features, lr, budget = conversion_key(r)
            curves.setdefault((method, features, lr), []).append((budget, float(r["bleu"])))
        for (method, features, lr), points in sorted(curves.items()):
            if method in CONVERTING and lr == "":
                if any(m == method and f == features and l for m, f, l in curves):
                    continue  # drawn as the start of its fine-tuned lines
            elif method in CONVERTING:
                points = points + curves.get((method, features, ""), [])
            label = f"{method}, D = {features}" + (f", fine-tuning lr {lr}" if lr else "")
            if method == "scratch":
                label += f" (from scratch: {teacher} + x updates)"
            ax.plot(*zip(*sorted(points)), marker="o", label=label)
        for r in mine:
            if r["method"] == "teacher":
                ax.axhline(float(r["bleu"]), color="black", linestyle="--", label=f"softmax teacher ({r['bleu']})")
                ax.axhline(float(r["bleu"]) - 0.5, color="grey", linestyle=":", label="teacher - 0.5 BLEU")
        ax.set_title(f"Multi30k EN-DE, softmax teacher at {teacher} updates")
        ax.set_xlabel("fine-tuning updates")
        ax.set_ylabel("BLEU, test_2016_flickr (beam 4)")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png_path, dpi=90)
    log(f"wrote {png_path}")

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pair", choices=PAIRS, default="en-de",
                   help="Multi30k language pair (default en-de); en-fr trains RECIPE=multi30k_en_fr into its own CSV")
    p.add_argument("--prep", default=None,
                   help="output of data-prep/prepare-multi30k.sh --pair PAIR (data-bin/, test.raw.<tgt>, valid.raw.<tgt>, "
                        "spm.model); "
                        "default outputs/multi30k (en-de), outputs/multi30k_en_fr (en-fr)")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), help="names from --list (default: all)")
    p.add_argument("--max-update", type=int, default=1000)
    p.add_argument("--fast", action="store_true", help="--max-update 300: rank ideas before confirming at full budget")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--parallel", type=int, default=1, help="variants trained at once (default 1)")
    p.add_argument("--runs-sharing-device", type=int, default=None,
                   help="runs on the device in all, counting other studies started beside this one: sets the CPU "
                        "threads per run and the CSV's runs_sharing_device (default: the runs this study trains at once)")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when available")
    p.add_argument("--work-dir", default=None, help="run directories (default outputs/quality, outputs/quality_en_fr)")
    p.add_argument("--bleu-png", default=None,
                   help="BLEU against updates, both pairs (default: the EN-DE CSV's name + _bleu_by_updates.png)")
    p.add_argument("--csv", default=None, help=f"default: {os.path.relpath(DEFAULT_CSV, REPO)}, with --conversion "
                   f"{os.path.relpath(CONVERSION_CSV, REPO)}")
    p.add_argument("--conversion", action="store_true",
                   help="the conversion study instead: softmax teachers converted to the default rfa_transformer "
                        "(--methods), then fine-tuned (--finetune-updates) with scripts/train.sh FINETUNE_FROM")
    p.add_argument("--teacher-updates", type=int, nargs="+", default=[1000, 2000],
                   help="with --conversion: the softmax teachers' training updates (default: 1000 2000)")
    p.add_argument("--finetune-updates", type=int, nargs="+", default=[0, 50, 100, 200, 500],
                   help="with --conversion: fine-tuning budgets measured (default: 0 50 100 200 500)")
    p.add_argument("--methods", nargs="+", choices=list(CONVERSION_METHODS), default=list(CONVERSION_METHODS),
                   help="with --conversion: distill_ce, distill_mse (rfa-convert-transformer's distillation losses), "
                        "swap (no distillation), scratch (the default model trained from scratch for the teacher's "
                        "updates + the fine-tuning budget) (default: all)")
    p.add_argument("--num-features", type=int, default=None,
                   help="with --conversion: D of the converted and the from-scratch models (default: rfa_transformer's)")
    p.add_argument("--finetune-lr", default=DEFAULT_FINETUNE_LR,
                   help=f"with --conversion: peak learning rate of the fine-tuning runs (default: scripts/train.sh's "
                        f"fine-tuning recipe, {DEFAULT_FINETUNE_LR}); one fine-tuning run per value, kept apart in the CSV")
    p.add_argument("--train-args", default="", help="more fairseq-train flags for every run (they do not enter the row key)")
    p.add_argument("--train-timeout-h", type=float, default=48.0,
                   help="stop a training still running after this many hours (default 48)")
    p.add_argument("--decode-timeout-h", type=float, default=6.0,
                   help="stop a translation or scoring still running after this many hours (default 6)")
    p.add_argument("--list", action="store_true", help="print the variants and exit")
    p.add_argument("--rule", action="store_true",
                   help="print the D rule's table from both pairs' CSVs (--csv names the EN-DE one) and exit")
    args = p.parse_args(argv)
    if args.train_timeout_h <= 0 or args.decode_timeout_h <= 0:
        p.error("--train-timeout-h and --decode-timeout-h must be positive")
    if args.runs_sharing_device is not None and args.runs_sharing_device < 1:
        p.error(f"--runs-sharing-device must be at least 1, got {args.runs_sharing_device}")
    if args.list:
        for name, (model, flags, what) in VARIANTS.items():
            print(f"{name:30s} MODEL={model:8s} {' '.join(flags):60s} {what}")
        return 0
    if args.rule:
        stem = args.csv or DEFAULT_CSV
        print_rule({pair: csv_for_pair(stem, pair) for pair in PAIRS})
        return 0
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        p.error(f"unknown variant(s) {', '.join(unknown)}; see --list")
    if args.fast:
        args.max_update = 300
    if args.conversion and args.pair != "en-de":
        p.error("--conversion studies EN-DE only (its CSV has no pair column)")
    pair_tag = "" if args.pair == "en-de" else "_" + args.pair.replace("-", "_")
    args.prep = args.prep or os.path.join(REPO, "outputs", "multi30k" + pair_tag)
    args.work_dir = args.work_dir or os.path.join(REPO, "outputs", "quality" + pair_tag)
    if args.csv is None:
        args.csv = CONVERSION_CSV if args.conversion else csv_for_pair(DEFAULT_CSV, args.pair)
    if any(u <= 0 for u in args.teacher_updates) or any(b < 0 for b in args.finetune_updates):
        p.error("--teacher-updates must be positive and --finetune-updates non-negative")
    if args.num_features is not None and args.num_features <= 0:
        p.error(f"--num-features must be positive, got {args.num_features}")
    try:
        if float(args.finetune_lr) <= 0:
            raise ValueError
    except ValueError:
        p.error(f"--finetune-lr must be a positive number, got {args.finetune_lr!r}")
    src, tgt = args.pair.split("-")
    references = [f"{subset}.raw.{tgt}" for subset in SCORED_SPLITS]
    for needed in (f"data-bin/dict.{src}.txt", f"data-bin/dict.{tgt}.txt", *references, "spm.model"):
        if not os.path.exists(os.path.join(args.prep, needed)):
            p.error(f"--prep {args.prep} has no {needed}: run data-prep/prepare-multi30k.sh --pair {args.pair} "
                    f"--local-dir ... {args.prep} (again: it adds what a directory prepared earlier lacks)")
    import torch

    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    args.device_name = torch.cuda.get_device_name() if args.device == "cuda" else f"cpu ({os.cpu_count()} cores)"
    bin_dir = os.path.dirname(sys.executable)
    shared_env = dict(os.environ, PYTHON=sys.executable, PATH=bin_dir + os.pathsep + os.environ.get("PATH", ""),
                      PYTHONUNBUFFERED="1")
    # CPU threads per run: parallel runs that each start one OpenMP thread per core spin against each
    # other (measured: 16 runs on a 16-core GPU machine drew orthogonal matrices 100x slower)
    sharing = args.parallel
    if not args.conversion:
        done = {key(r) for r in read_rows(args.csv)}
        todo = [v for v in args.variants if (v, args.max_update, args.seed) not in done]
        sharing = max(1, min(args.parallel, len(todo)))
    sharing = args.runs_sharing_device or sharing
    shared_env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // max(1, sharing))))

    if args.conversion:
        if args.num_features is None:
            sys.path.insert(0, REPO)
            from rfa_fairseq.config import RFA_DEFAULTS

            args.num_features = RFA_DEFAULTS["rfa_num_features"]
        return conversion_study(args, shared_env)
    log(f"{len(args.variants) - len(todo)} of {len(args.variants)} variants already in {args.csv}; "
        f"training {len(todo)} on {args.device_name}, {args.parallel} at a time, {args.max_update} updates")
    failures = []
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.parallel)) as pool:
        futures = {pool.submit(train_and_score, v, args, shared_env, sharing): v for v in todo}
        try:
            for future in concurrent.futures.as_completed(futures):
                name = futures[future]
                try:
                    row = future.result()
                except Exception as error:  # keep the other runs going; report at the end
                    failures.append(name)
                    log(f"{name} FAILED: {error}")
                    continue
                put_row(args.csv, row, key)
                log(f"{name}: BLEU {row['bleu']} chrF {row['chrf']} valid {row['valid_loss']} "
                    f"({row['train_seconds']} s training)")
        except KeyboardInterrupt:  # the commands run in their own process groups: Ctrl-C does not reach them
            log("interrupted: stopping the running commands")
            for future in futures:
                future.cancel()
            stop_all()
            raise
    rows = read_rows(args.csv)
    if rows:
        plot(rows, os.path.splitext(args.csv)[0] + ".png", args.pair)
        stem, ext = os.path.splitext(args.csv)
        stem = stem[: -len(pair_tag)] if pair_tag and stem.endswith(pair_tag) else stem
        plot_bleu_by_updates({pair: csv_for_pair(stem + ext, pair) for pair in PAIRS},
                             args.bleu_png or stem + "_bleu_by_updates.png")
        budget_rows = sorted((r for r in rows if int(r["max_update"]) == args.max_update), key=lambda r: -float(r["bleu"]))
        print(f"\n{'variant':30s} {'seed':>4s} {'BLEU':>6s} {'chrF':>6s} {'valid':>6s} {'train s':>8s} {'decode s':>8s}")
        for r in budget_rows:
            print(f"{r['variant']:30s} {r['seed']:>4s} {r['bleu']:>6s} {r['chrf']:>6s} {r['valid_loss']:>6s} "
                  f"{r['train_seconds']:>8s} {r['decode_seconds']:>8s}")
    if failures:
        log(f"failed: {', '.join(failures)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
