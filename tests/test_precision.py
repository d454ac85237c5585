"""bf16 and long inputs: RFA keeps its states in fp32 whatever the model dtype, so 8,192-token
training passes and 4,096-step decoding stay finite and close to fp32. CPU bf16 is what fairseq's
--bf16 would run (model.bfloat16()); fairseq 0.12.3's --fp16/--bf16 need a GPU/TPU trainer, so these
tests call the model directly."""
import copy

import pytest
import torch
from helpers import FP32_STATE, build_model, random_batch

from rfa_fairseq.config import RFAConfig
from rfa_fairseq.modules import RFAAttention
from rfa_fairseq.modules.decoding import DecodingState
from rfa_fairseq.kernel_choice import step_kernels
from rfa_fairseq.ops import causal_rfa_chunked, causal_rfa_recurrent, noncausal_rfa

LONG = 8192
DECODE_STEPS = 4096


def bf16_twin(module):
    """(fp32 module, bf16 module) with identical, bf16-representable weights."""
    module = module.bfloat16().float()
    return module, copy.deepcopy(module).bfloat16()


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("feature_map", ["sincos", "arccos", "positive"])
@pytest.mark.parametrize("role", ["causal_gated", "causal", "cross", "encoder_self"])
def test_bf16_attention_on_8192_tokens(role, feature_map):
    torch.manual_seed(0)
    causal = role.startswith("causal")
    module = RFAAttention(32, 4, self_attention=role != "cross", encoder_decoder_attention=role == "cross",
                          causal=causal, rfa=RFAConfig(rfa_num_features=16, rfa_feature_map=feature_map, rfa_gate=True))
    if role == "causal":
        module.gate_proj = None
    reference, module = bf16_twin(module)
    reference.train(), module.train()  # training draws: same (seed, update) in both
    x = torch.randn(LONG, 2, 32)
    source = torch.randn(LONG // 2, 2, 32)
    padding = torch.zeros(2, LONG // 2, dtype=torch.bool)
    padding[1, :100] = True  # left padding, as fairseq batches sources
    outputs, grads = [], []
    for m, dtype in ((reference, torch.float32), (module, torch.bfloat16)):
        inp = x.to(dtype).detach().clone().requires_grad_()
        if causal:
            out, _ = m(inp, inp, inp)
        elif role == "cross":
            src = source.to(dtype)
            out, _ = m(inp, src, src, key_padding_mask=padding)
        else:
            out, _ = m(inp, inp, inp)
        assert out.dtype == dtype
        out.float().pow(2).mean().backward()
        outputs.append(out.float())
        grads.append(inp.grad.float())
        for name, p in m.named_parameters():
            assert torch.isfinite(p.grad).all(), f"{name}.grad has inf/NaN"
    assert torch.isfinite(outputs[1]).all() and torch.isfinite(grads[1]).all()
    # bf16 has 8 mantissa bits: the inputs, projections and features are rounded (~0.4% each);
    # the fp32 states keep the sum over 8,192 positions from drifting further than that
    error = (outputs[1] - outputs[0]).abs().max() / outputs[0].abs().max()
    print(f"{role} {feature_map}: bf16 vs fp32 max error {error:.4f} of the output range")
    assert error < 0.05, f"bf16 output differs from fp32 by {error:.3f} of its range"


def test_states_are_accumulated_in_fp32_for_bf16_inputs():
    torch.manual_seed(0)
    phi_q, phi_k = torch.rand(2, 3, 300, 8).bfloat16(), torch.rand(2, 3, 300, 8).bfloat16()
    v = torch.randn(2, 3, 300, 4).bfloat16()
    log_gate = -torch.rand(2, 3, 300).bfloat16() * 0.1
    _, state = causal_rfa_chunked(phi_q, phi_k, v, log_gate, chunk_size=64)
    assert state.dtype == torch.float32
    _, state = causal_rfa_recurrent(phi_q[:, :, :5], phi_k[:, :, :5], v[:, :, :5], log_gate[:, :, :5])
    assert state.dtype == torch.float32
    state = torch.empty(2, 3, 8, 5)  # the step's fp32 state
    out = step_kernels("auto", torch.device("cpu"), torch.bfloat16).causal_layer_step(
        phi_q[:, :, 0].reshape(2, -1), phi_k[:, :, 0].reshape(2, -1), v[:, :, 0].reshape(2, -1), None, None, None, None,
        state, 1e-3)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(state, causal_rfa_recurrent(phi_q[:, :, :1], phi_k[:, :, :1], v[:, :, :1])[1])
    _, state = noncausal_rfa(phi_q, phi_k, v)
    assert state.dtype == torch.float32
    # the ungated z = sum phi(k) over 300 keys: bf16 accumulation would be off by several units
    exact = phi_k.double().sum(2)
    _, state = causal_rfa_chunked(phi_q, phi_k, v)
    assert torch.allclose(state[..., -1].double(), exact, rtol=1e-5)


def test_bf16_model_forward_backward_on_8192_tokens():
    """A whole tiny rfa_transformer, RFA in the encoder too (the long-input setting)."""
    # every attention is RFA, cross-attention included: the long-input setting never builds L x L scores
    model, d = build_model(["--rfa-num-features", "8", "--rfa-encoder-self-attn", "--rfa-gate", "--no-rfa-softmax-cross-attn",
                            "--max-source-positions", str(LONG + 2), "--max-target-positions", str(LONG + 2)])
    model = model.bfloat16().train()
    src, lengths, prev = random_batch(d, bsz=1, src_len=LONG, tgt_len=LONG, seed=1)
    logits, _ = model(src, lengths, prev)
    assert logits.dtype == torch.bfloat16 and logits.shape[1] == LONG
    loss = torch.nn.functional.cross_entropy(logits.float().view(-1, logits.size(-1)), prev.view(-1))
    loss.backward()
    assert torch.isfinite(loss)
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), f"{name}.grad has inf/NaN"


def _decoding_state_tensors(model, state):
    """(key, tensor) of the attention state the decoder keeps between steps: every causal layer's state
    buffers and the cross-attention's per-sentence K/V or states (fp32 and bf16 models alike)."""
    decoding = state[DecodingState.KEY]
    out = []
    for i, layer in enumerate(decoding.layers):
        out += [(f"layer{i}.self.states{j}", t) for j, t in enumerate(layer.self_attn.states)]
        if layer.cross is not None:
            out += [(f"layer{i}.cross.{name}", getattr(layer.cross, name)) for name in layer.cross.SENTENCE_TENSORS
                    if name != "key_bias" and getattr(layer.cross, name) is not None]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("gate", [False, True], ids=["ungated", "gated"])
def test_bf16_decoding_for_4096_steps_keeps_an_fp32_state(gate):
    # the fp32 reference keeps its state in fp32 too (the native step's default is fp16)
    model, d = build_model(["--rfa-num-features", "8", "--decoder-layers", "1", "--rfa-gate" if gate else "--no-rfa-gate",
                            *FP32_STATE], seed=2)
    model.eval()
    reference, model = bf16_twin(model)
    src, lengths, _ = random_batch(d, bsz=2, src_len=9)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(d.nspecial, len(d), (2, DECODE_STEPS), generator=g)
    tokens[:, 0] = d.eos()
    last, sizes = {}, {}
    with torch.no_grad():
        for name, m in (("fp32", reference), ("bf16", model)):
            encoder_out = m.encoder(src, src_lengths=lengths)
            state = {}
            for step in range(DECODE_STEPS):
                logits, _ = m.decoder(tokens[:, : step + 1], encoder_out=encoder_out, incremental_state=state)
                if step in (9, DECODE_STEPS - 1):
                    sizes[(name, step)] = sum(t.numel() for _, t in _decoding_state_tensors(m, state))
                if step in (15, DECODE_STEPS - 1):
                    last[(name, step)] = logits.float().log_softmax(-1)
            for key, tensor in _decoding_state_tensors(m, state):
                if ".self." in key:  # the causal states (K/V of softmax cross-attention are the model's dtype)
                    assert tensor.dtype == torch.float32, f"{name} {key} is {tensor.dtype}"
                    assert torch.isfinite(tensor).all(), f"{name} {key} has inf/NaN after {DECODE_STEPS} steps"
    for name in ("fp32", "bf16"):
        assert sizes[(name, 9)] == sizes[(name, DECODE_STEPS - 1)], f"the {name} decoding state must not grow"
    for step in (15, DECODE_STEPS - 1):
        assert torch.isfinite(last[("bf16", step)]).all()
        error = (last[("bf16", step)] - last[("fp32", step)]).abs().max().item()
        print(f"step {step + 1}: max |log p_bf16 - log p_fp32| = {error:.4f}")
        # bf16 weights/activations cost ~0.02 here at step 16; an fp32 state keeps step 4096 as close
        assert error < 0.1
