"""Attention distillation (rfa_fairseq/conversion/distillation.py): the attention matrix RFA applies, and fitting a
learned feature map and the gate to a softmax layer's attention."""
import pytest
import torch

from rfa_fairseq.conversion.distillation import (
    DISTILL_LOSSES,
    attention_fidelity,
    distill_attention,
    distillable_parameters,
    distillation_loss,
    softmax_attention,
)
from rfa_fairseq.config import RFAConfig
from rfa_fairseq.modules import RFAAttention
from rfa_fairseq.ops import causal_rfa_reference, gate_keys, noncausal_rfa_reference, rfa_attention_weights


@pytest.mark.parametrize("gated", [False, True])
def test_attention_weights_reproduce_the_causal_reference(gated):
    torch.manual_seed(0)
    phi_q, phi_k = torch.rand(2, 3, 7, 8, dtype=torch.float64), torch.rand(2, 3, 7, 8, dtype=torch.float64)
    v = torch.randn(2, 3, 7, 5, dtype=torch.float64)
    log_gate = torch.nn.functional.logsigmoid(torch.randn(2, 3, 7, dtype=torch.float64)) if gated else None
    weights = rfa_attention_weights(phi_q, phi_k, log_gate)
    expected, _ = causal_rfa_reference(phi_q, phi_k, v, log_gate)
    torch.testing.assert_close(weights @ v, expected)
    assert torch.all(weights.triu(1) == 0), "a query must not see later keys"
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 3, 7, dtype=torch.float64))


def test_attention_weights_reproduce_the_noncausal_reference():
    torch.manual_seed(0)
    phi_q, phi_k = torch.rand(2, 3, 4, 8, dtype=torch.float64), torch.rand(2, 3, 9, 8, dtype=torch.float64)
    v = torch.randn(2, 3, 9, 5, dtype=torch.float64)
    expected, _ = noncausal_rfa_reference(phi_q, phi_k, v)
    torch.testing.assert_close(rfa_attention_weights(phi_q, phi_k, causal=False) @ v, expected)
    with pytest.raises(ValueError, match="gate exists only in causal"):
        rfa_attention_weights(phi_q, phi_k, torch.zeros(2, 3, 9), causal=False)


def _layer_and_batches(seed=0, batches=6, length=9, sharpness=4.0, vocabulary=12):
    """A decoder self-attention layer whose q/k projections make sharp softmax attention (as trained
    models have), and batches of its inputs in the captured layout, with right padding. Inputs are
    noisy embeddings of a small vocabulary: like a language, a pattern seen in training recurs later."""
    torch.manual_seed(seed)
    embeddings = torch.randn(vocabulary, 32)
    module = RFAAttention(32, 2, self_attention=True, causal=True,
                          rfa=RFAConfig(rfa_feature_map="hedgehog", rfa_num_features=16, rfa_gate=True))
    with torch.no_grad():
        module.q_proj.weight.mul_(sharpness)
        module.k_proj.weight.mul_(sharpness)
        module.gate_proj.weight.zero_()
        module.gate_proj.bias.fill_(4.0)  # the converter's start: a slow, uniform decay
    items = []
    for _ in range(batches):
        x = embeddings[torch.randint(vocabulary, (length, 3))] + 0.1 * torch.randn(length, 3, 32)  # (T, B, C)
        pad = torch.zeros(3, length, dtype=torch.bool)
        pad[1, length - 3:] = True  # a shorter sentence
        items.append({"query": x, "key": x, "value": x, "key_padding_mask": pad, "query_valid": ~pad})
    return module, items


def test_the_softmax_side_is_causal_and_masks_padding():
    module, items = _layer_and_batches()
    weights, v = softmax_attention(module, items[0])
    assert torch.all(weights.triu(1) == 0)
    assert torch.all(weights[1, :, :, -3:] == 0), "padded keys must get no weight"
    assert v.shape == (3, 2, 9, 16)


def test_only_the_feature_map_and_gate_are_distilled():
    module, _ = _layer_and_batches()
    names = {id(p): n for n, p in module.named_parameters()}
    assert sorted(names[id(p)] for p in distillable_parameters(module)) == [
        "gate_proj.bias", "gate_proj.weight", "phi.bias", "phi.weight"]
    random_map = RFAAttention(32, 2, self_attention=True, causal=True, rfa=RFAConfig(rfa_feature_map="sincos", rfa_gate=False))
    assert distillable_parameters(random_map) == [], "sigma of a random map is fitted, not distilled"


@pytest.mark.parametrize("loss", DISTILL_LOSSES)
def test_distillation_lowers_the_attention_mismatch(loss):
    module, items = _layer_and_batches(batches=16)
    train, held_out = items[:-4], items[-4:]
    frozen = {n: p.detach().clone() for n, p in module.named_parameters() if not n.startswith(("phi.", "gate_proj."))}
    before_loss = sum(distillation_loss(module, item, loss).item() for item in held_out)
    before = attention_fidelity(module, held_out)
    history = distill_attention({"layer": module}, {"layer": train}, steps=200, lr=1e-2, loss=loss)
    after = attention_fidelity(module, held_out)
    after_loss = sum(distillation_loss(module, item, loss).item() for item in held_out)
    print(f"{loss}: held-out loss {before_loss:.4f} -> {after_loss:.4f}, {before} -> {after}")
    assert len(history) == 200 and history[-1] < history[0]
    assert after_loss < 0.7 * before_loss
    assert after["output_cosine"] > before["output_cosine"]
    assert after["top1_agreement"] > before["top1_agreement"] + 0.1
    for name, value in module.named_parameters():
        if name in frozen:
            assert torch.equal(value, frozen[name]), f"{name} must stay frozen"
        assert value.requires_grad, "requires_grad must be restored"


def test_distillation_matches_what_the_layer_computes():
    """The distilled matrix is the one the layer applies: weights @ v == the module's own output."""
    module, items = _layer_and_batches()
    item = items[0]
    module.eval()
    with torch.no_grad():
        x = item["query"]
        w = module.random_matrix()
        phi_q = module.features(module.q_proj(x), w, is_query=True)
        phi_k = module.features(module.k_proj(x), w, is_query=False)
        phi_k, log_gate = gate_keys(phi_k, module.gate_proj(x).permute(1, 2, 0), item["key_padding_mask"])
        v = module._heads(module.v_proj(x))
        weights = rfa_attention_weights(phi_q, phi_k, log_gate, eps=module.eps)
        seen = {}
        handle = module.out_proj.register_forward_pre_hook(lambda m, args: seen.setdefault("x", args[0]))
        length = x.size(0)
        module(x, x, x, key_padding_mask=item["key_padding_mask"])
        handle.remove()
    out = (weights @ v.to(weights.dtype)).permute(2, 0, 1, 3).reshape(length, 3, 32)  # (T, B, C)
    valid = item["query_valid"].t()  # (T, B)
    torch.testing.assert_close(out[valid].float(), seen["x"][valid].float(), atol=1e-5, rtol=1e-4)
