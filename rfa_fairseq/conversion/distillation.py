"""Attention distillation: fit the learned parts of each converted RFA layer (the feature map's W, b and
the gate) so that its attention mimics the softmax attention of the teacher layer it replaces, on the
teacher's own inputs, with every other weight frozen (Hedgehog and LoLCATs, Zhang et al. 2024).

Losses, per query token of a real (non-pad) sentence position, averaged over heads:
  ce   soft cross-entropy -sum_i A_soft[t, i] log A_rfa[t, i] between the two attention rows (Hedgehog)
  mse  squared error |A_rfa[t] V - A_soft[t] V|^2 / d of the attention outputs (LoLCATs)
A_rfa is the matrix RFA applies without forming it (ops.naive.rfa_attention_weights): feature-map
kernel, gate decay and the guarded denominator included, so what is fitted is what decodes.

Every item is one batch captured from the teacher (conversion/calibration.py: capture_attention_inputs):
  query (T, B, C), key / value (S, B, C), key_padding_mask (B, S) or None, query_valid (B, T).
"""
import math
from typing import Dict, List, Sequence

import torch
from torch import Tensor

from ..ops import gate_keys, rfa_attention_weights

DISTILL_LOSSES = ("ce", "mse")


def split_heads(x: Tensor, heads: int) -> Tensor:
    """(T, B, C) -> (B, H, T, d)."""
    length, batch, channels = x.shape
    return x.view(length, batch, heads, channels // heads).permute(1, 2, 0, 3)


def softmax_attention(module, item) -> tuple:
    """The teacher's attention weights (B, H, T, S) and values (B, H, S, d), computed with the module's
    q/k/v projections (copied unchanged from the softmax model)."""
    heads, head_dim = module.num_heads, module.head_dim
    q = split_heads(module.q_proj(item["query"]), heads) * head_dim ** -0.5
    k = split_heads(module.k_proj(item["key"]), heads)
    v = split_heads(module.v_proj(item["value"]), heads)
    scores = (q @ k.transpose(-1, -2)).float()  # (B, H, T, S)
    if module.causal:
        length = scores.size(-1)
        future = torch.ones(length, length, dtype=torch.bool, device=scores.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    if item["key_padding_mask"] is not None:
        scores = scores.masked_fill(item["key_padding_mask"][:, None, None, :], float("-inf"))
    return scores.softmax(-1), v.float()


def rfa_attention(module, item) -> Tensor:
    """The RFA module's attention weights (B, H, T, S) on the same inputs, differentiable in its
    feature map and gate."""
    w = module.random_matrix()  # (H, D, d) or None
    phi_q = module.features(module.q_proj(item["query"]), w, is_query=True)  # (B, H, T, F)
    phi_k = module.features(module.k_proj(item["key"]), w, is_query=False)
    gate_logits = None
    if module.causal and module.gate_proj is not None:
        gate_logits = module.gate_proj(item["query"]).permute(1, 2, 0)  # (B, H, T)
    phi_k, log_gate = gate_keys(phi_k, gate_logits, item["key_padding_mask"])
    return rfa_attention_weights(phi_q, phi_k, log_gate, causal=module.causal, eps=module.eps)


def _masked_mean(values: Tensor, valid: Tensor) -> Tensor:
    """Mean of values (B, H, T) over heads and the real query positions valid (B, T)."""
    weight = valid[:, None, :].to(values.dtype).expand_as(values)
    return (values * weight).sum() / weight.sum().clamp_min(1)


def distillation_loss(module, item, loss: str) -> Tensor:
    with torch.no_grad():
        teacher, v = softmax_attention(module, item)
    student = rfa_attention(module, item)
    if loss == "ce":
        per_token = -(teacher * student.clamp_min(1e-12).log()).sum(-1)  # (B, H, T)
    elif loss == "mse":
        per_token = ((student - teacher) @ v).pow(2).mean(-1)
    else:
        raise ValueError(f"unknown distillation loss {loss!r}; expected one of {', '.join(DISTILL_LOSSES)}")
    return _masked_mean(per_token, item["query_valid"])


@torch.no_grad()
def attention_fidelity(module, items: Sequence[dict]) -> Dict[str, float]:
    """How close the module's RFA attention is to the teacher's softmax attention on `items`:
    cosine of the per-head attention outputs and top-1 agreement of the attention rows (the key each
    query attends to most), both averaged over heads and real query tokens."""
    cosine, agree, count = 0.0, 0.0, 0.0
    for item in items:
        teacher, v = softmax_attention(module, item)
        student = rfa_attention(module, item)
        cos = torch.nn.functional.cosine_similarity(student @ v, teacher @ v, dim=-1)  # (B, H, T)
        same = (student.argmax(-1) == teacher.argmax(-1)).float()
        weight = item["query_valid"][:, None, :].float().expand_as(cos)
        cosine += (cos * weight).sum().item()
        agree += (same * weight).sum().item()
        count += weight.sum().item()
    return {"output_cosine": cosine / max(count, 1), "top1_agreement": agree / max(count, 1)}


def distillable_parameters(module) -> List[torch.nn.Parameter]:
    """The learned parts of an RFA module that a softmax layer lacks: a learned feature map and the gate."""
    # a random map's sigma is fitted in closed form instead (conversion/calibration.py: calibrate_sigma)
    params = [] if module.phi.uses_random_matrix else list(module.phi.parameters())
    if module.gate_proj is not None and module.causal:
        params += list(module.gate_proj.parameters())
    return params


def distill_attention(modules: Dict[str, torch.nn.Module], train_items: Dict[str, list], steps: int, lr: float,
                      loss: str = "ce", progress=None) -> List[float]:
    """Adam on the distillable parameters of every module, `steps` updates, one captured batch per
    update (cycling through train_items[name]); the layers' losses are summed (their parameters are
    disjoint, so each layer is fitted to its own teacher). Returns the summed loss of every update.

    The modules are put in eval mode (no dropout) and only their distillable parameters get gradients.
    """
    if loss not in DISTILL_LOSSES:
        raise ValueError(f"unknown distillation loss {loss!r}; expected one of {', '.join(DISTILL_LOSSES)}")
    params = {name: distillable_parameters(m) for name, m in modules.items()}
    trainable = [p for ps in params.values() for p in ps]
    if not trainable:
        return []
    frozen = {}
    for m in modules.values():
        m.eval()
        for p in m.parameters():
            frozen[p] = p.requires_grad
            p.requires_grad_(False)
    for p in trainable:
        p.requires_grad_(True)
    optimizer = torch.optim.Adam(trainable, lr=lr)
    # cosine decay to 10 %: the last steps settle instead of jumping around the optimum
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: 0.1 + 0.45 * (1 + math.cos(math.pi * min(step, steps) / max(steps, 1))))
    history = []
    try:
        for step in range(steps):
            total = 0.0
            optimizer.zero_grad(set_to_none=True)
            for name, module in modules.items():
                if not params[name]:
                    continue
                items = train_items[name]
                layer_loss = distillation_loss(module, items[step % len(items)], loss)
                layer_loss.backward()
                total += layer_loss.item()
            optimizer.step()
            schedule.step()
            history.append(total)
            if progress is not None:
                progress(step + 1, total)
    finally:
        for p, flag in frozen.items():
            p.requires_grad_(flag)
    return history


def distill_layers(modules: Dict[str, torch.nn.Module], captured: Dict[str, list], steps: int, lr: float,
                   loss: str = "ce", log=print, progress=None) -> dict:
    """distill_attention on the captured batches of each layer with the last tenth held out; logs and
    returns the per-layer fidelity on the held-out batches before and after."""
    held = {name: items[-max(1, len(items) // 10):] for name, items in captured.items() if name in modules}
    train = {name: items[: len(items) - len(held[name])] or items for name, items in captured.items() if name in modules}
    before = {name: attention_fidelity(m, held[name]) for name, m in modules.items()}
    device = next(next(iter(modules.values())).parameters()).device
    log(f"distilling {len(modules)} attention layers ({loss} loss, {steps} steps, lr {lr}, "
        f"{sum(len(v) for v in train.values()) // len(train)} batches of training sentences per layer, {device})")
    history = distill_attention(modules, train, steps, lr, loss, progress)
    report = {}
    for name, module in modules.items():
        after = attention_fidelity(module, held[name])
        report[name] = {"before": before[name], "after": after}
        log(f"{name}: held-out attention-output cosine {before[name]['output_cosine']:.3f} -> "
            f"{after['output_cosine']:.3f}, top-1 agreement {before[name]['top1_agreement']:.3f} -> "
            f"{after['top1_agreement']:.3f}")
    return {"loss": loss, "steps": steps, "lr": lr, "first_loss": history[0], "last_loss": history[-1], "layers": report}
