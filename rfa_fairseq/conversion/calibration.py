"""Calibration on the teacher's own sentences: the softmax model's attention inputs captured per layer,
sigma chosen from them, and how close the converted model's next-token distributions are to the teacher's.

sigma. Softmax weighs key j by exp(q.k_j / sqrt(d)); RFA by the kernel of sigma*q/|q| and sigma*k/|k|,
which for a per-head scalar sigma = s is proportional to exp(s^2 cos(q, k_j)) (sincos: up to a per-query
constant that cancels; positive: exactly). s^2 thus stands in for the logit scale |q||k|/sqrt(d) that the
l2 normalization removed. SIGMA_INITS:
  temperature  s = --rfa-temperature^(-1/2) in every head (the plugin's own initialization);
  norm         s_h^2 = mean |q| * mean |k| / sqrt(d) of head h on calibration sentences;
  fit          s_h minimizes the squared difference between head h's softmax output and its RFA output
               (computed by the RFA module itself, with its eval random matrix) on calibration sentences,
               over a log-spaced grid. Random features estimate exp(s^2 cos) with a variance that grows
               with s, so the best s is usually below the norm estimate (measured in
               tests/test_convert.py's setting: norm gives s = 2.2-3.8, which sincos with D = 64 estimates
               so badly that top-1 agreement drops to 7%; fit picks 1.1-2.0 and 70%).
"""
import math

import torch

from .checkpoint import ConversionError
from .distillation import softmax_attention, split_heads

SIGMA_INITS = ("temperature", "norm", "fit")
# the fit's candidates for s: s^2 from 1/16 to 64 covers logit scales far beyond trained models'
SIGMA_GRID = torch.exp(torch.linspace(math.log(0.25), math.log(8.0), 31))


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
    from ..modules import RFAAttention  # after the plugin's registration (fairseq is imported lazily here)

    return [name for name, m in rfa_model.named_modules() if isinstance(m, RFAAttention)]


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
