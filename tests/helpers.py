"""Build small rfa_transformer models the way fairseq-train does (same parser, same registry)."""
import os
import types

import torch
from fairseq import options
from fairseq.data import Dictionary
from fairseq.models import ARCH_MODEL_REGISTRY

from conftest import PLUGIN_DIR
from tiny_models import tiny_model_flags

TINY_ARGS = [
    *tiny_model_flags(embed_dim=32, ffn_dim=64, heads=4, encoder_layers=2, decoder_layers=2, share_all_embeddings=False),
    "--dropout", "0.0", "--max-target-positions", "1024", "--max-source-positions", "1024",
]


# the causal state kept in fp32 between steps (the native step keeps it in fp16 by default): the step's results equal
# the full forward's to fp32 rounding, and the torch step's
FP32_STATE = ["--rfa-decode-state", "fp32"]

# the paper's setup (the default before docs/quality.md): sincos random features, ungated, RFA cross-attention
PAPER_RFA = ["--rfa-feature-map", "sincos", "--no-rfa-gate", "--no-rfa-softmax-cross-attn"]


def make_dictionary(num_words: int = 40) -> Dictionary:
    d = Dictionary()
    for i in range(num_words):
        d.add_symbol(f"w{i}")
    return d


def parse_args(extra=(), arch="rfa_transformer", seed=1):
    parser = options.get_training_parser()
    argv = ["/nonexistent-data", "--user-dir", PLUGIN_DIR, "--arch", arch, "--seed", str(seed), *TINY_ARGS, *extra]
    return options.parse_args_and_arch(parser, argv)


def build_model_from_args(args, dictionary=None, seed=None):
    """args: a Namespace (fairseq-train) or a DictConfig without seed (fairseq-hydra-train: pass seed)."""
    dictionary = dictionary or make_dictionary()
    task = types.SimpleNamespace(source_dictionary=dictionary, target_dictionary=dictionary)
    torch.manual_seed(args.seed if seed is None else seed)  # as fairseq seeds torch before building the model
    return ARCH_MODEL_REGISTRY[args.arch].build_model(args, task), dictionary


def build_model(extra=(), arch="rfa_transformer", seed=1, dictionary=None):
    """A tiny model built exactly like fairseq-train builds it; parameters seeded by `seed`."""
    return build_model_from_args(parse_args(extra, arch, seed), dictionary)


def random_batch(dictionary, bsz=3, src_len=9, tgt_len=7, seed=0):
    """Left-padded sources of varying length (as fairseq batches them) and decoder inputs."""
    g = torch.Generator().manual_seed(seed)
    nspecial = dictionary.nspecial
    src = torch.randint(nspecial, len(dictionary), (bsz, src_len), generator=g)
    lengths = torch.tensor([src_len - (i % 3) for i in range(bsz)])
    for i, length in enumerate(lengths):
        src[i, : src_len - length] = dictionary.pad()
        src[i, -1] = dictionary.eos()
    prev = torch.randint(nspecial, len(dictionary), (bsz, tgt_len), generator=g)
    prev[:, 0] = dictionary.eos()
    return src, lengths, prev


def plugin_env():
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def cpp_extension():
    """The C++ module, for a test that needs it: skipped with the reason only where no C++ toolchain exists (the
    tools missing named); failed, with the build's own error, where one exists and the module did not build."""
    import shutil

    import pytest

    from rfa_fairseq.cpu import extension

    module, why_not = extension._loaded_once()
    if module is not None:
        return module
    missing = [tool for tool in ("c++", "ninja") if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"the C++ decoding step cannot be built here: {', '.join(missing)} not on PATH ({why_not})")
    pytest.fail(f"a C++ toolchain is present but the C++ decoding step is not available: {why_not}")


def use_decoding_step(path: str, monkeypatch) -> None:
    """Select the decoding step's kernels for a test: "fused" (the C++ kernels; cpp_extension's skip or failure
    where they cannot be had) or "torch"."""
    from rfa_fairseq import kernel_choice

    if path == "torch":
        monkeypatch.setattr(kernel_choice, "load_fused_extension", lambda: None)
        return
    cpp_extension()


def cpu_level_params(prefix: str = ""):
    """pytest parameters, one per instruction-set level of this machine's architecture (csrc/cpu_kernels.h), named
    prefix + level: the levels this CPU runs, and the others skipped with the reason (a CPU with more runs them). Only
    "auto" where the C++ module does not load (the test's cpp_extension() then skips or fails, saying why)."""
    import pytest

    from rfa_fairseq.cpu import extension

    module, _ = extension._loaded_once()
    if module is None:
        return [pytest.param(f"{prefix}auto", id=f"{prefix}auto")]
    runnable = set(module.runnable_cpu_levels())
    return [pytest.param(f"{prefix}{level}", id=f"{prefix}{level}", marks=() if level in runnable else
                         pytest.mark.skip(reason=f"this CPU does not run the {level} level (a CPU that has it tests it)"))
            for level in module.cpu_levels()]


class CppKernels:
    """The C++ module's kernels with the torch kernels' interface (ops/step.py's TorchKernels), for testing one
    kernel against the other and the references, on one instruction-set level (`level`, "auto": the CPU's best): the
    native program runs them inside one call, where no test can reach them one by one."""

    name = "cpp"

    def __init__(self, ext, level: str = "auto"):
        self.ext = ext
        self.level = level

    def causal_layer_step(self, phi_q, phi_k, v, gate_logits, key_pad, state_in, order, state_out, eps,
                          activation=None, sigma=None, matrix=None):
        R, H, d = v.size(0), state_out.size(1), state_out.size(3) - 1
        out = torch.empty(R, H * d)
        self.ext.causal_layer_step(phi_q, phi_k, v, gate_logits, key_pad, state_in, order, state_out, out, eps,
                                   activation or "features", sigma, matrix, self.level)
        return out

    def softmax_cross_step(self, q, key, value, key_bias, beam, scaling, need_weights=False):
        out = torch.empty(q.size(0), key.size(1) * key.size(3))
        weights = torch.empty(q.size(0), key.size(2)) if need_weights else None
        self.ext.softmax_cross_step(q, key, value, key_bias, beam, scaling, out, weights, self.level)
        return out, weights

    def add_layer_norm(self, x, residual, weight, bias, eps, out=None):
        out = torch.empty_like(x) if out is None else out
        self.ext.add_layer_norm(x, residual, weight, bias, eps, out, self.level)
        return out

    def beam_candidates(self, lprobs, prev_scores, beam, scores_out, indices_out):
        self.ext.beam_candidates(lprobs, prev_scores, beam, scores_out, indices_out, self.level)


def resident_pages(tensor):
    """(how many of the pages under `tensor` this process has in memory (/proc/self/pagemap's present bit: what its
    resident set counts), how many there are)."""
    page = os.sysconf("SC_PAGESIZE")
    first = tensor.data_ptr() // page
    count = (tensor.data_ptr() + tensor.numel() * tensor.element_size() + page - 1) // page - first
    with open("/proc/self/pagemap", "rb") as pagemap:
        pagemap.seek(first * 8)
        entries = memoryview(pagemap.read(count * 8)).cast("Q")
    return sum(entry >> 63 for entry in entries), count


def decode_incrementally(model, encoder_out, prev, incremental_state, start=0):
    """The decoder's logits of steps start .. prev's length, one token a call through incremental_state."""
    outs = []
    for t in range(start, prev.size(1)):
        logits, _ = model.decoder(prev[:, : t + 1], encoder_out=encoder_out, incremental_state=incremental_state)
        outs.append(logits)
    return torch.cat(outs, dim=1)
