"""Convert a trained fairseq softmax `transformer` checkpoint into an `rfa_transformer` checkpoint,
ready for `fairseq-train --finetune-from-model` (the T2R recipe of Kasai et al. 2021, "Finetuning
Pretrained Transformers into RNNs", here with RFA).

Console script `rfa-convert-transformer` (also `python -m rfa_fairseq.cli.convert`,
scripts/convert_transformer_to_rfa.py):

  rfa-convert-transformer --input softmax/checkpoint_best.pt --output rfa_init.pt \\
      --rfa-num-features 128 [other --rfa-* options] --calibration-data data-bin
  fairseq-train data-bin --user-dir rfa_fairseq --arch rfa_transformer_... [the same model and
      --rfa-* options] --finetune-from-model rfa_init.pt ...

With --calibration-data (a fairseq-preprocess'd directory with the teacher's dictionaries) and the
default learned map, the new parameters are then distilled (Hedgehog / LoLCATs, Zhang et al. 2024):

  rfa-convert-transformer --input softmax/checkpoint_best.pt --output rfa_init.pt --calibration-data data-bin
  DATA=data-bin RECIPE=... MODEL=rfa MAX_UPDATE=200 SAVE_DIR=ft FINETUNE_FROM=rfa_init.pt scripts/train.sh

Attention distillation (rfa_fairseq/distillation.py): the teacher runs on --calibration-sentences
training sentences and the inputs of every converted attention layer are kept; then only the learned
feature maps (W, b) and gates of those layers are trained, --distill-steps Adam updates, so that each
layer's RFA attention matches the teacher's softmax attention on the same inputs (--distill-loss ce:
soft cross-entropy of the attention rows; mse: squared error of the attention outputs). A report per
layer, on the held-out tenth of the sentences: attention-output cosine and top-1 agreement of the
attention rows, before -> after. On the GPU when there is one. --distill-steps 0 is the plain swap.

Kept and new:
  - every softmax weight (embeddings, layer norms, FFNs and the q/k/v/out projections, whose
    names are those of fairseq's MultiheadAttention) is copied unchanged;
  - new RFA parameters: sigma (below); eval_random_matrix drawn from --seed; with --rfa-gate,
    gate_proj with zero weights and bias --gate-bias, so every token starts with the same slow
    decay g = sigmoid(bias) and the converted model starts close to ungated attention;
  - cfg: model arch and _name become the rfa_* counterpart, with the --rfa-* options given here;
    optimizer and lr-scheduler state, meters and data position are dropped (fine-tuning starts at
    update 0). Written atomically.

sigma. Softmax weighs key j by exp(q.k_j / sqrt(d)); RFA by the kernel of sigma*q/|q| and
sigma*k/|k|, which for a per-head scalar sigma = s is proportional to exp(s^2 cos(q, k_j)) (sincos:
up to a per-query constant that cancels; positive: exactly). s^2 thus stands in for the logit scale
|q||k|/sqrt(d) that the l2 normalization removed. --sigma-init:
  temperature  s = --rfa-temperature^(-1/2) in every head (the plugin's own initialization);
  norm         s_h^2 = mean |q| * mean |k| / sqrt(d) of head h on calibration sentences;
  fit          s_h minimizes the squared difference between head h's softmax output and its RFA
               output (computed by the RFA module itself, with its eval random matrix) on
               calibration sentences, over a log-spaced grid. Random features estimate exp(s^2 cos)
               with a variance that grows with s, so the best s is usually below the norm estimate
               (measured in tests/test_convert.py's setting: norm gives s = 2.2-3.8, which sincos with
               D = 64 estimates so badly that top-1 agreement drops to 7%; fit picks 1.1-2.0 and 70%).
Default: fit when --calibration-data is given, else temperature. arccos is scale-invariant for a
uniform sigma, so it always uses temperature.
"""
import argparse
import copy
import math
import os
import sys

import torch

from . import run_console_script
from ..checkpoints import (CheckpointLoadError, mark_rfa_checkpoint, output_file_problem, safe_load, save_atomic,
                           stored_model_config)
from ..config import RFA_DEFAULTS, add_rfa_args, validate_rfa_args
from ..distillation import (
    DISTILL_LOSSES,
    attention_fidelity,
    distill_attention,
    distillable_parameters,
    softmax_attention,
    split_heads,
)
from ..ops import LEARNED_FEATURE_MAPS

# softmax architecture -> its RFA twin (same sizes); rfa_fairseq/models/rfa_transformer.py
ARCH_MAP = {
    "transformer": "rfa_transformer",
    "transformer_tiny": "rfa_transformer_tiny",
    "transformer_iwslt_de_en": "rfa_transformer_iwslt_de_en",
    "transformer_wmt_en_de": "rfa_transformer_wmt_en_de",
    "transformer_wmt_en_de_big": "rfa_transformer_wmt_en_de_big",
    "transformer_vaswani_wmt_en_de_big": "rfa_transformer_vaswani_wmt_en_de_big",
    "transformer_vaswani_wmt_en_fr_big": "rfa_transformer_vaswani_wmt_en_fr_big",
}
SIGMA_INITS = ("temperature", "norm", "fit")
# the fit's candidates for s: s^2 from 1/16 to 64 covers logit scales far beyond trained models'
SIGMA_GRID = torch.exp(torch.linspace(math.log(0.25), math.log(8.0), 31))
# the gate starts at g = sigmoid(4) = 0.982: a memory of ~55 tokens, nearly the softmax average
DEFAULT_GATE_BIAS = 4.0
# distillation defaults: measured on Multi30k (docs/quality.md, "Converting a softmax model")
DEFAULT_CALIBRATION_SENTENCES = 1000
DEFAULT_DISTILL_STEPS = 300
DEFAULT_DISTILL_LOSS = "ce"
DEFAULT_DISTILL_LR = 1e-2
# RFA parameters that a softmax checkpoint lacks (everything else must come from it)
RFA_PARAMETER_SUFFIXES = (
    ".sigma", ".log_sigma", ".eval_random_matrix", ".gate_proj.weight", ".gate_proj.bias", ".phi.weight", ".phi.bias",
)
RFA_OPTIONS = [name for name in RFA_DEFAULTS if name.startswith("rfa_")]


class ConversionError(Exception):
    """A user-facing failure: wrong input checkpoint, options that do not fit it, bad data."""


# ---------------------------------------------------------------- checkpoint and model


def _model_options(state):
    """The checkpoint's model configuration as a mutable Namespace, and how it was stored."""
    stored = stored_model_config(state)
    if stored is None:
        raise ConversionError("the checkpoint has no model configuration (cfg['model'] / args): is it a fairseq checkpoint?")
    if isinstance(stored, argparse.Namespace):
        return copy.deepcopy(stored), "namespace"
    return argparse.Namespace(**dict(stored)), "dict"


def rfa_model_options(softmax_options, rfa_options, seed):
    """The RFA model's options: the softmax model's, arch renamed, plus the --rfa-* options."""
    from fairseq.models import ARCH_CONFIG_REGISTRY

    arch = getattr(softmax_options, "arch", None) or getattr(softmax_options, "_name", None)
    if arch is not None and str(arch).startswith("rfa_"):
        raise ConversionError(f"the checkpoint is already an RFA model (arch {arch}); nothing to convert")
    if arch not in ARCH_MAP:
        raise ConversionError(
            f"cannot convert architecture {arch!r}: supported softmax architectures are {', '.join(ARCH_MAP)}"
        )
    options = copy.deepcopy(softmax_options)
    options.arch = ARCH_MAP[arch]
    name = getattr(options, "_name", None)
    options._name = ARCH_MAP.get(name, "rfa_transformer") if name is not None else ARCH_MAP[arch]
    for name in RFA_OPTIONS:
        setattr(options, name, getattr(rfa_options, name))
    options.seed = seed
    ARCH_CONFIG_REGISTRY[options.arch](options)  # fills only what the softmax options lack
    for side in ("encoder", "decoder"):
        dim, heads = getattr(options, f"{side}_embed_dim"), getattr(options, f"{side}_attention_heads")
        if dim % heads:
            raise ConversionError(f"the checkpoint's {side} embedding size {dim} is not divisible by its {heads} "
                                  f"attention heads (--{side}-embed-dim / --{side}-attention-heads): not a model "
                                  f"fairseq can build")
    try:
        validate_rfa_args(options)
    except ValueError as exc:
        raise ConversionError(f"the RFA options do not fit this model: {exc}") from exc
    return options


def _stand_in_dictionary(size):
    """Building a model needs only the vocabulary size and the special symbols' indices."""
    from fairseq.data import Dictionary

    dictionary = Dictionary()
    while len(dictionary) < size:
        dictionary.add_symbol(f"<symbol{len(dictionary)}>")
    return dictionary


def build_rfa_model(options, softmax_state_dict):
    """The RFA model with the softmax weights loaded; its RFA parameters freshly initialized."""
    import types

    from fairseq.models import ARCH_MODEL_REGISTRY

    src_size = softmax_state_dict["encoder.embed_tokens.weight"].shape[0]
    tgt_size = softmax_state_dict["decoder.embed_tokens.weight"].shape[0]
    src_dict = _stand_in_dictionary(src_size)
    tgt_dict = src_dict if tgt_size == src_size else _stand_in_dictionary(tgt_size)
    task = types.SimpleNamespace(source_dictionary=src_dict, target_dictionary=tgt_dict)
    torch.manual_seed(options.seed)
    model = ARCH_MODEL_REGISTRY[options.arch].build_model(options, task)
    state_dict = {k: v.float() if v.is_floating_point() else v for k, v in softmax_state_dict.items()}
    missing, unexpected = model.load_state_dict(state_dict, strict=False)  # RFA parameters are missing
    not_rfa = [k for k in missing if not k.endswith(RFA_PARAMETER_SUFFIXES)]
    if unexpected or not_rfa:
        raise ConversionError(
            "the softmax checkpoint does not match the RFA model built from its own options: "
            + (f"entries the RFA model lacks: {', '.join(unexpected[:8])}" if unexpected else "")
            + ("; " if unexpected and not_rfa else "")
            + (f"entries the checkpoint lacks: {', '.join(not_rfa[:8])}" if not_rfa else "")
        )
    return model.eval()


# ---------------------------------------------------------------- calibration


def load_calibration(checkpoint, data, subset, num_sentences):
    """The softmax model (as fairseq-generate would load it) and up to num_sentences of `subset`."""
    from fairseq import checkpoint_utils

    try:
        models, _cfg, task = checkpoint_utils.load_model_ensemble_and_task([checkpoint], arg_overrides={"data": data})
    except RuntimeError as exc:
        raise ConversionError(f"cannot run {checkpoint} on --calibration-data {data}: {exc}") from exc
    try:
        task.load_dataset(subset)
    except FileNotFoundError as exc:
        raise ConversionError(f"no '{subset}' split in --calibration-data {data}: {exc}") from exc
    dataset = task.dataset(subset)
    if len(dataset) == 0:
        raise ConversionError(f"the '{subset}' split of {data} is empty")
    count = min(num_sentences, len(dataset))
    # spread over the split: neighbouring sentences are often alike
    indices = sorted({round(i * (len(dataset) - 1) / max(count - 1, 1)) for i in range(count)})
    return models[0].eval(), task, dataset, indices


def capture_attention_inputs(softmax_model, dataset, indices, module_names, batch_size=32):
    """Inputs of each named MultiheadAttention on batches of calibration sentences, with the
    padding masks: keys (what the module got) and queries (which output rows are real tokens).
    Batches go to the softmax model's device."""
    from fairseq import utils

    device = next(softmax_model.parameters()).device
    captured = {name: [] for name in module_names}
    modules = dict(softmax_model.named_modules())
    handles = []
    for name in module_names:
        def pre_hook(module, args, kwargs, name=name):
            captured[name].append({key: kwargs.get(key) for key in ("query", "key", "value", "key_padding_mask")})

        handles.append(modules[name].register_forward_pre_hook(pre_hook, with_kwargs=True))
    pad = dataset.src_dict.pad()
    try:
        with torch.no_grad():
            for start in range(0, len(indices), batch_size):
                sample = dataset.collater([dataset[i] for i in indices[start:start + batch_size]])
                sample = utils.move_to_cuda(sample, device) if device.type == "cuda" else sample
                softmax_model(**sample["net_input"])
                net_input = sample["net_input"]
                for name in module_names:
                    tokens = net_input["src_tokens"] if name.startswith("encoder.") else net_input["prev_output_tokens"]
                    captured[name][-1]["query_valid"] = tokens.ne(pad)  # (B, T)
    finally:
        for handle in handles:
            handle.remove()
    return captured


def rfa_head_outputs(module, item):
    """Per-head outputs (B, H, T, d), before out_proj, of the RFA module's own forward pass."""
    seen = {}
    handle = module.out_proj.register_forward_pre_hook(lambda m, args: seen.setdefault("x", args[0]))
    query, mask = item["query"], item["key_padding_mask"]
    try:
        if module.causal:
            module(query, query, query, key_padding_mask=mask)
        else:
            module(query, item["key"], item["value"], key_padding_mask=mask)
    finally:
        handle.remove()
    return split_heads(seen["x"].float(), module.num_heads)


def calibrate_sigma(rfa_model, captured, method):
    """Set sigma of every calibrated RFA module by `method` (norm or fit); returns {name: per-head s}."""
    modules = dict(rfa_model.named_modules())
    chosen = {}
    with torch.no_grad():
        for name, items in captured.items():
            module = modules[name]
            targets, q_norms, k_norms = [], [], []
            for item in items:
                weights, v = softmax_attention(module, item)
                targets.append(weights @ v)  # (B, H, T, d): the softmax heads' outputs
                # |q| of real query tokens and |k| of real keys, (tokens, H)
                q = split_heads(module.q_proj(item["query"]), module.num_heads)
                k = split_heads(module.k_proj(item["key"]), module.num_heads)
                q_norms.append(q.norm(dim=-1).transpose(1, 2)[item["query_valid"]])
                key_mask = item["key_padding_mask"]
                key_valid = ~key_mask if key_mask is not None else torch.ones(k.shape[0], k.shape[2], dtype=torch.bool, device=k.device)
                k_norms.append(k.norm(dim=-1).transpose(1, 2)[key_valid])
            if method == "norm":
                mean_q, mean_k = torch.cat(q_norms).mean(0), torch.cat(k_norms).mean(0)
                scale = (mean_q * mean_k / math.sqrt(module.head_dim)).sqrt()
            else:
                errors = torch.zeros(len(SIGMA_GRID), module.num_heads)
                for g, candidate in enumerate(SIGMA_GRID):
                    module.set_sigma_(torch.full_like(module.current_sigma(), float(candidate)))
                    for item, target in zip(items, targets):
                        squared = (rfa_head_outputs(module, item) - target).pow(2).sum(-1)  # (B, H, T)
                        errors[g] += (squared * item["query_valid"][:, None, :]).sum(dim=(0, 2))
                scale = SIGMA_GRID[errors.argmin(dim=0)]
            module.set_sigma_(scale.to(module.current_sigma().dtype).unsqueeze(-1).expand_as(module.current_sigma()))
            chosen[name] = scale.tolist()
    return chosen


def rfa_module_names(rfa_model):
    from ..modules import RFAAttention

    return [name for name, m in rfa_model.named_modules() if isinstance(m, RFAAttention)]


# ---------------------------------------------------------------- distillation


def distill_layers(model, modules, captured, args, log):
    """Distill the learned feature maps and gates of `modules` (rfa_fairseq/distillation.py) on the
    captured batches, the last tenth held out; logs and returns the per-layer fidelity before and after."""
    held = {name: items[-max(1, len(items) // 10):] for name, items in captured.items()}
    train = {name: items[: len(items) - len(held[name])] or items for name, items in captured.items()}
    before = {name: attention_fidelity(m, held[name]) for name, m in modules.items()}
    log(f"rfa-convert-transformer: distilling {len(modules)} attention layers ({args.distill_loss} loss, "
        f"{args.distill_steps} steps, lr {args.distill_lr}, {sum(len(v) for v in train.values()) // len(train)} "
        f"batches of training sentences per layer, {next(model.parameters()).device})")
    progress = _progress_bar(args.distill_steps, log)
    try:
        history = distill_attention(modules, train, args.distill_steps, args.distill_lr, args.distill_loss, progress)
    finally:
        progress.close()
    report = {}
    for name, module in modules.items():
        after = attention_fidelity(module, held[name])
        report[name] = {"before": before[name], "after": after}
        log(f"rfa-convert-transformer: {name}: held-out attention-output cosine {before[name]['output_cosine']:.3f} -> "
            f"{after['output_cosine']:.3f}, top-1 agreement {before[name]['top1_agreement']:.3f} -> "
            f"{after['top1_agreement']:.3f}")
    return {"loss": args.distill_loss, "steps": args.distill_steps, "lr": args.distill_lr,
            "first_loss": history[0], "last_loss": history[-1], "layers": report}


class _progress_bar:
    """tqdm on a terminal; otherwise a line every tenth of the steps (logs, pipes)."""

    def __init__(self, total, log):
        from tqdm import tqdm

        self.total, self.log = total, log
        self.bar = tqdm(total=total, desc="distilling", unit="step", file=sys.stderr) if sys.stderr.isatty() else None

    def __call__(self, step, loss):
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{loss:.4f}")
        elif step % max(1, self.total // 10) == 0 or step == self.total:
            self.log(f"rfa-convert-transformer: distillation step {step}/{self.total}, loss {loss:.4f}")

    def close(self):
        if self.bar is not None:
            self.bar.close()


# ---------------------------------------------------------------- fidelity


def teacher_forced_agreement(teacher, student, dataset, indices, batch_size=32):
    """Next-token distributions of two models on the same reference prefixes (teacher forcing).

    Returns mean KL(teacher || student) per target token (nats), the fraction of tokens whose top-1
    prediction agrees, and the teacher's own top-1 accuracy against the reference.
    """
    kl_sum, agree, correct, tokens = 0.0, 0, 0, 0
    with torch.no_grad():
        for start in range(0, len(indices), batch_size):
            sample = dataset.collater([dataset[i] for i in indices[start:start + batch_size]])
            target = sample["target"]
            mask = target.ne(dataset.tgt_dict.pad())
            logp = [m.get_normalized_probs(m(**sample["net_input"]), log_probs=True).float() for m in (teacher, student)]
            kl = (logp[0].exp() * (logp[0] - logp[1])).sum(-1)
            kl_sum += kl[mask].sum().item()
            agree += (logp[0].argmax(-1) == logp[1].argmax(-1))[mask].sum().item()
            correct += (logp[0].argmax(-1) == target)[mask].sum().item()
            tokens += mask.sum().item()
    return {"kl": kl_sum / tokens, "top1_agreement": agree / tokens, "teacher_accuracy": correct / tokens, "tokens": tokens}


# ---------------------------------------------------------------- writing


def converted_checkpoint(state, model_options, storage, model, info):
    """The new checkpoint: RFA weights and cfg, fresh training state."""
    new = {key: value for key, value in state.items() if key not in ("model", "last_optimizer_state", "criterion")}
    cfg = copy.deepcopy(state.get("cfg"))
    if cfg is not None:
        if storage == "namespace":
            cfg["model"] = model_options
        else:
            cfg["model"] = {**cfg["model"], **vars(model_options)}
        new["cfg"] = cfg
    if state.get("args") is not None:
        new["args"] = copy.deepcopy(model_options)
    new["model"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    new["criterion"] = None
    history = (state.get("optimizer_history") or [{}])[-1]
    new["optimizer_history"] = [{
        "criterion_name": history.get("criterion_name", "LabelSmoothedCrossEntropyCriterion"),
        "optimizer_name": history.get("optimizer_name", "FairseqAdam"),
        "lr_scheduler_state": {},
        "num_updates": 0,
    }]
    new["extra_state"] = {"train_iterator": {"epoch": 1, "iterations_in_epoch": 0, "version": 2}, "val_loss": None}
    new["rfa_conversion"] = info
    return mark_rfa_checkpoint(new)


# ---------------------------------------------------------------- command line


def build_parser():
    parser = argparse.ArgumentParser(
        prog="rfa-convert-transformer", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--input", required=True, help="fairseq softmax transformer checkpoint")
    parser.add_argument("--output", required=True, help="rfa_transformer checkpoint to write")
    parser.add_argument("--seed", type=int, default=None,
                        help="seed of the eval random matrices and gate init (default: the checkpoint's --seed)")
    parser.add_argument("--sigma-init", choices=SIGMA_INITS, default=None,
                        help="how sigma starts (see above; default: fit with --calibration-data, else temperature)")
    parser.add_argument("--calibration-data", default=None,
                        help="binarized data dir (fairseq-preprocess --destdir) with the checkpoint's dictionaries")
    parser.add_argument("--calibration-subset", default="train",
                        help="split to calibrate and distill on (default: train)")
    parser.add_argument("--calibration-sentences", type=int, default=DEFAULT_CALIBRATION_SENTENCES,
                        help=f"sentences to calibrate and distill on, spread over the split; the last tenth is "
                             f"held out for the report (default: {DEFAULT_CALIBRATION_SENTENCES})")
    parser.add_argument("--distill-steps", type=int, default=DEFAULT_DISTILL_STEPS,
                        help="with --calibration-data and a learned feature map or the gate: Adam updates of "
                             "attention distillation, one batch of 32 sentences each (see above); 0 = plain swap "
                             f"(default: {DEFAULT_DISTILL_STEPS})")
    parser.add_argument("--distill-loss", choices=DISTILL_LOSSES, default=DEFAULT_DISTILL_LOSS,
                        help="ce: soft cross-entropy of the attention weights (Hedgehog); mse: squared error of "
                             f"the attention outputs (LoLCATs) (default: {DEFAULT_DISTILL_LOSS})")
    parser.add_argument("--distill-lr", type=float, default=DEFAULT_DISTILL_LR,
                        help=f"Adam learning rate of the distillation, cosine-decayed to a tenth (default: {DEFAULT_DISTILL_LR})")
    parser.add_argument("--gate-bias", type=float, default=DEFAULT_GATE_BIAS,
                        help=f"with --rfa-gate: initial gate bias, zero gate weights (default: {DEFAULT_GATE_BIAS})")
    add_rfa_args(parser)
    return parser


def convert(args, log=print):
    """Write args.output from args.input; returns a dict describing the conversion."""
    if os.path.abspath(args.input) == os.path.abspath(args.output):
        raise ConversionError("--output must differ from --input (the softmax checkpoint is kept)")
    problem = output_file_problem(args.output)
    if problem:
        raise ConversionError(problem)
    sigma_init = args.sigma_init or ("fit" if args.calibration_data else "temperature")
    if sigma_init != "temperature" and not args.calibration_data:
        raise ConversionError(f"--sigma-init {sigma_init} needs --calibration-data (sentences to measure q and k on)")
    if args.rfa_feature_map in LEARNED_FEATURE_MAPS and sigma_init != "temperature":
        log(f"rfa-convert-transformer: {args.rfa_feature_map} is a learned map without sigma; --sigma-init {sigma_init} -> temperature")
        sigma_init = "temperature"
    if args.rfa_feature_map == "arccos" and sigma_init != "temperature":
        log(f"rfa-convert-transformer: arccos is scale-invariant for a uniform sigma; --sigma-init {sigma_init} -> temperature")
        sigma_init = "temperature"
    if args.calibration_sentences <= 0:
        raise ConversionError(f"--calibration-sentences must be positive, got {args.calibration_sentences}")
    if args.distill_steps < 0:
        raise ConversionError(f"--distill-steps must be 0 (no distillation) or positive, got {args.distill_steps}")
    if not args.distill_lr > 0:
        raise ConversionError(f"--distill-lr must be positive, got {args.distill_lr}")
    try:
        state = safe_load(args.input)
    except (CheckpointLoadError, FileNotFoundError) as exc:
        raise ConversionError(str(exc)) from exc
    if "model" not in state:
        raise ConversionError(f"{args.input} has no 'model' entry: is it a fairseq checkpoint?")
    softmax_options, storage = _model_options(state)
    common = (state.get("cfg") or {}).get("common") or {}
    seed = args.seed if args.seed is not None else int(getattr(softmax_options, "seed", None) or common.get("seed") or 1)
    options = rfa_model_options(softmax_options, args, seed)
    model = build_rfa_model(options, state["model"])
    for module in model.rfa_modules():
        if module.gate_proj is not None:
            with torch.no_grad():
                module.gate_proj.weight.zero_()
                module.gate_proj.bias.fill_(args.gate_bias)

    info = {"source": os.path.abspath(args.input), "sigma_init": sigma_init, "seed": seed}
    chosen = {}
    if args.calibration_data:
        softmax_model, _task, dataset, indices = load_calibration(
            args.input, args.calibration_data, args.calibration_subset, args.calibration_sentences
        )
        names = rfa_module_names(model)
        distilled = {n: m for n, m in model.named_modules() if n in names and distillable_parameters(m)}
        distill = args.distill_steps > 0 and bool(distilled)
        if sigma_init != "temperature" or distill:
            device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
            softmax_model.to(device)
            model.to(device)
            captured = capture_attention_inputs(softmax_model, dataset, indices, names)
        if sigma_init != "temperature":
            chosen = calibrate_sigma(model, captured, sigma_init)
            for name, scales in chosen.items():
                log(f"rfa-convert-transformer: {name}: sigma per head = {', '.join(f'{s:.2f}' for s in scales)}")
        if distill:
            info["distillation"] = distill_layers(model, distilled, captured, args, log)
        info["distillation_steps"] = args.distill_steps if distill else 0
        softmax_model.cpu()
        model.cpu()
        fidelity = teacher_forced_agreement(softmax_model, model, dataset, indices)
        info["calibration"] = {"data": os.path.abspath(args.calibration_data), "subset": args.calibration_subset,
                               "sentences": len(indices), **fidelity}
        log(f"rfa-convert-transformer: teacher-forced agreement with the softmax model on {len(indices)} "
            f"{args.calibration_subset} sentences: KL {fidelity['kl']:.4f} nats/token, top-1 agreement "
            f"{fidelity['top1_agreement']:.3f} (softmax top-1 accuracy {fidelity['teacher_accuracy']:.3f})")
    info["sigma"] = chosen
    save_atomic(converted_checkpoint(state, options, storage, model, info), args.output)
    log(f"rfa-convert-transformer: wrote {args.output} (arch {options.arch}, {options.rfa_feature_map} features, "
        f"D={options.rfa_num_features}, sigma init {sigma_init}); fine-tune with fairseq-train --user-dir "
        f"path/to/rfa_fairseq --arch {options.arch} [same --rfa-* options] --finetune-from-model {args.output}")
    return info


def main(argv=None):
    def run(args):
        convert(args, log=lambda message: print(message, file=sys.stderr))

    return run_console_script("rfa-convert-transformer", build_parser(), run, ConversionError, argv)


if __name__ == "__main__":
    sys.exit(main())
