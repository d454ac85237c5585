"""Shared pieces of the benchmarks: model building, memory readings, table/CSV/plot output."""
import csv
import functools
import json
import os
import re
import resource
import subprocess
import sys
import time
import types

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLUGIN_DIR = os.path.join(REPO, "rfa_fairseq")
if REPO not in sys.path:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, REPO)

# the longest one benchmark point (one worker process) may run: generous (a long CPU point takes
# minutes); a hung worker is killed and reported instead of stalling the whole benchmark
WORKER_TIMEOUT_S = 3600
GPU_QUERY_TIMEOUT_S = 300  # reading the GPU's name starts CUDA in a child process

# model sizes: (layers, embed dim, ffn dim, heads)
DIMS = {
    "small": (3, 256, 1024, 4),
    "base": (6, 512, 2048, 8),  # transformer_wmt_en_de
    "big": (6, 1024, 4096, 16),  # transformer_wmt_en_de_big
}

# name -> (fairseq arch, extra flags)
MODELS = {
    "softmax": ("transformer", []),
    "rfa": ("rfa_transformer", []),  # the default: hedgehog map, gate, softmax cross-attention
    "rfa_gated": ("rfa_transformer", ["--rfa-gate"]),
    "rfa_torch": ("rfa_transformer", ["--rfa-decode-kernel", "torch"]),  # the default with the torch step kernels
    "rfa_eager": ("rfa_transformer", ["--no-rfa-cuda-graphs"]),  # the default, its step not captured as CUDA graphs
    # the default decoded by the static beam search (fairseq-generate's generator for it) instead of fairseq's
    # SequenceGenerator: on CUDA its whole step one graph; _eager: not captured (STATIC_SEARCH_MODELS)
    "rfa_static": ("rfa_transformer", []),
    "rfa_static_eager": ("rfa_transformer", []),
    "rfa_static_int8": ("rfa_transformer", ["--rfa-decode-precision", "int8"]),  # the CPU's int8 linear layers
    # the default map at a fixed number of features D (the speed/quality knob), whatever the default D is
    "rfa_d16": ("rfa_transformer", ["--rfa-num-features", "16"]),
    "rfa_d32": ("rfa_transformer", ["--rfa-num-features", "32"]),
    "rfa_d64": ("rfa_transformer", ["--rfa-num-features", "64"]),
    "rfa_rfa_cross": ("rfa_transformer", ["--no-rfa-softmax-cross-attn"]),  # constant state in the cross-attention too
    "rfa_paper": ("rfa_transformer", ["--rfa-feature-map", "sincos", "--no-rfa-gate", "--no-rfa-softmax-cross-attn"]),
    "rfa_paper_gated": ("rfa_transformer", ["--rfa-feature-map", "sincos", "--rfa-gate", "--no-rfa-softmax-cross-attn"]),
    "floor": ("transformer", []),  # attention replaced by NoAttention below
    "floor_proj": ("transformer", []),  # attention replaced by ProjectionsOnly below
}

# models decoded by rfa_fairseq's StaticBeamSearchGenerator -> whether its steps are captured as CUDA graphs
STATIC_SEARCH_MODELS = {"rfa_static": True, "rfa_static_eager": False, "rfa_static_int8": True}
DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}  # --dtype of the decoding benchmarks


def detokenized_hypotheses(generate_output: str) -> dict:
    """{sentence id: hypothesis} from fairseq-generate's output: its D- lines (detokenized, --post-process)."""
    hyps = {}
    for line in generate_output.splitlines():
        if line.startswith("D-"):
            key, _, hyp = line.split("\t", 2)
            hyps[int(key[2:])] = hyp
    return hyps


def make_dictionary(vocab: int):
    from fairseq.data import Dictionary

    d = Dictionary()
    for i in range(vocab - d.nspecial):
        d.add_symbol(f"w{i}")
    return d


def build_model(name: str, dims: str, dictionary, max_positions: int, device: str, extra=(), dtype: str = "fp32"):
    """Random-weight model of the given size (weights in `dtype`), built through fairseq's own parser and registry."""
    from fairseq import options
    from fairseq.models import ARCH_MODEL_REGISTRY

    arch, model_flags = MODELS[name]
    layers, embed, ffn, heads = DIMS[dims]
    argv = [
        "/unused", "--user-dir", PLUGIN_DIR, "--arch", arch, "--share-all-embeddings",
        "--encoder-layers", str(layers), "--decoder-layers", str(layers),
        "--encoder-embed-dim", str(embed), "--decoder-embed-dim", str(embed),
        "--encoder-ffn-embed-dim", str(ffn), "--decoder-ffn-embed-dim", str(ffn),
        "--encoder-attention-heads", str(heads), "--decoder-attention-heads", str(heads),
        "--max-source-positions", str(max_positions), "--max-target-positions", str(max_positions),
        *model_flags,
        *(extra if arch == "rfa_transformer" else ()),
    ]
    args = options.parse_args_and_arch(options.get_training_parser(), argv)
    task = types.SimpleNamespace(source_dictionary=dictionary, target_dictionary=dictionary)
    torch.manual_seed(0)
    model = ARCH_MODEL_REGISTRY[args.arch].build_model(args, task)
    if name in ("floor", "floor_proj"):
        stand_in = NoAttention if name == "floor" else ProjectionsOnly
        for layer in model.decoder.layers:
            layer.self_attn = stand_in(layer.self_attn)
            layer.encoder_attn = stand_in(layer.encoder_attn)
    model.build_args = args  # the parsed fairseq args (the CTranslate2 conversion saves them)
    return model.to(device=device, dtype=getattr(torch, DTYPES[dtype])).eval()


class NoAttention(torch.nn.Module):
    """Attention skipped (zeros out, no state): the decoder's 'attention-free floor'."""

    def __init__(self, attn):
        super().__init__()
        self.num_heads, self.head_dim = attn.num_heads, attn.head_dim

    def forward(self, query, key, value, **kwargs):
        return torch.zeros_like(query), None

    def _get_input_buffer(self, incremental_state):
        return {}


class ProjectionsOnly(NoAttention):
    """Attention's linear projections without attention: the per-step matmuls any attention
    needs (self: q, k, v and out; cross: q and out, k and v being computed once per source
    and ignored here), output out_proj(v) or out_proj(q), no state. A floor that includes
    the projections RFA and softmax both need."""

    def __init__(self, attn):
        super().__init__(attn)
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = attn.q_proj, attn.k_proj, attn.v_proj, attn.out_proj
        self.cross = bool(getattr(attn, "encoder_decoder_attention", False))

    def forward(self, query, key, value, **kwargs):
        q = self.q_proj(query)
        if self.cross:
            return self.out_proj(q), None
        self.k_proj(query)
        return self.out_proj(self.v_proj(query)), None


def peak_memory_mb(device: str) -> float:
    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def tensor_bytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if hasattr(obj, "attention_tensors"):  # RFA's IncrementalDecoder: causal states and cross K/V
        return tensor_bytes(obj.attention_tensors())
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


@functools.lru_cache(maxsize=None)
def gpu_name() -> str:
    """The CUDA device's name, read in a child process: the caller keeps no CUDA context, whose
    memory would otherwise be missing from what the benchmark workers can allocate."""
    code = "import torch; p = torch.cuda.get_device_properties(0); print(p.name, '|', p.total_memory)"
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=GPU_QUERY_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        print(f"# reading the GPU's name took more than {GPU_QUERY_TIMEOUT_S} s (killed): 'unknown GPU'", flush=True)
        return "unknown GPU"
    return proc.stdout.split("|")[0].strip() if proc.returncode == 0 else "unknown GPU"


def device_tag(device: str) -> str:
    """File-name tag: "cpu", or "cuda_" + the GPU model ("NVIDIA H100 80GB HBM3" -> "cuda_h100")."""
    if not device.startswith("cuda"):
        return device
    model = next((w for w in re.findall(r"[A-Za-z]*\d+[A-Za-z]*", gpu_name()) if not w.upper().endswith("GB")), "gpu")
    return f"cuda_{model.lower()}"


def machine_description(device: str) -> str:
    if device.startswith("cuda"):
        return f"{gpu_name()}, torch {torch.__version__}"
    cpu = "cpu"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {torch.get_num_threads()} threads, torch {torch.__version__}"


def run_worker(cmd, timeout_s: float = WORKER_TIMEOUT_S) -> dict:
    """Run one benchmark point in a fresh process; it prints `RESULT {json}` on success. A RuntimeError
    when it fails or runs longer than timeout_s (then it is killed)."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"benchmark worker did not finish within {timeout_s:g} s (killed): {' '.join(cmd)}") from None
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        tail = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit code {proc.returncode}"
        raise RuntimeError(f"benchmark worker failed: {' '.join(cmd)}: {tail}")
    return json.loads(lines[-1][len("RESULT "):])


def stream_worker(cmd, deadline: float, on_result) -> str:
    """Run a worker that prints `RESULT {json}` lines as it goes, calling on_result(dict) for each
    as it arrives (and echoing its "# " notes). At `deadline` (a time.time()) the worker is killed,
    keeping what it printed. Returns "ok", "timeout" or "failed: <last stderr line>"."""
    import selectors
    import threading

    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stderr_lines = []
    reader = threading.Thread(target=lambda: stderr_lines.extend(proc.stderr), daemon=True)
    reader.start()
    selector = selectors.DefaultSelector()
    selector.register(proc.stdout, selectors.EVENT_READ)
    status = None
    while status is None:
        left = deadline - time.time()
        if left <= 0:
            proc.kill()
            status = "timeout"
        elif selector.select(timeout=min(left, 5.0)):
            line = proc.stdout.readline()
            if line.startswith("RESULT "):
                on_result(json.loads(line[len("RESULT "):]))
            elif line.startswith("# "):  # the worker's own notes
                print(line.rstrip(), flush=True)
            elif not line:  # end of output: the worker exited
                status = "ok" if proc.wait() == 0 else "failed"
    proc.wait()
    reader.join(timeout=5)
    if status == "failed":
        tail = [line.strip() for line in stderr_lines if line.strip()]
        status = f"failed: {tail[-1] if tail else f'exit code {proc.returncode}'}"
    return status


# A CPU of an instruction-set level, on a CPU that has more: the environment that caps every library a decoding
# process runs (set before it starts: each reads its own once). The plugin's own kernels take --rfa-cpu-isa (the
# callers pass it in the model's overrides), oneDNN ONEDNN_MAX_CPU_ISA (torch's own oneDNN products; the levels'
# table names oneDNN's ISA, cpu/levels.py), torch's operators
# ATEN_CPU_CAPABILITY, MKL (fairseq's softmax model's GEMMs) MKL_ENABLE_INSTRUCTIONS, CTranslate2 CT2_FORCE_CPU_ISA.
ISA_CAPS = {
    "default": {"ATEN_CPU_CAPABILITY": "default", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2", "CT2_FORCE_CPU_ISA": "GENERIC"},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "CT2_FORCE_CPU_ISA": "AVX2"},
    "avx512": {"ATEN_CPU_CAPABILITY": "avx512", "MKL_ENABLE_INSTRUCTIONS": "AVX512", "CT2_FORCE_CPU_ISA": "AVX512"},
    "avx512_vnni": {"ATEN_CPU_CAPABILITY": "avx512", "MKL_ENABLE_INSTRUCTIONS": "AVX512_E1",
                    "CT2_FORCE_CPU_ISA": "AVX512"},
    "neon": {"ATEN_CPU_CAPABILITY": "default", "CT2_FORCE_CPU_ISA": "NEON"},
    "neon_dotprod": {"CT2_FORCE_CPU_ISA": "NEON"},
}


def length_flags(forced_length: int) -> list:
    """fairseq-generate's length flags: source + 50 tokens at most (beam search's natural lengths), or every
    hypothesis exactly forced_length tokens (then EOS)."""
    if forced_length > 0:
        return ["--min-len", str(forced_length), "--max-len-a", "0", "--max-len-b", str(forced_length)]
    return ["--max-len-a", "1", "--max-len-b", "50"]


def cpu_isa_environment(level: str, env: dict) -> dict:
    """`env` with every library of a decoding process capped at `level` (ISA_CAPS; oneDNN's name from cpu/levels.py)."""
    from rfa_fairseq.cpu import levels

    if level not in ISA_CAPS:
        raise ValueError(f"no instruction-set level named {level!r} (one of {', '.join(ISA_CAPS)})")
    capped = dict(env, **ISA_CAPS[level])
    if levels.onednn_isa(level) is not None:
        capped["ONEDNN_MAX_CPU_ISA"] = levels.onednn_isa(level)
    return capped


def pyplot():
    """matplotlib.pyplot drawing to files, or None (a note printed) when matplotlib is not installed."""
    try:
        import logging

        logging.getLogger("matplotlib").setLevel(logging.WARNING)  # before the import, which logs too: fairseq's setup prints debug lines
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no PNG (pip install -e .[bench])", flush=True)
        return None
    return plt


def write_csv(path: str, rows) -> None:
    tmp = path + ".tmp"
    fields = list(dict.fromkeys(key for row in rows for key in row))  # every column, in first-seen order
    with open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, restval="")
        writer.writeheader()
        writer.writerows(rows)
    os.replace(tmp, path)


def print_table(rows, columns) -> None:
    widths = {c: max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns}
    print("  ".join(c.rjust(widths[c]) for c in columns))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).rjust(widths[c]) for c in columns))
    sys.stdout.flush()


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"
    return "" if value is None else str(value)
