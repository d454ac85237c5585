#!/usr/bin/env python3
"""The weight-reading floor of a decoding step at batch 1, and the measured step against it.

At batch 1 (one sentence, its beam of 4 rows) a decoder step is a few rows through every linear layer: each weight
is read once and used 4 times, so a step cannot take less than its weights' bytes over the rate one core reads
memory. Per model size (recipe: 3+3 layers, 256 wide, the Multi30k recipe's 8k vocabulary; base; big: 32k joint
vocabulary), model (rfa: the default rfa_transformer's step; softmax: the softmax transformer's, which CTranslate2
decodes) and precision this script computes:

  weight_mb      the bytes one decoder step reads of weights: every decoder layer's linear layers that run per step
                 and the output projection over the whole vocabulary. rfa: the causal attention's fused input
                 projection [q | k | v | gate] (the hedgehog map's affine part folded into q and k: 2 H D + C + H
                 outputs), its output projection, the softmax cross-attention's query and output projections (its
                 K and V are computed once per sentence, not per step), the FFN's two; softmax: q, k, v, output,
                 cross query and output, the FFN's two. fp32: 4 bytes a weight; int8: 1 byte a weight plus a
                 4-byte scale a row; biases 4 bytes an output. The embedding rows (one per row), the layer norms and
                 the attention's state (a few hundred KB at batch 1) are left out.
  read_gb_s      this core's read bandwidth from memory: the fastest of --repeats passes of three reads (torch.sum,
                 a matrix-vector product torch.mv, numpy's sum; one thread; `read` names the fastest) over a float32
                 buffer of --buffer-mb (default: 4x the last-level cache, 1 GiB at the least), in a process capped at
                 the row's instruction-set level (benchmark_common.ISA_CAPS)
  floor_ms       weight_mb / read_gb_s: the step's floor when its weights come from memory
  cached_read_gb_s, cached_floor_ms   the same with a buffer of the step's own bytes read again and again: the
                 floor where the weights stay in the caches between steps (a last-level cache larger than them)

and, from benchmark_generate.py's CSVs (--generate-csv; rows at batch 1, one thread, forced lengths, measured on
this machine), the step time:

  step_ms        the generation time (fairseq-generate's timer; ctranslate2_generate.py's around translate_batch) over
                 the decoder steps of one sentence's beam it ran: L + 1 per sentence in fairseq-generate (L tokens,
                 then a step whose end is forced), L in CTranslate2 (it stops at its maximum length). Both count L + 1
                 tokens per sentence, so this is 1000 / tokens_per_s x (L + 1) / steps. The time includes each
                 sentence's encoder pass and start, spread over its steps: an upper bound of the step itself.
  marginal_step_ms   the step without the sentence's fixed costs: the time's growth per step between the shortest
                 and the longest forced length measured ((t_long - t_short) / (sentences x (L_long - L_short)): each
                 token more is a step more in both engines)
  step_vs_floor, marginal_vs_floor, step_vs_cached_floor   the ratios

    python benchmarks/weight_floor.py                     # the user sizes' CSVs under benchmarks/results
    python benchmarks/weight_floor.py --generate-csv base=outputs/bench/generate_user_base_cpu.csv --csv out.csv

Files: benchmarks/results/weight_floor_cpu.csv (rewritten whole: the bandwidth is measured at each run).
"""
import argparse
import csv
import dataclasses
import datetime
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmark_common import REPO, cpu_isa_environment, write_csv  # noqa: E402

FP32_BYTES, INT8_BYTES, SCALE_BYTES, BIAS_BYTES = 4, 1, 4, 4
PRECISIONS = ("fp32", "int8")
MIN_BUFFER_BYTES = 2**30  # 1 GiB: above any last-level cache this script may meet
DEFAULT_REPEATS = 5
RESULTS = os.path.join(REPO, "benchmarks", "results")
# benchmark_generate.py's model -> (the step it runs: rfa or softmax, precision)
MODEL_STEPS = {
    "rfa": ("rfa", "fp32"), "rfa_int8": ("rfa", "int8"),
    "softmax": ("softmax", "fp32"), "ct2_softmax": ("softmax", "fp32"), "ct2_softmax_int8": ("softmax", "int8"),
}
CHILD_TIMEOUT_S = 600


@dataclasses.dataclass(frozen=True)
class Dims:
    """A model's decoder as a step reads it: layers, width C, FFN width, heads H, vocabulary rows (fairseq's specials
    included), the RFA map's D (pre-activations per head of its affine part), whether the RFA attention is gated."""

    layers: int
    embed: int
    ffn: int
    heads: int
    vocab: int
    num_features: int = 32
    gated: bool = True


# the recipe model: configs/multi30k_en_de.yaml, 7,997 SentencePiece entries + fairseq's 4 specials;
# base / big: transformer_wmt_en_de[_big] with benchmarks/user_size_checkpoints.py's 32,000 entries + 4
SIZE_DIMS = {
    "recipe": Dims(layers=3, embed=256, ffn=1024, heads=4, vocab=8001),
    "base": Dims(layers=6, embed=512, ffn=2048, heads=8, vocab=32004),
    "big": Dims(layers=6, embed=1024, ffn=4096, heads=16, vocab=32004),
}


def step_products(dims: Dims, model: str) -> list:
    """[(name, outputs, inputs, has_bias)] of the linear products one decoder step runs (every layer's, then the
    output projection): model "rfa" (the default rfa_transformer's native step) or "softmax"."""
    C, H, D = dims.embed, dims.heads, dims.num_features
    if model == "rfa":
        self_attn = [("self-attention input [q | k | v | gate]", 2 * H * D + C + (H if dims.gated else 0), C, True),
                     ("self-attention output", C, C, True)]
    elif model == "softmax":
        self_attn = [("self-attention q, k, v", 3 * C, C, True), ("self-attention output", C, C, True)]
    else:
        raise ValueError(f"no step for model {model!r} (rfa or softmax)")
    layer = self_attn + [("cross-attention query", C, C, True), ("cross-attention output", C, C, True),
                         ("FFN input", dims.ffn, C, True), ("FFN output", C, dims.ffn, True)]
    return layer * dims.layers + [("output projection", dims.vocab, C, False)]


def product_bytes(outputs: int, inputs: int, has_bias: bool, precision: str) -> int:
    """The bytes of one product's weights: fp32 4 a weight; int8 1 a weight + a 4-byte scale per output; + biases."""
    if precision == "fp32":
        weights = FP32_BYTES * outputs * inputs
    elif precision == "int8":
        weights = INT8_BYTES * outputs * inputs + SCALE_BYTES * outputs
    else:
        raise ValueError(f"no precision {precision!r} ({' or '.join(PRECISIONS)})")
    return weights + (BIAS_BYTES * outputs if has_bias else 0)


def step_weight_bytes(dims: Dims, model: str, precision: str) -> int:
    """The bytes of weights one decoder step reads at batch 1."""
    return sum(product_bytes(o, i, b, precision) for _, o, i, b in step_products(dims, model))


def output_projection_share(dims: Dims, model: str, precision: str) -> float:
    name, o, i, b = step_products(dims, model)[-1]
    return product_bytes(o, i, b, precision) / step_weight_bytes(dims, model, precision)


def floor_ms(weight_bytes: int, read_gb_s: float) -> float:
    """A step's floor: its weights' bytes over the read bandwidth (GB/s = 1e9 bytes/s), in ms."""
    if read_gb_s <= 0:
        raise ValueError(f"read bandwidth must be positive, got {read_gb_s}")
    return weight_bytes / (read_gb_s * 1e9) * 1e3


def decoder_steps(model: str, forced_length: int) -> int:
    """The decoder steps a sentence forced to L tokens takes: fairseq-generate's searches run L + 1 (the last one's
    end forced), CTranslate2's beam search L (it stops at max_decoding_length, adding no end)."""
    return forced_length if model.startswith("ct2_") else forced_length + 1


def step_ms(tokens_per_s: float, forced_length: int, steps: int) -> float:
    """A step's time from the benchmark's rate: both engines' summaries count L + 1 tokens per sentence (L forced
    tokens and the end), made in `steps` decoder steps, so a step takes 1000 / tokens_per_s x (L + 1) / steps ms."""
    if tokens_per_s <= 0 or steps <= 0:
        raise ValueError(f"tokens/s and steps must be positive, got {tokens_per_s} and {steps}")
    return 1e3 * (forced_length + 1) / (tokens_per_s * steps)


def marginal_step_ms(points) -> float:
    """The time per step without the sentences' fixed costs: points are (forced length L, sentences, seconds) of one
    model at batch 1; the slope between the shortest and the longest L (each sentence runs L + 1 steps), in ms.
    None with fewer than two lengths."""
    by_length = {}
    for length, sentences, seconds in points:
        by_length[int(length)] = (int(sentences), float(seconds))
    if len(by_length) < 2:
        return None
    short, long_ = min(by_length), max(by_length)
    (n_short, t_short), (n_long, t_long) = by_length[short], by_length[long_]
    if n_short != n_long:
        raise ValueError(f"the forced lengths {short} and {long_} decoded {n_short} and {n_long} sentences: "
                         f"not one set")
    return (t_long - t_short) / (n_long * (long_ - short)) * 1e3


READ_ROW = 4096  # floats a row of the matrix-vector read


def read_bandwidth_gb_s(buffer_bytes: int, repeats: int):
    """This process's read bandwidth on one thread over a float32 buffer of about buffer_bytes (written once first,
    so every page is resident), in GB/s (1e9 bytes/s), and the read that gave it: the best of `repeats` passes of each
    of torch.sum, a matrix-vector product (torch.mv: the BLAS's gemv reads the matrix once, as a step's products read
    their weights) and numpy's sum; which one reads fastest differs between machines and levels."""
    import torch

    torch.set_num_threads(1)
    rows = max(1, buffer_bytes // (4 * READ_ROW))
    buffer = torch.ones(rows * READ_ROW, dtype=torch.float32)
    matrix, vector, array = buffer.view(rows, READ_ROW), torch.ones(READ_ROW), buffer.numpy()
    reads = {"torch.sum": buffer.sum, "torch.mv": lambda: torch.mv(matrix, vector), "numpy.sum": array.sum}
    best = {}
    for name, read in reads.items():
        read()  # warm: pages resident, the code loaded
        for _ in range(repeats):
            start = time.perf_counter()
            read()
            best[name] = min(best.get(name, float("inf")), time.perf_counter() - start)
    name = min(best, key=best.get)
    return buffer.numel() * 4 / best[name] / 1e9, name


def last_level_cache_bytes() -> int:
    """The largest CPU cache this machine reports (sysfs), 0 when it reports none."""
    sizes = []
    base = "/sys/devices/system/cpu/cpu0/cache"
    for index in sorted(os.listdir(base)) if os.path.isdir(base) else []:
        try:
            with open(os.path.join(base, index, "size")) as f:
                text = f.read().strip()
        except OSError:
            continue
        unit = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        digits = text[:-1] if text[-1:] in "KMG" else text
        if digits.isdigit():
            sizes.append(int(digits) * unit)
    return max(sizes, default=0)


def measure_bandwidths(cpu_isa: str, sizes_bytes, repeats: int) -> dict:
    """{buffer bytes: (GB/s, the read)} measured in a child process capped at cpu_isa (native: not capped)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    if cpu_isa != "native":
        env = cpu_isa_environment(cpu_isa, env)
    cmd = [sys.executable, os.path.abspath(__file__), "--child", json.dumps([int(s) for s in sizes_bytes]),
           "--repeats", str(repeats)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=CHILD_TIMEOUT_S)
    if proc.returncode != 0:
        raise SystemExit(f"weight_floor: the bandwidth measurement at {cpu_isa} failed:\n{proc.stderr[-2000:]}")
    return {int(k): tuple(v) for k, v in json.loads(proc.stdout.strip().splitlines()[-1]).items()}


def machine() -> str:
    import benchmark_generate

    return benchmark_generate.machine("cpu")


def measured_steps(paths: dict, this_machine: str) -> list:
    """The batch-1, one-thread, forced-length rows of benchmark_generate CSVs ({size: path}) measured on this
    machine, as dicts with size, model, step, precision, cpu_isa, forced_length, sentences, seconds, tokens_per_s."""
    found = []
    for size, path in paths.items():
        if not os.path.exists(path):
            print(f"weight_floor: {path} does not exist: no measured {size} steps", flush=True)
            continue
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
        other = sorted({r.get("machine", "") for r in rows} - {this_machine})
        if other:
            print(f"weight_floor: {path}: rows of other machines left out ({'; '.join(other)})", flush=True)
        for r in rows:
            if (r.get("machine") != this_machine or r.get("model") not in MODEL_STEPS or r.get("batch_size") != "1"
                    or r.get("threads") != "1" or int(r.get("forced_length") or 0) <= 0
                    or (r.get("size") or "recipe") != size):
                continue
            step, precision = MODEL_STEPS[r["model"]]
            length, sentences = int(r["forced_length"]), int(r["sentences"])
            if int(r.get("tokens") or -1) != sentences * (length + 1):
                print(f"weight_floor: {path}: {r['model']} at {length} tokens counted {r.get('tokens')} tokens for "
                      f"{sentences} sentences, not {length + 1} each (the forced length did not hold): left out",
                      flush=True)
                continue
            found.append({"size": size, "model": r["model"], "step": step, "precision": precision,
                          "cpu_isa": r.get("cpu_isa") or "native", "forced_length": int(r["forced_length"]),
                          "sentences": int(r["sentences"]), "seconds": float(r["seconds"]),
                          "tokens_per_s": float(r["tokens_per_s"]), "measured_utc": r.get("measured_utc", "")})
    return found


def floor_rows(sizes, measured, bandwidth, cached_bandwidth, this_machine) -> list:
    """One CSV row per measured step (with its floor), and one floor-only row per size, step and precision that has
    no measurement. bandwidth: {cpu_isa: (GB/s, read)}; cached_bandwidth: {(cpu_isa, bytes): (GB/s, read)}."""
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ")
    rows = []

    def base_row(size, step, precision, cpu_isa):
        weight = step_weight_bytes(SIZE_DIMS[size], step, precision)
        (gb_s, read), (cached, cached_read) = bandwidth[cpu_isa], cached_bandwidth[cpu_isa, weight]
        return {"size": size, "step": step, "precision": precision, "cpu_isa": cpu_isa,
                "weight_mb": f"{weight / 1e6:.2f}",
                "output_projection_share": f"{output_projection_share(SIZE_DIMS[size], step, precision):.3f}",
                "read_gb_s": f"{gb_s:.2f}", "read": read, "floor_ms": f"{floor_ms(weight, gb_s):.4f}",
                "cached_read_gb_s": f"{cached:.2f}", "cached_read": cached_read,
                "cached_floor_ms": f"{floor_ms(weight, cached):.4f}"}

    for size in sizes:
        for step in ("rfa", "softmax"):
            for precision in PRECISIONS:
                mine = [m for m in measured if (m["size"], m["step"], m["precision"]) == (size, step, precision)]
                if not mine:
                    rows.append({**base_row(size, step, precision, "native"), "machine": this_machine,
                                 "measured_utc": now})
                    continue
                for m in sorted(mine, key=lambda m: (m["model"], m["cpu_isa"], m["forced_length"])):
                    row = base_row(size, step, precision, m["cpu_isa"])
                    same = [(o["forced_length"], o["sentences"], o["seconds"]) for o in mine
                            if (o["model"], o["cpu_isa"]) == (m["model"], m["cpu_isa"])]
                    step_time = step_ms(m["tokens_per_s"], m["forced_length"],
                                        decoder_steps(m["model"], m["forced_length"]))
                    marginal = marginal_step_ms(same)
                    row.update({"model": m["model"], "forced_length": m["forced_length"], "sentences": m["sentences"],
                                "steps_per_sentence": decoder_steps(m["model"], m["forced_length"]),
                                "step_ms": f"{step_time:.4f}",
                                "step_vs_floor": f"{step_time / float(row['floor_ms']):.3f}",
                                "step_vs_cached_floor": f"{step_time / float(row['cached_floor_ms']):.3f}"})
                    if marginal is not None:
                        row["marginal_step_ms"] = f"{marginal:.4f}"
                        row["marginal_vs_floor"] = f"{marginal / float(row['floor_ms']):.3f}"
                    row.update({"machine": this_machine, "step_measured_utc": m["measured_utc"], "measured_utc": now})
                    rows.append(row)
    return rows


def parse_generate_csvs(items, parser) -> dict:
    paths = {}
    for item in items:
        size, sep, path = item.partition("=")
        if not sep or size not in SIZE_DIMS or not path:
            parser.error(f"--generate-csv {item!r}: expected SIZE=PATH with SIZE one of {', '.join(SIZE_DIMS)}")
        paths[size] = path
    return paths


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", nargs="+", default=list(SIZE_DIMS), choices=list(SIZE_DIMS))
    p.add_argument("--generate-csv", action="append", default=[], metavar="SIZE=PATH",
                   help="benchmark_generate.py's CSV of a size (default: benchmarks/results/"
                        "generate_user_<size>_cpu.csv for base and big; the recipe model's steps only where given)")
    p.add_argument("--cpu-isa", nargs="+", default=None,
                   help="levels to measure the bandwidth at (default: those of the measured rows, and native)")
    p.add_argument("--buffer-mb", type=float, default=0,
                   help="the memory read's buffer (default: 4x the last-level cache, 1 GiB at the least)")
    p.add_argument("--repeats", type=int, default=DEFAULT_REPEATS, help="reads per buffer; the fastest counts")
    p.add_argument("--csv", default=os.path.join(RESULTS, "weight_floor_cpu.csv"))
    p.add_argument("--child", help=argparse.SUPPRESS)  # JSON list of buffer sizes: measure them here
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error(f"--repeats must be at least 1, got {args.repeats}")
    if args.buffer_mb < 0:
        p.error(f"--buffer-mb must be positive (or 0: the default), got {args.buffer_mb}")
    if args.child:
        sizes = json.loads(args.child)
        print(json.dumps({str(s): list(read_bandwidth_gb_s(s, args.repeats)) for s in sizes}))
        return 0
    paths = {size: os.path.join(RESULTS, f"generate_user_{size}_cpu.csv") for size in ("base", "big")}
    paths.update(parse_generate_csvs(args.generate_csv, p))
    paths = {size: path for size, path in paths.items() if size in args.sizes}
    this_machine = machine()
    measured = measured_steps(paths, this_machine)
    from benchmark_common import ISA_CAPS

    levels = args.cpu_isa or sorted({m["cpu_isa"] for m in measured} | {"native"})
    unknown = [level for level in levels if level != "native" and level not in ISA_CAPS]
    if unknown:
        p.error(f"--cpu-isa {' '.join(unknown)}: not a level (native or one of {', '.join(ISA_CAPS)})")
    measured = [m for m in measured if m["cpu_isa"] in levels]
    buffer_bytes = int(args.buffer_mb * 2**20) or max(MIN_BUFFER_BYTES, 4 * last_level_cache_bytes())
    weights = sorted({step_weight_bytes(SIZE_DIMS[s], step, precision) for s in args.sizes
                      for step in ("rfa", "softmax") for precision in PRECISIONS})
    bandwidth, cached = {}, {}
    for level in levels:
        read = measure_bandwidths(level, [buffer_bytes, *weights], args.repeats)
        bandwidth[level] = read[buffer_bytes]
        cached.update({(level, w): read[w] for w in weights})
        print(f"weight_floor: {level}: one core reads {bandwidth[level][0]:.2f} GB/s ({bandwidth[level][1]}) from a "
              f"{buffer_bytes / 2**20:,.0f} MiB buffer; "
              + ", ".join(f"{read[w][0]:.1f} GB/s from {w / 1e6:.1f} MB" for w in weights), flush=True)
    rows = floor_rows(args.sizes, measured, bandwidth, cached, this_machine)
    fields = ["size", "step", "precision", "model", "cpu_isa", "forced_length", "sentences", "steps_per_sentence",
              "weight_mb",
              "output_projection_share", "read_gb_s", "read", "floor_ms", "cached_read_gb_s", "cached_read",
              "cached_floor_ms", "step_ms",
              "step_vs_floor", "step_vs_cached_floor", "marginal_step_ms", "marginal_vs_floor", "machine",
              "step_measured_utc", "measured_utc"]
    write_csv(args.csv, [{f: r.get(f, "") for f in fields} for r in rows])
    for r in rows:
        measured_text = (f"step {float(r['step_ms']):7.3f} ms = {r['step_vs_floor']}x floor"
                         + (f", marginal {float(r['marginal_step_ms']):.3f} ms = {r['marginal_vs_floor']}x"
                            if r.get("marginal_step_ms") else "")) if r.get("step_ms") else "not measured"
        print(f"{r['size']:>6} {r['step']:>7} {r['precision']} {r['cpu_isa']:>11} {r.get('model', ''):>16} "
              f"L={r.get('forced_length', '') or '-':<3} weights {float(r['weight_mb']):8.2f} MB  "
              f"floor {float(r['floor_ms']):7.3f} ms (cached {float(r['cached_floor_ms']):.3f})  {measured_text}")
    print(f"weight_floor: wrote {args.csv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
