"""RFA options: one dataclass gives the `--rfa-*` flags, their help and defaults. build_model makes one
RFAConfig of a model's options and hands it whole to the attention modules and feature maps.

Every field is marked with what it is for (metadata "role"):
  weights   the checkpoint's weights depend on it: changing one when loading a checkpoint (for example with
            fairseq-generate --model-overrides) either fails on parameter shapes or silently computes
            something the weights were not trained for (check_rfa_overrides refuses that);
  training  only matters in training (evaluation uses the saved eval_random_matrix and the loaded sigma);
  decoding  only matters in incremental decoding.
and "speed_only" when results do not depend on it (kernels, chunks): fine-tuning keeps the command line's.
"""
import argparse
import os
from dataclasses import dataclass, field, fields
from typing import Optional

from fairseq.dataclass import ChoiceEnum, FairseqDataclass
from fairseq.dataclass.utils import gen_parser_from_dataclass

from .kernel_choice import CPU_ISAS, DECODE_KERNELS, DECODE_PRECISIONS, DECODE_STATES, SEQUENCE_KERNELS
from .ops import FEATURE_MAPS, LEARNED_FEATURE_MAPS, RANDOM_MATRIX_KINDS

SIGMA_MODES = ("learned", "fixed", "log")


def _meta(role: str, help: str, speed_only: bool = False) -> dict:
    return {"help": help, "role": role, "speed_only": speed_only}


@dataclass
class RFAConfig(FairseqDataclass):
    rfa_feature_map: ChoiceEnum(FEATURE_MAPS) = field(
        default="hedgehog",
        metadata=_meta("weights", "random feature map: sincos = Gaussian random Fourier features (paper Eq. 2), "
            "arccos = paper's phi_arccos (degree-1 arc-cosine kernel), positive = Performer FAVOR+ "
            "positive random features; learned deterministic maps (no random matrix, phi >= 0): hedgehog = "
            "[softmax(Wx+b), softmax(-(Wx+b))] (2D features), relu = T2R's relu(Wx+b) (D features), elu = elu(x)+1 "
            "(head_dim features) (default: hedgehog, the best of docs/quality.md; the paper's map is sincos)"),
    )
    rfa_num_features: int = field(
        default=32,
        metadata=_meta("weights", "number D of random (or learned) vectors per head (sincos and hedgehog give 2D features); "
            "the decode state per head is 2D x (head_dim + 1) floats. 32 is the fastest D that kept the default "
            "map within 0.5 BLEU of softmax on Multi30k EN-DE at 4,000 and EN-FR at 2,000 updates (docs/quality.md); "
            "the paper's MT setup uses 64 (default: 32)"),
    )
    rfa_random_matrix: ChoiceEnum(RANDOM_MATRIX_KINDS) = field(
        default="orthogonal",
        metadata=_meta("training", "random projections: gaussian = i.i.d. N(0, I) rows; orthogonal = orthogonal blocks "
            "with chi-distributed row norms (lower-variance estimate) (default: orthogonal)"),
    )
    rfa_fixed_random_matrix: bool = field(
        default=False,
        metadata=_meta("training", "train with the fixed evaluation matrices instead of redrawing them at every update (ablation)"),
    )
    rfa_sigma: ChoiceEnum(SIGMA_MODES) = field(
        default="learned",
        metadata=_meta("weights", "sigma scaling the random projections, per head and dimension: learned (paper's "
            "learned variance), log (learned as exp(m * theta): --rfa-sigma-lr-multiplier m speeds up its "
            "learning) or fixed at its initial value (default: learned)"),
    )
    rfa_sigma_lr_multiplier: float = field(  # a weight's meaning: the checkpoint stores theta, not sigma
        default=10.0,
        metadata=_meta("weights", "with --rfa-sigma log: m in sigma = exp(m * theta), a learning-rate multiplier for log sigma (default: 10)"),
    )
    rfa_temperature: float = field(
        default=1.0,
        metadata=_meta("training", "tau: sigma starts at tau^-1/2, so RFA starts as softmax(q.k / tau) over the "
            "l2-normalized q and k (arccos ignores a uniform sigma) (default: 1.0)"),
    )
    rfa_gate: bool = field(
        default=True,
        metadata=_meta("weights", "gated RFA in the decoder self-attention (paper Eq. 7): g_t = sigmoid(w_g.x_t + b_g) "
            "per head, S_t = g_t S_t-1 + (1 - g_t) phi(k_t) v_t^T, same for z; --no-rfa-gate: ungated "
            "(default: gated)"),
    )
    rfa_chunk_size: int = field(
        default=64,
        metadata=_meta("training", "chunk size of the causal training pass; memory is O(L) for any value (default: 64)", speed_only=True),
    )
    rfa_decode_kernel: ChoiceEnum(DECODE_KERNELS) = field(
        default="auto",
        metadata=_meta("decoding", "the incremental decoding step: auto = the native step on CPU in fp32 (the whole step one "
            "C++ call; built once, cached), on CUDA the torch step with each causal layer's update one Triton kernel, "
            "the torch step otherwise (bf16/fp16 on the CPU); torch = always the torch step (no C++ build, no Triton); cpp = the native step, an error where it cannot run (not CPU fp32) or cannot be built. "
            "Same results with --rfa-decode-state fp32 (the native step's default fp16 state moves a few last bits), "
            "other speeds (default: auto)", speed_only=True),
    )
    rfa_decode_precision: ChoiceEnum(DECODE_PRECISIONS) = field(
        default="fp32",
        metadata=_meta("decoding", "the linear layers of the CPU decoding step (and the encoder's inference): fp32, or "
            "int8 = the runtime's int8 product on weights quantized once per output channel and activations "
            "quantized at each step (7-bit, one scale per row): faster, its BLEU within docs/benchmarks.md's measured "
            "margin of fp32's; the CPU in fp32 weights with the native step only (default: fp32)", speed_only=True),
    )
    rfa_decode_state: ChoiceEnum(DECODE_STATES) = field(
        default="auto",
        metadata=_meta("decoding", "the causal layers' state between decoding steps: fp16 = stored rounded to fp16, "
            "each step's arithmetic in fp32 (half the bytes a step reads and writes; on the recipe model 999 of "
            "1,000 test hypotheses fp32's), the native step only; fp32 = kept in fp32 (the native step's results "
            "then the torch step's to the bit); auto = fp16 where the native step runs, fp32 elsewhere "
            "(default: auto)", speed_only=True),
    )
    rfa_cpu_isa: ChoiceEnum(CPU_ISAS) = field(
        default="auto",
        metadata=_meta("decoding", "the highest instruction-set level the CPU decoding step's own kernels use "
            "(x86-64: default < avx2 < avx512 < avx512_vnni; aarch64: neon < neon_dotprod): auto = the best this CPU "
            "runs; a level names a cap (a CPU without it runs its best level below), and oneDNN's products are capped "
            "to match when the process has not run them yet (ONEDNN_MAX_CPU_ISA). For testing and measuring a level on "
            "a CPU that has more; fp32 hypotheses of one level may differ from another's in a few last bits "
            "(default: auto)", speed_only=True),
    )
    rfa_cuda_graphs: bool = field(
        default=True,
        metadata=_meta("decoding", "on a GPU, capture the incremental decoding step as CUDA graphs and replay them (one "
            "launch per step); --no-rfa-cuda-graphs runs every step uncaptured (same results, slower: for "
            "comparisons and debugging) (default: on)", speed_only=True),
    )
    rfa_decode_parts: int = field(
        default=0,
        metadata=_meta("decoding", "on the CPU, the static beam search decodes this many parts at once, one thread "
            "each (CTranslate2's inter_threads): fairseq-generate, fairseq-interactive and hub.translate hand it this "
            "many of their batches at once, and a batch on its own is split into this many parts; 1 = one batch at a "
            "time on every thread (intra-op threads); 0 = auto: one part per thread (torch's thread count, e.g. "
            "OMP_NUM_THREADS), a batch on its own split only while each part keeps at least 32 sentences. Same "
            "hypotheses, other speeds (default: 0)", speed_only=True),
    )
    # changes hypotheses a little (like int8): marked speed_only all the same, so that fine-tuning a checkpoint decoded
    # with a shortlist does not carry the decoding option into its training command
    rfa_shortlist: str = field(
        default="",
        metadata=_meta("decoding", "a vocabulary shortlist (rfa-build-shortlist's DATA/shortlist.SRC-TGT.npz, built for "
            "the model's dictionaries): each batch's output projection and log-softmax run over the union of its "
            "sentences' candidate target tokens (each source token's K candidates, the N most frequent targets, the "
            "special tokens, any prefix or constraint token), normalized over that union as Marian's lexical shortlist "
            "does; hypotheses are in the full vocabulary's ids. Read once per model. Empty: the full vocabulary "
            "(default: empty)", speed_only=True),
    )
    rfa_shortlist_k: Optional[int] = field(
        default=None,
        metadata=_meta("decoding", "with --rfa-shortlist: the first K candidates per source token, at most the file's K "
            "(default: the file's)", speed_only=True),
    )
    rfa_shortlist_n: Optional[int] = field(
        default=None,
        metadata=_meta("decoding", "with --rfa-shortlist: the N most frequent target tokens always in, at most the "
            "file's N; 0: none (default: the file's)", speed_only=True),
    )
    rfa_static_beam_search: bool = field(
        default=True,
        metadata=_meta("decoding", "fairseq-generate / fairseq-interactive decode a single rfa_transformer with the plugin's "
            "beam search over fixed-shape buffers (fairseq's hypotheses and scores; on a GPU its whole step one CUDA "
            "graph) where it serves the generation options; --no-rfa-static-beam-search: fairseq's SequenceGenerator "
            "(default: on)", speed_only=True),
    )
    rfa_sequence_kernel: ChoiceEnum(SEQUENCE_KERNELS) = field(
        default="auto",
        metadata=_meta("training", "causal RFA over whole sequences (training, scoring): auto = the Triton kernels on CUDA (Triton "
            "ships with torch's CUDA builds), the chunked torch path otherwise; torch = always the torch path. Same results, other speeds "
            "(default: auto)", speed_only=True),
    )
    rfa_triton_self_check: bool = field(
        default=True,
        metadata=_meta("training", "before a Triton kernel of the CUDA path (causal RFA over sequences, forward and "
            "backward; the decoding step's causal layer) first runs on a device and variant in a process, check it once "
            "against the torch path on a small input (milliseconds; logged); a kernel that disagrees is not used: one "
            "warning, and the torch path runs that variant for the rest of the process. --no-rfa-triton-self-check "
            "trusts the kernels unchecked (benchmarks on a GPU checked before) (default: on)", speed_only=True),
    )
    rfa_encoder_self_attn: bool = field(
        default=False,
        metadata=_meta("weights", "use RFA in the encoder self-attention too (softmax by default, as in the paper's MT setup)"),
    )
    rfa_softmax_cross_attn: bool = field(
        default=True,
        metadata=_meta("weights", "softmax encoder-decoder attention: its cache is the source's keys and values, fixed while "
            "the output grows, so decoding stays constant-cost in the output length; --no-rfa-softmax-cross-attn: "
            "RFA cross-attention as in the paper (a per-sentence state) (default: softmax)"),
    )


    @classmethod
    def from_args(cls, args) -> "RFAConfig":
        """The rfa_* options of a model's args (after apply_rfa_defaults)."""
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if f.name in RFA_ROLES})


RFA_DEFAULTS = {f.name: f.default for f in fields(RFAConfig)}
RFA_ROLES = {f.name: f.metadata["role"] for f in fields(RFAConfig) if "role" in f.metadata}
WEIGHT_DEFINING_RFA_OPTIONS = tuple(name for name, role in RFA_ROLES.items() if role == "weights")
# what rebuilds a checkpoint's model for fine-tuning (cli/finetune_flags.py): all but the speed-only options
MODEL_DEFINING_RFA_OPTIONS = tuple(f.name for f in fields(RFAConfig) if f.name in RFA_ROLES and not f.metadata["speed_only"])


class RFAOptionMismatchError(ValueError):
    """A checkpoint was trained with other RFA options than the model it is loaded into."""


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _positive(kind):
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a positive {kind.__name__}, got {text!r}")
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be a positive {'integer' if kind is int else 'number'}, got {text}")
        return value

    parse.__name__ = f"positive_{kind.__name__}"
    return parse


# on by default: --FLAG turns them on, --no-FLAG off (fairseq's generator would make --FLAG mean off)
ON_BY_DEFAULT = tuple(f.name for f in fields(RFAConfig) if f.default is True)


def add_rfa_args(parser) -> None:
    """Add the --rfa-* flags; positive-only values are checked by argparse, naming the flag."""
    gen_parser_from_dataclass(parser, RFAConfig())
    for action in list(parser._actions):
        if action.dest in ON_BY_DEFAULT:
            parser._remove_action(action)
            for option in action.option_strings:
                parser._option_string_actions.pop(option, None)
            parser.add_argument(*action.option_strings, dest=action.dest, default=True,
                                action=argparse.BooleanOptionalAction, help=action.help)
    positive = {"rfa_num_features": _positive(int), "rfa_chunk_size": _positive(int), "rfa_temperature": _positive(float),
                "rfa_sigma_lr_multiplier": _positive(float)}
    for action in parser._actions:
        if action.dest in positive:
            action.type = positive[action.dest]


def apply_rfa_defaults(args) -> None:
    """Fill missing rfa_* fields (old checkpoints, Hydra configs that omit them)."""
    for name, default in RFA_DEFAULTS.items():
        if getattr(args, name, None) is None:
            setattr(args, name, default)


# --rfa-num-features above this is refused up front: 32x the paper's D = 64 for translation, 16x the
# largest D of docs/quality.md. Every token keeps 2D floats per head and layer, and the (D x head_dim)
# random matrices are drawn at every update, so a mistyped D (1000000) ran for minutes with no message
MAX_RFA_NUM_FEATURES = 2048


def check_rfa_num_features(args) -> None:
    """Refuse an unreasonable --rfa-num-features before anything is allocated, with what it would cost."""
    value = getattr(args, "rfa_num_features", None)
    if not isinstance(value, int) or value <= MAX_RFA_NUM_FEATURES:
        return
    heads = getattr(args, "decoder_attention_heads", None) or 1
    per_token = 2 * value * 4 * heads  # 2D fp32 features per head, for q and again for k
    raise ValueError(
        f"{flag('rfa_num_features')}={value} is above the limit of {MAX_RFA_NUM_FEATURES}: every token would keep "
        f"2 x {value} fp32 features per head ({per_token / 2 ** 20:.1f} MiB per token and layer with {heads} heads, "
        f"for queries and again for keys). The paper uses 64 and docs/quality.md finds 32 enough; pick a value "
        f"<= {MAX_RFA_NUM_FEATURES}")


def check_shortlist_options(args) -> None:
    """--rfa-shortlist is a path (a str, empty: off) and its K / N None or in range, named when not (the file itself is
    read, and checked against the model's dictionaries, when the decoder loads it)."""
    path = getattr(args, "rfa_shortlist", "")
    if path is not None and not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"{flag('rfa_shortlist')} must be a path (a str; empty: the full vocabulary), got {path!r}")
    for name, least in (("rfa_shortlist_k", 1), ("rfa_shortlist_n", 0)):
        value = getattr(args, name, None)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise ValueError(f"{flag(name)} must be an integer >= {least} (None: the shortlist file's), got {value!r}")
        if not path:
            raise ValueError(f"{flag(name)}={value} is given without {flag('rfa_shortlist')} (the shortlist file it "
                             f"picks from)")


def validate_rfa_args(args) -> None:
    """Reject bad or contradictory options before any model is built, naming the flag."""
    if args.rfa_feature_map not in FEATURE_MAPS:
        raise ValueError(f"{flag('rfa_feature_map')}={args.rfa_feature_map!r} is not one of {', '.join(FEATURE_MAPS)}")
    if args.rfa_random_matrix not in RANDOM_MATRIX_KINDS:
        raise ValueError(
            f"{flag('rfa_random_matrix')}={args.rfa_random_matrix!r} is not one of {', '.join(RANDOM_MATRIX_KINDS)}"
        )
    if args.rfa_decode_kernel not in DECODE_KERNELS:
        raise ValueError(
            f"{flag('rfa_decode_kernel')}={args.rfa_decode_kernel!r} is not one of {', '.join(DECODE_KERNELS)}"
        )
    if getattr(args, "rfa_decode_precision", "fp32") not in DECODE_PRECISIONS:
        raise ValueError(
            f"{flag('rfa_decode_precision')}={args.rfa_decode_precision!r} is not one of {', '.join(DECODE_PRECISIONS)}"
        )
    if getattr(args, "rfa_decode_state", "auto") not in DECODE_STATES:
        raise ValueError(
            f"{flag('rfa_decode_state')}={args.rfa_decode_state!r} is not one of {', '.join(DECODE_STATES)}"
        )
    if getattr(args, "rfa_cpu_isa", "auto") not in CPU_ISAS:
        raise ValueError(f"{flag('rfa_cpu_isa')}={args.rfa_cpu_isa!r} is not one of {', '.join(CPU_ISAS)}")
    parts = getattr(args, "rfa_decode_parts", 0)
    if not isinstance(parts, int) or isinstance(parts, bool) or parts < 0:
        raise ValueError(f"{flag('rfa_decode_parts')} must be a non-negative integer (0: auto), got {parts!r}")
    check_shortlist_options(args)
    if getattr(args, "rfa_sequence_kernel", "auto") not in SEQUENCE_KERNELS:
        raise ValueError(
            f"{flag('rfa_sequence_kernel')}={args.rfa_sequence_kernel!r} is not one of {', '.join(SEQUENCE_KERNELS)}"
        )
    if args.rfa_sigma not in SIGMA_MODES:
        raise ValueError(f"{flag('rfa_sigma')}={args.rfa_sigma!r} is not one of {', '.join(SIGMA_MODES)}")
    for name in ("rfa_num_features", "rfa_chunk_size"):
        value = getattr(args, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{flag(name)} must be a positive integer, got {value!r}")
    check_rfa_num_features(args)
    for name in ("rfa_temperature", "rfa_sigma_lr_multiplier"):
        if not getattr(args, name) > 0:
            raise ValueError(f"{flag(name)} must be > 0, got {getattr(args, name)!r}")
    if args.rfa_feature_map in LEARNED_FEATURE_MAPS and args.rfa_temperature != RFA_DEFAULTS["rfa_temperature"]:
        raise ValueError(
            f"{flag('rfa_temperature')}={args.rfa_temperature} has no effect with {flag('rfa_feature_map')}="
            f"{args.rfa_feature_map}: a learned map has no sigma (it learns its own scale); drop the flag"
        )
    if args.rfa_feature_map == "arccos" and args.rfa_temperature != RFA_DEFAULTS["rfa_temperature"]:
        # sigma starts uniform, and phi_arccos(s * x) = s * phi_arccos(x) cancels in the ratio
        raise ValueError(
            f"{flag('rfa_temperature')}={args.rfa_temperature} has no effect with {flag('rfa_feature_map')}=arccos "
            "(the arc-cosine kernel is scale-invariant for the uniform initial sigma); drop it or use sincos/positive"
        )
    if getattr(args, "cross_self_attention", False):
        raise ValueError(
            "--cross-self-attention contradicts RFA: it makes decoder self-attention attend to the encoder "
            "output, which the causal RFA state cannot represent; drop the flag or use --arch transformer"
        )
    for side in ("encoder", "decoder"):
        embed_dim, heads = getattr(args, f"{side}_embed_dim"), getattr(args, f"{side}_attention_heads")
        if embed_dim % heads:
            raise ValueError(f"--{side}-embed-dim={embed_dim} is not divisible by --{side}-attention-heads={heads}")
