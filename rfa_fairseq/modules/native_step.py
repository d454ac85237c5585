"""The native decoding step (ops/csrc/decode_program.cpp) built from a DecodingRuntime's records, and a batch's
buffers as the program reads them.

The program is the records' torch step (modules/decoding.py) compiled ahead of time: the same fields, read once
here into the C++ structures (decode_program.h), so a step is one call without Python between its operations.
`unsupported` names what of a decoder the program cannot run; the kernel choice (ops.step_kernels) then takes the
torch step.
"""
from typing import List, Optional

import torch
import torch.nn.functional as F
from fairseq.modules.gelu import gelu as fairseq_gelu

FFN_ACTIVATIONS = {F.relu: "relu", fairseq_gelu: "gelu", F.gelu: "gelu"}
NONE = torch.empty(0)  # the program's "absent" tensor


def unsupported(decoder) -> Optional[str]:
    """What of `decoder` (an RFATransformerDecoder) the native program cannot run, or None."""
    for layer in decoder.layers:
        if layer.activation_fn not in FFN_ACTIVATIONS:
            return f"the FFN activation {getattr(layer.activation_fn, '__name__', layer.activation_fn)}"
    return None


def build_program(runtime):
    """The native program of `runtime` (its kernels are native: ops.NativeKernels)."""
    kernels = runtime.kernels
    ext = kernels.ext
    program = kernels.new_program()
    program.embed = runtime.embed.contiguous()
    program.embed_scale = runtime.embed_scale
    program.padding_idx = runtime.padding_idx
    if runtime.embed_norm is not None:
        program.embed_norm = _norm(ext, runtime.embed_norm)
    if runtime.final_norm is not None:
        program.final_norm = _norm(ext, runtime.final_norm)
    program.output = kernels.native_linear(runtime.output)
    program.layers = [_layer(ext, kernels, record) for record in runtime.layers]
    return program


def _layer(ext, kernels, record):
    layer = ext.DecoderLayerProgram()
    causal = ext.CausalAttention()
    self_attn = record.self_attn
    causal.proj, causal.out_proj = kernels.native_linear(self_attn.proj), kernels.native_linear(self_attn.out_proj)
    causal.map = _feature_map(ext, self_attn.map, self_attn.q_width // self_attn.heads, self_attn.features)
    causal.heads, causal.head_dim, causal.gated, causal.eps = (self_attn.heads, self_attn.head_dim, self_attn.gated,
                                                               self_attn.eps)
    layer.self_attn = causal
    layer.self_attn_norm = _norm(ext, record.self_attn_norm)
    cross = ext.CrossAttention()
    if record.cross is not None:
        rec = record.cross
        cross.q_proj, cross.out_proj = kernels.native_linear(rec.q_proj), kernels.native_linear(rec.out_proj)
        cross.heads, cross.head_dim = rec.heads, rec.head_dim
        if hasattr(rec, "scaling"):  # softmax cross-attention
            cross.kind, cross.scaling = ext.cross_kinds["softmax"], rec.scaling
        else:  # RFA cross-attention
            cross.kind, cross.eps = ext.cross_kinds["rfa"], rec.eps
            cross.map = _feature_map(ext, rec.map, rec.q_width // rec.heads, rec.attention.phi.output_dim)
        layer.cross_norm = _norm(ext, record.cross_norm)
    else:
        cross.kind = ext.cross_kinds["none"]
    layer.cross = cross
    layer.fc1, layer.fc2 = kernels.native_linear(record.fc1), kernels.native_linear(record.fc2)
    layer.ffn_activation = ext.ffn_activations[FFN_ACTIVATIONS[record.activation_fn]]
    layer.final_norm = _norm(ext, record.final_norm)
    layer.normalize_before = record.normalize_before
    return layer


def _feature_map(ext, record, width: int, features: int):
    spec = ext.FeatureMapSpec()
    spec.kind = ext.activations[record.kind]
    spec.width, spec.features = width, features
    if record.random_matrix is not None and record.activation is None and record.sigma is not None:
        spec.sigma, spec.matrix = record.sigma, record.random_matrix
    return spec


def _norm(ext, record):
    norm = ext.Norm()
    norm.weight, norm.bias, norm.eps = record.weight.contiguous(), record.bias.contiguous(), record.eps
    return norm


def native_batch(ext, layers: List, beam: int):
    """The program's view of a batch's caches (their own tensors; empty tensors where a layer has none)."""
    batch = ext.NativeBatch()
    batch.states0 = [layer.self_attn.states[0] for layer in layers]
    batch.states1 = [layer.self_attn.states[1] for layer in layers]
    batch.keys = [_or_none(getattr(layer.cross, "key", None)) for layer in layers]
    batch.values = [_or_none(getattr(layer.cross, "value", None)) for layer in layers]
    batch.key_biases = [_or_none(getattr(layer.cross, "key_bias", None)) for layer in layers]
    batch.cross_states = [_or_none(getattr(layer.cross, "rfa_state", None)) for layer in layers]
    batch.beam = beam
    return batch


def _or_none(t):
    return NONE if t is None else t
