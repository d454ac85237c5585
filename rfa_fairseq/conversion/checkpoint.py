"""The checkpoint half of conversion: a softmax `transformer` checkpoint's options and weights become an
`rfa_transformer` model of the same sizes, and that model becomes a checkpoint ready for
`fairseq-train --finetune-from-model`.

Kept and new:
  - every softmax weight (embeddings, layer norms, FFNs and the q/k/v/out projections, whose names are
    those of fairseq's MultiheadAttention) is copied unchanged;
  - new RFA parameters: sigma (calibration.py); eval_random_matrix drawn from the seed; with --rfa-gate,
    gate_proj with zero weights and a bias (init_gates), so every token starts with the same slow decay
    g = sigmoid(bias) and the converted model starts close to ungated attention;
  - cfg: model arch and _name become the rfa_* counterpart, with the --rfa-* options given; optimizer and
    lr-scheduler state, meters and data position are dropped (fine-tuning starts at update 0).
"""
import argparse
import copy
import types

import torch

from ..checkpoints import mark_rfa_checkpoint, stored_model_config
from ..config import RFA_DEFAULTS, validate_rfa_args

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
# the gate starts at g = sigmoid(4) = 0.982: a memory of ~55 tokens, nearly the softmax average
DEFAULT_GATE_BIAS = 4.0
# RFA parameters that a softmax checkpoint lacks (everything else must come from it)
RFA_PARAMETER_SUFFIXES = (
    ".sigma", ".log_sigma", ".eval_random_matrix", ".gate_proj.weight", ".gate_proj.bias", ".phi.weight", ".phi.bias",
)
RFA_OPTIONS = [name for name in RFA_DEFAULTS if name.startswith("rfa_")]


class ConversionError(Exception):
    """A user-facing failure: wrong input checkpoint, options that do not fit it, bad data."""


def softmax_model_options(state):
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


def stand_in_dictionary(size):
    """Building a model needs only the vocabulary size and the special symbols' indices."""
    from fairseq.data import Dictionary

    dictionary = Dictionary()
    while len(dictionary) < size:
        dictionary.add_symbol(f"<symbol{len(dictionary)}>")
    return dictionary


def build_rfa_model(options, softmax_state_dict):
    """The RFA model with the softmax weights loaded; its RFA parameters freshly initialized."""
    from fairseq.models import ARCH_MODEL_REGISTRY

    src_size = softmax_state_dict["encoder.embed_tokens.weight"].shape[0]
    tgt_size = softmax_state_dict["decoder.embed_tokens.weight"].shape[0]
    src_dict = stand_in_dictionary(src_size)
    tgt_dict = src_dict if tgt_size == src_size else stand_in_dictionary(tgt_size)
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


def init_gates(model, bias):
    """Zero gate weights and a constant bias: every token starts with the same decay sigmoid(bias)."""
    with torch.no_grad():
        for module in model.rfa_modules():
            if module.gate_proj is not None:
                module.gate_proj.weight.zero_()
                module.gate_proj.bias.fill_(bias)


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
