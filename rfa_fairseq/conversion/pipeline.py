"""One conversion, start to end: softmax checkpoint -> RFA model (checkpoint.py) -> sigma and attention
distillation on calibration sentences (calibration.py, distillation.py) -> the RFA checkpoint, written
atomically. `options` is the Namespace of rfa-convert-transformer's flags (cli/convert.py), passed whole."""
import os

import torch

from ..checkpoints import CheckpointLoadError, output_file_problem, safe_load, save_atomic
from ..ops import LEARNED_FEATURE_MAPS
from .calibration import (calibrate_sigma, capture_attention_inputs, load_calibration, rfa_module_names,
                          teacher_forced_agreement)
from .checkpoint import (ConversionError, build_rfa_model, converted_checkpoint, init_gates, rfa_model_options,
                         softmax_model_options)
from .distillation import distill_layers, distillable_parameters

# measured on Multi30k (docs/quality.md, "Converting a softmax model")
DEFAULT_CALIBRATION_SENTENCES = 1000
DEFAULT_DISTILL_STEPS = 300
DEFAULT_DISTILL_LOSS = "ce"
DEFAULT_DISTILL_LR = 1e-2


def chosen_sigma_init(options, log):
    """--sigma-init as given, or its default; temperature where the map has no use for another."""
    sigma_init = options.sigma_init or ("fit" if options.calibration_data else "temperature")
    if sigma_init != "temperature" and not options.calibration_data:
        raise ConversionError(f"--sigma-init {sigma_init} needs --calibration-data (sentences to measure q and k on)")
    if options.rfa_feature_map in LEARNED_FEATURE_MAPS and sigma_init != "temperature":
        log(f"{options.rfa_feature_map} is a learned map without sigma; --sigma-init {sigma_init} -> temperature")
        return "temperature"
    if options.rfa_feature_map == "arccos" and sigma_init != "temperature":
        log(f"arccos is scale-invariant for a uniform sigma; --sigma-init {sigma_init} -> temperature")
        return "temperature"
    return sigma_init


def check_options(options):
    if os.path.abspath(options.input) == os.path.abspath(options.output):
        raise ConversionError("--output must differ from --input (the softmax checkpoint is kept)")
    problem = output_file_problem(options.output)
    if problem:
        raise ConversionError(problem)
    if options.calibration_sentences <= 0:
        raise ConversionError(f"--calibration-sentences must be positive, got {options.calibration_sentences}")
    if options.distill_steps < 0:
        raise ConversionError(f"--distill-steps must be 0 (no distillation) or positive, got {options.distill_steps}")
    if not options.distill_lr > 0:
        raise ConversionError(f"--distill-lr must be positive, got {options.distill_lr}")


def calibrate(model, options, sigma_init, log, progress):
    """sigma, distillation and the teacher-forced fidelity report on --calibration-data; returns the
    conversion record's entries and the chosen sigma per module."""
    softmax_model, _task, dataset, indices = load_calibration(
        options.input, options.calibration_data, options.calibration_subset, options.calibration_sentences
    )
    names = rfa_module_names(model)
    distilled = {n: m for n, m in model.named_modules() if n in names and distillable_parameters(m)}
    distill = options.distill_steps > 0 and bool(distilled)
    info, chosen = {}, {}
    if sigma_init != "temperature" or distill:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        softmax_model.to(device)
        model.to(device)
        captured = capture_attention_inputs(softmax_model, dataset, indices, names)
        if sigma_init != "temperature":
            chosen = calibrate_sigma(model, captured, sigma_init)
            for name, scales in chosen.items():
                log(f"{name}: sigma per head = {', '.join(f'{s:.2f}' for s in scales)}")
        if distill:
            info["distillation"] = distill_layers(distilled, captured, options.distill_steps, options.distill_lr,
                                                  options.distill_loss, log, progress)
    info["distillation_steps"] = options.distill_steps if distill else 0
    softmax_model.cpu()
    model.cpu()
    fidelity = teacher_forced_agreement(softmax_model, model, dataset, indices)
    info["calibration"] = {"data": os.path.abspath(options.calibration_data), "subset": options.calibration_subset,
                           "sentences": len(indices), **fidelity}
    log(f"teacher-forced agreement with the softmax model on {len(indices)} {options.calibration_subset} sentences: "
        f"KL {fidelity['kl']:.4f} nats/token, top-1 agreement {fidelity['top1_agreement']:.3f} "
        f"(softmax top-1 accuracy {fidelity['teacher_accuracy']:.3f})")
    return info, chosen


def convert(options, log=print, progress=None):
    """Write options.output from options.input; returns the record stored in it (`rfa_conversion`).
    log(message) reports what was chosen and measured; progress(step, loss) follows the distillation."""
    check_options(options)
    sigma_init = chosen_sigma_init(options, log)
    try:
        state = safe_load(options.input)
    except (CheckpointLoadError, FileNotFoundError) as exc:
        raise ConversionError(str(exc)) from exc
    if "model" not in state:
        raise ConversionError(f"{options.input} has no 'model' entry: is it a fairseq checkpoint?")
    softmax_options, storage = softmax_model_options(state)
    common = (state.get("cfg") or {}).get("common") or {}
    seed = options.seed if options.seed is not None else int(getattr(softmax_options, "seed", None) or common.get("seed") or 1)
    model_options = rfa_model_options(softmax_options, options, seed)
    model = build_rfa_model(model_options, state["model"])
    init_gates(model, options.gate_bias)

    info = {"source": os.path.abspath(options.input), "sigma_init": sigma_init, "seed": seed}
    chosen = {}
    if options.calibration_data:
        calibrated, chosen = calibrate(model, options, sigma_init, log, progress)
        info.update(calibrated)
    info["sigma"] = chosen
    save_atomic(converted_checkpoint(state, model_options, storage, model, info), options.output)
    log(f"wrote {options.output} (arch {model_options.arch}, {model_options.rfa_feature_map} features, "
        f"D={model_options.rfa_num_features}, sigma init {sigma_init}); fine-tune with fairseq-train --user-dir "
        f"path/to/rfa_fairseq --arch {model_options.arch} [same --rfa-* options] --finetune-from-model {options.output}")
    return info
