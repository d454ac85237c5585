"""The `rfa_transformer` model: fairseq's transformer with RFA attention, wired through hooks.

Training and scoring run fairseq's own forward passes through the `build_*` hooks. Incremental decoding
(fairseq-generate, fairseq-interactive, any SequenceGenerator) runs RFA's decoding step on every device and
dtype: RFATransformerDecoder.forward -> its DecodingState (modules/decoding.py) -> the native step (the CPU) or the
records' torch step (DecoderLayerRecord.step -> CausalRecord / SoftmaxCrossRecord.step), the kernels picked once per
runtime (kernel_choice.step_kernels). docs/design.md draws it.
Defaults follow the paper's MT setup: RFA in decoder self-attention and in encoder-decoder attention,
softmax encoder self-attention unless --rfa-encoder-self-attn.
"""
import argparse
import contextlib
import logging
import os
from dataclasses import dataclass
from typing import Callable, List, Optional

import torch
from torch import Tensor
from fairseq.distributed import fsdp_wrap
from fairseq.models import register_model, register_model_architecture
from fairseq.models.transformer import (
    TransformerDecoderBase,
    TransformerEncoderBase,
    TransformerModel,
    base_architecture,
    tiny_architecture,
    transformer_iwslt_de_en,
    transformer_vaswani_wmt_en_de_big,
    transformer_vaswani_wmt_en_fr_big,
    transformer_wmt_en_de,
    transformer_wmt_en_de_big,
)
from fairseq.modules import LearnedPositionalEmbedding, MultiheadAttention, SinusoidalPositionalEmbedding
from fairseq.modules.transformer_layer import TransformerDecoderLayerBase, TransformerEncoderLayerBase
from fairseq.modules.checkpoint_activations import checkpoint_wrapper
from omegaconf import OmegaConf

from .. import checkpoints, fairseq_mirrors
from ..config import RFAConfig, add_rfa_args, apply_rfa_defaults, flag, validate_rfa_args
from ..modules import RFAAttention, SoftmaxCrossAttention
from ..modules.decoding import (
    FFN_ACTIVATIONS,
    DecodingCache,
    DecodingRuntime,
    DecodingState,
    LayerCache,
    NormRecord,
    RuntimeCache,
    beam_layout,
    feed_forward,
    step_graphs_for,
)
from ..modules.encoding import EncodingRuntime
from ..modules.rfa_attention import CausalRecord
from ..gpu.triton_self_check import current as triton_trust
from ..gpu.triton_self_check import set_step_self_check
from ..kernel_choice import rfa_step_kernels


def decoding_options(rfa: RFAConfig) -> tuple:
    """The options that pick a runtime's kernels (kernel_choice.rfa_step_kernels): a runtime is built again when one
    changes."""
    return (rfa.rfa_decode_kernel, rfa.rfa_decode_precision, getattr(rfa, "rfa_decode_state", "auto"),
            getattr(rfa, "rfa_cpu_isa", "auto"))

logger = logging.getLogger(__name__)

RFA_CONFIG = "rfa_config"  # the model's RFAConfig, in the cfg that build_model hands to fairseq's builders

# called with (task, model) as RFATransformerModel.build_model returns a model: the rooms above this one keep what
# they need of a task's models through it (generation/batch_groups.py registers its record_model), so that models/
# imports nothing of theirs
MODEL_BUILT_HOOKS: List[Callable[[object, "RFATransformerModel"], None]] = []


def _wrap_layer(layer, cfg):
    """Activation checkpointing / FSDP wrapping, as fairseq's own build_*_layer hooks do."""
    checkpoint = cfg.checkpoint_activations
    if checkpoint:
        layer = checkpoint_wrapper(layer, offload_to_cpu=cfg.offload_activations)
    return fsdp_wrap(layer, min_num_params=cfg.min_params_to_wrap if not checkpoint else 0)


class RFATransformerEncoderLayer(TransformerEncoderLayerBase):
    def build_self_attention(self, embed_dim, cfg):
        return RFAAttention(embed_dim, cfg.encoder.attention_heads, dropout=cfg.attention_dropout, self_attention=True,
                            q_noise=self.quant_noise, qn_block_size=self.quant_noise_block_size,
                            rfa=getattr(cfg, RFA_CONFIG))


class RFATransformerDecoderLayer(TransformerDecoderLayerBase):
    """fairseq's decoder layer with RFA self-attention; it owns its part of the decoding step."""

    def build_self_attention(self, embed_dim, cfg, add_bias_kv=False, add_zero_attn=False):
        if add_bias_kv or add_zero_attn:
            raise ValueError("RFA decoder self-attention does not support add_bias_kv / add_zero_attn")
        return RFAAttention(embed_dim, cfg.decoder.attention_heads, dropout=cfg.attention_dropout, self_attention=True,
                            causal=True, q_noise=self.quant_noise, qn_block_size=self.quant_noise_block_size,
                            rfa=getattr(cfg, RFA_CONFIG))

    def build_encoder_attention(self, embed_dim, cfg):
        if getattr(cfg, RFA_CONFIG).rfa_softmax_cross_attn:
            return SoftmaxCrossAttention(embed_dim, cfg.decoder.attention_heads, kdim=cfg.encoder.embed_dim,
                                         vdim=cfg.encoder.embed_dim, dropout=cfg.attention_dropout,
                                         encoder_decoder_attention=True, q_noise=self.quant_noise,
                                         qn_block_size=self.quant_noise_block_size,
                                         xformers_att_config=cfg.encoder.xformers_att_config)
        return RFAAttention(embed_dim, cfg.decoder.attention_heads, kdim=cfg.encoder.embed_dim,
                            vdim=cfg.encoder.embed_dim, dropout=cfg.attention_dropout, encoder_decoder_attention=True,
                            q_noise=self.quant_noise, qn_block_size=self.quant_noise_block_size,
                            rfa=getattr(cfg, RFA_CONFIG))

    # ------------------------------------------------------------ the decoding step

    def decoding_record(self, kernels) -> "DecoderLayerRecord":
        """What the decoding step reads of this layer (built once per runtime): its attentions' records, its norms,
        its FFN's linear layers packed for the kernels."""
        for name in ("c_attn", "attn_ln", "ffn_layernorm", "w_resid"):  # fairseq's --scale-* options
            if getattr(self, name, None) is not None:
                raise ValueError(f"RFA incremental decoding does not support decoder layers with {name} (--scale-*)")
        cross = self.encoder_attn.decoding_record(kernels) if self.encoder_attn is not None else None
        with torch.no_grad():
            fc1 = kernels.pack_linear(self.fc1.weight.detach(), _detached(self.fc1.bias))
            fc2 = kernels.pack_linear(self.fc2.weight.detach(), _detached(self.fc2.bias))
        return DecoderLayerRecord(
            self.self_attn.decoding_record(kernels), NormRecord.of(self.self_attn_layer_norm), cross,
            NormRecord.of(self.encoder_attn_layer_norm) if cross is not None else None, fc1, fc2, self.activation_fn,
            NormRecord.of(self.final_layer_norm), self.normalize_before)


@dataclass
class DecoderLayerRecord:
    """A decoder layer's part of the decoding step: its causal attention's and cross-attention's records (cross None
    without encoder attention), its norms, its FFN's packed linear layers; post-norm or pre-norm (normalize_before).
    `step` is its part of the torch step; the native program reads the same fields by name
    (cpu/csrc/decode_program.cpp's DecoderLayerProgram::from)."""

    self_attn: CausalRecord
    self_attn_norm: NormRecord
    cross: Optional[object]
    cross_norm: Optional[NormRecord]
    fc1: object
    fc2: object
    activation_fn: object
    final_norm: NormRecord
    normalize_before: bool

    @property
    def activation(self) -> Optional[str]:
        """The FFN activation's name for the native program ("relu", "gelu"; None: it has none, the torch step runs)."""
        return FFN_ACTIVATIONS.get(self.activation_fn)

    def start(self, previous: Optional[LayerCache], rows: int, key: Optional[Tensor], key_padding_mask, source_len,
              runtime, state_buffers: int = 2) -> "tuple[LayerCache, bool]":
        """A batch's cache for this layer (reusing the previous batch's buffers where they fit). key: (S, sentences,
        C) encoder output, or None; source_len: the cross-attention's K/V length (>= S: padded, masked; None: S).
        With the native program, softmax cross-attention's K and V are left to it (DecodingState.start: one call for
        every layer). -> (the cache, whether a buffer is new)"""
        self_attn, allocated = self.self_attn.start(previous.self_attn if previous else None, rows, runtime.device,
                                                    runtime.kernels.state_dtype, state_buffers)
        cross = None
        if self.cross is not None and key is not None:
            fill = {"fill": runtime.program is None} if self.cross.kind == "softmax" else {}
            cross, new = self.cross.start(previous.cross if previous else None, key, key_padding_mask, source_len,
                                          runtime.kernels, **fill)
            allocated = allocated or new
        return LayerCache(self_attn, cross), allocated

    def step(self, kernels, x: Tensor, cache: LayerCache, state, order, key_pad, need_weights: bool):
        """x (R, C) the layer's input -> its output (R, C), the cross-attention weights (R, S) or None."""
        pre = self.normalize_before

        def sublayer_input(norm):
            return norm(kernels, x) if pre else x

        def residual_stream(norm, y):  # y: the sublayer's output with x already added
            return y if pre else norm(kernels, y)

        y = self.self_attn.step(kernels, sublayer_input(self.self_attn_norm), cache.self_attn, state, order, key_pad,
                                residual=x)
        x = residual_stream(self.self_attn_norm, y)
        weights = None
        if cache.cross is not None:
            y, weights = self.cross.step(kernels, sublayer_input(self.cross_norm), cache.cross, state.beam,
                                         need_weights, residual=x)
            x = residual_stream(self.cross_norm, y)
        y = feed_forward(kernels, sublayer_input(self.final_norm), self.fc1, self.fc2, self.activation_fn, residual=x)
        return residual_stream(self.final_norm, y), weights


def _detached(t: Optional[Tensor]) -> Optional[Tensor]:
    return None if t is None else t.detach()


class RFATransformerEncoder(TransformerEncoderBase):
    """fairseq's encoder with fairseq's softmax (default) or RFA self-attention layers. Inference where the decoding
    step is native (the CPU in fp32 weights) runs as one native call (modules/encoding.py's EncodingRuntime, built
    once per weights), which repeats fairseq's forward; fairseq's forward runs everything else."""

    def __init__(self, cfg, dictionary, embed_tokens, return_fc=False):
        super().__init__(cfg, dictionary, embed_tokens, return_fc=return_fc)
        self.rfa: RFAConfig = getattr(cfg, RFA_CONFIG)
        self._encoding = RuntimeCache()  # the native pass's runtime (None where it cannot run), per weights

    def build_encoder_layer(self, cfg):
        if not getattr(cfg, RFA_CONFIG).rfa_encoder_self_attn:
            return super().build_encoder_layer(cfg)  # fairseq's softmax layer
        return _wrap_layer(RFATransformerEncoderLayer(cfg, return_fc=self.return_fc), cfg)

    def train(self, mode: bool = True):
        if mode:  # a training step changes the weights through .data, which the runtime's key cannot see
            self._encoding.clear()
        return super().train(mode)

    def forward_scriptable(self, src_tokens, src_lengths: Optional[Tensor] = None, return_all_hiddens: bool = False,
                           token_embeddings: Optional[Tensor] = None):
        out = None
        if not (self.training or torch.is_grad_enabled() or return_all_hiddens or token_embeddings is not None):
            runtime = self.encoding_runtime()
            if runtime is not None:
                out = runtime.encode(self, src_tokens)
        if out is None:
            out = super().forward_scriptable(src_tokens, src_lengths, return_all_hiddens, token_embeddings)
        if self.rfa.rfa_shortlist and not out["src_tokens"]:
            # the decoder's shortlist reads the batch's sources there (fairseq's field for them, which its encoder
            # leaves empty and its reorder_encoder_out follows)
            out["src_tokens"] = [src_tokens]
        return out

    def encoding_runtime(self) -> Optional[EncodingRuntime]:
        """The native pass's runtime for the current weights and options, or None where fairseq's forward runs."""
        weight = self.embed_tokens.weight
        options = (*decoding_options(self.rfa), weight.device, weight.dtype)
        return self._encoding.get(self, options, self._build_runtime)

    def _build_runtime(self) -> Optional[EncodingRuntime]:
        if self._native_unsupported() is not None:
            return None
        weight = self.embed_tokens.weight
        try:
            kernels = rfa_step_kernels(self.rfa, weight.device, weight.dtype)
        except ValueError:  # options that cannot run here: fairseq's forward (the decoder names them)
            return None
        # a fairseq whose encoder is not the source the program repeats: its own forward, and a warning saying so
        if not kernels.native or not fairseq_mirrors.native_encoder_mirrors_hold():
            return None
        return EncodingRuntime(self, kernels)

    def _native_unsupported(self) -> Optional[str]:
        """What of this encoder the native pass does not run (fairseq's forward does), or None."""
        positions = self.embed_positions
        if self.quant_noise is not None:
            return "quant noise on the embeddings"
        if self.return_fc:
            return "return_fc"
        if positions is not None and (type(positions) not in (SinusoidalPositionalEmbedding, LearnedPositionalEmbedding)
                                      or positions.padding_idx is None):
            return f"position embeddings {type(positions).__name__}"
        for i, layer in enumerate(self.layers):
            if type(layer) is not TransformerEncoderLayerBase:
                return f"layer {i} is a {type(layer).__name__} (RFA self-attention, activation checkpointing, FSDP)"
            attn = layer.self_attn
            if (type(attn) is not MultiheadAttention or attn.bias_k is not None or attn.add_zero_attn
                    or attn.use_xformers):
                return f"layer {i}: self-attention with bias_kv, zero attention or xformers"
            if layer.return_fc:
                return f"layer {i}: return_fc"
            if layer.activation_fn not in FFN_ACTIVATIONS:
                return f"layer {i}: the FFN activation {getattr(layer.activation_fn, '__name__', layer.activation_fn)}"
        return None


class RFATransformerDecoder(TransformerDecoderBase):
    """fairseq's decoder with RFA layers. Incremental decoding runs the decoding step: the batch's DecodingState
    is started at its first step on the decoder's runtime (built once per weights), and every step runs in place
    from its buffers."""

    def __init__(self, cfg, dictionary, embed_tokens, no_encoder_attn=False, output_projection=None):
        super().__init__(cfg, dictionary, embed_tokens, no_encoder_attn=no_encoder_attn,
                         output_projection=output_projection)
        self.rfa: RFAConfig = getattr(cfg, RFA_CONFIG)
        self.beam_size = 1  # set by fairseq's SequenceGenerator (set_beam_size): rows per source sentence
        self._decoding = DecodingCache()  # the runtime (rebuilt when the weights change) and the last batch's buffers
        self._logged_kernels = None
        self._step_self_check = None  # (device, option, the verdicts' registry) last set for the step's Triton kernel
        self.source_dictionary = None  # the encoder's (RFATransformerModel.build_model): what the shortlist's rows are
        self._shortlist = None  # ((path, k, n), the Shortlist read for them): --rfa-shortlist, read once
        self._forced_tokens = None  # fairseq's generator's prefix and constraint tokens of the batch (forcing_tokens)

    def build_decoder_layer(self, cfg, no_encoder_attn=False):
        return _wrap_layer(RFATransformerDecoderLayer(cfg, no_encoder_attn), cfg)

    def train(self, mode: bool = True):
        if mode:  # a training step changes the weights through .data, which the runtime's key cannot see
            self._decoding.clear()
        return super().train(mode)

    def set_beam_size(self, beam_size: int) -> None:
        super().set_beam_size(beam_size)
        self.beam_size = int(beam_size)

    def buffered_future_mask(self, tensor):
        return None  # RFA's decoder self-attention is causal by construction: no T x T mask

    def forward(self, prev_output_tokens, encoder_out=None, incremental_state=None, features_only: bool = False,
                full_context_alignment: bool = False, alignment_layer=None, alignment_heads=None, src_lengths=None,
                return_all_hiddens: bool = False):
        if full_context_alignment:
            raise ValueError("full_context_alignment: RFA's decoder self-attention is causal by construction")
        if incremental_state is None:
            return super().forward(prev_output_tokens, encoder_out=encoder_out, features_only=features_only,
                                   alignment_layer=alignment_layer, alignment_heads=alignment_heads,
                                   src_lengths=src_lengths, return_all_hiddens=return_all_hiddens)
        self._check_can_decode(features_only, alignment_layer, alignment_heads, return_all_hiddens)
        state = incremental_state.get(DecodingState.KEY)
        if state is None:
            state = incremental_state[DecodingState.KEY] = self._start(prev_output_tokens, encoder_out)
        positions = None  # (R, C)
        if self.embed_positions is not None:
            positions = self.embed_positions(prev_output_tokens, incremental_state=incremental_state)[:, -1]
        logits, attn = state.step(prev_output_tokens[:, -1], positions)
        if state.output is not None:  # a shortlist's columns: fairseq's generator scores every token (-inf outside)
            logits = state.output.full_logits(logits, state.runtime.vocab_size)
        return logits.unsqueeze(1), {"attn": [attn.unsqueeze(1) if attn is not None else None], "inner_states": None}

    def _check_can_decode(self, *call_options) -> None:
        unsupported = self._step_unsupported(*call_options)
        if unsupported is not None:
            raise ValueError(f"RFA incremental decoding does not support {unsupported}")
        if self.training or torch.is_grad_enabled():
            raise RuntimeError("RFA incremental decoding runs the decoding step, without autograd and in eval mode: "
                               "call model.eval() and decode under torch.no_grad() (fairseq's generators do)")

    def _step_unsupported(self, features_only=False, alignment_layer=None, alignment_heads=None,
                          return_all_hiddens=False):
        """What of this call or model the decoding step cannot serve (None: everything)."""
        for name, value in (("features_only", features_only), ("alignment_heads", alignment_heads is not None),
                            ("return_all_hiddens", return_all_hiddens),
                            ("alignment_layer other than the last", alignment_layer not in (None, self.num_layers - 1)),
                            ("adaptive softmax", self.adaptive_softmax is not None),
                            ("decoder input/output dimension projections",
                             self.project_in_dim is not None or self.project_out_dim is not None),
                            ("quant noise on the embeddings", self.quant_noise is not None)):
            if value:
                return name
        return None

    def _start(self, prev_output_tokens, encoder_out) -> DecodingState:
        """A batch's first step (fairseq's generators): its DecodingState (on the buffers of the last batch, when that
        one has ended), K/V once per sentence when the encoder output holds each sentence `beam_size` times in a row
        (fairseq's beam search expands it so: checked on the values), else once per row."""
        rows = prev_output_tokens.size(0)
        key, pad = self.encoder_keys(encoder_out)
        beam = 1
        if key is not None and self.beam_size > 1 and beam_layout(key, pad, self.beam_size):
            beam = self.beam_size
            key, pad = key[:, ::beam], (pad[::beam] if pad is not None else None)  # (S, sentences, C): one per sentence
        state = DecodingState(graphs=step_graphs_for(self.embed_tokens.weight.device, self.rfa.rfa_cuda_graphs))
        state.start(self.decoding_runtime(), rows, beam, key, pad, buffers=self._decoding.buffers_for(state))
        shortlist = self.shortlist()
        if shortlist is not None:
            sources = encoder_out.get("src_tokens", []) if encoder_out is not None else []
            if not len(sources):
                raise ValueError(f"{flag('rfa_shortlist')}: the encoder output holds no src_tokens, which the "
                                 "shortlist's union is made of (RFATransformerEncoder puts them there)")
            state.restrict_output(shortlist.union(sources[0], self._forced_tokens))
        return state

    def shortlist(self):
        """The vocabulary shortlist of --rfa-shortlist (shortlist.Shortlist, its first --rfa-shortlist-k candidates and
        --rfa-shortlist-n frequent tokens), read once per (path, K, N) and checked against the model's dictionaries;
        None without the option. A ShortlistError naming the option and the file where it cannot be used."""
        from ..shortlist import Shortlist, ShortlistError

        path = self.rfa.rfa_shortlist
        if not path:
            return None
        key = (os.fspath(path), self.rfa.rfa_shortlist_k, self.rfa.rfa_shortlist_n)
        if self._shortlist is None or self._shortlist[0] != key:
            if self.source_dictionary is None:
                raise ShortlistError(f"{flag('rfa_shortlist')} {key[0]}: the decoder has no source dictionary to check "
                                     "it against (RFATransformerModel.build_model sets the encoder's)")
            try:
                shortlist = Shortlist.load(key[0], self.source_dictionary, self.dictionary, k=key[1], n=key[2])
            except ShortlistError as error:
                picked = "".join(f", {name}={value}" for name, value in (("rfa_shortlist_k", key[1]),
                                                                         ("rfa_shortlist_n", key[2])) if value is not None)
                raise ShortlistError(f"{flag('rfa_shortlist')} (the model option rfa_shortlist{picked}): {error}") from None
            self._shortlist = (key, shortlist)
        return self._shortlist[1]

    @contextlib.contextmanager
    def forcing_tokens(self, *tokens):
        """Within it, the shortlist's union of each batch fairseq's generator starts also holds `tokens` (tensors or
        None: its prefix tokens, its constraints' tokens), which the generator forces: none is dropped."""
        self._forced_tokens = [t.reshape(-1) for t in tokens if t is not None and t.numel()] or None
        if self._forced_tokens is not None:
            self._forced_tokens = torch.cat([t.to(torch.long) for t in self._forced_tokens])
        try:
            yield
        finally:
            self._forced_tokens = None

    def encoder_keys(self, encoder_out):
        """The encoder output (S, rows, C) and its padding mask (rows, S) that cross-attention reads, or Nones."""
        if encoder_out is None or not len(encoder_out.get("encoder_out", [])) or self.layers[0].encoder_attn is None:
            return None, None
        pad = encoder_out["encoder_padding_mask"][0] if len(encoder_out.get("encoder_padding_mask", [])) else None
        return encoder_out["encoder_out"][0], pad

    def decoding_runtime(self) -> DecodingRuntime:
        """The runtime every batch decodes on: the kernels of --rfa-decode-kernel / --rfa-decode-precision for the
        weights' device and dtype, the layers' records, the native program. Built once and again only when a
        parameter or buffer changes (or after training, which updates them through .data). Sets whether the step's
        Triton kernel is self-checked on the weights' device (--rfa-triton-self-check): its calls take no options."""
        self._check_can_decode()
        self_check = (self.embed_tokens.weight.device, self.rfa.rfa_triton_self_check, id(triton_trust()))
        if self._step_self_check != self_check:  # set when it changes (each batch asks for the runtime)
            set_step_self_check(*self_check[:2])
            self._step_self_check = self_check
        return self._decoding.get(self, self._runtime_options(), self._build_runtime)

    def _build_runtime(self) -> DecodingRuntime:
        kernels = self._step_kernels()
        if self._logged_kernels != (kernels.name, kernels.gemm):  # once per decoder (and when the choice changes)
            self._logged_kernels = (kernels.name, kernels.gemm)
            logger.info(f"rfa_fairseq: decoding step: {'native' if kernels.native else 'torch'} "
                        f"({kernels.name}); linear layers: {kernels.gemm}")
        return DecodingRuntime(self, kernels)

    def _step_kernels(self):
        weight = self.embed_tokens.weight
        return rfa_step_kernels(self.rfa, weight.device, weight.dtype, self._native_unsupported())

    def decodes_natively(self) -> bool:
        """Whether decoding_runtime() runs the native program (the CPU), known without building it."""
        return self._step_kernels().native

    def has_decoding_runtime(self) -> bool:
        """Whether decoding_runtime() has its runtime built for the current weights and options (the static beam
        search then skips its warm-up: hub.translate builds a generator per call)."""
        return self._decoding.has_runtime(self, self._runtime_options())

    def _runtime_options(self) -> tuple:
        weight = self.embed_tokens.weight
        return (*decoding_options(self.rfa), weight.device, weight.dtype)

    def _native_unsupported(self) -> Optional[str]:
        """What of this decoder the native program cannot run (then the kernel choice takes the torch step), or None."""
        for layer in self.layers:
            if layer.activation_fn not in FFN_ACTIVATIONS:
                return f"the FFN activation {getattr(layer.activation_fn, '__name__', layer.activation_fn)}"
        return None

    @torch.no_grad()
    def step_positions(self, length: int) -> Optional[Tensor]:
        """(length, C): the position embeddings that incremental decoding adds at steps 0 .. length - 1 (those of
        target positions 1 .. length), or None without position embeddings."""
        if self.embed_positions is None:
            return None
        tokens = torch.full((1, length), self.dictionary.eos(), dtype=torch.long, device=self.embed_tokens.weight.device)
        return self.embed_positions(tokens)[0]

    def reorder_incremental_state_scripting(self, incremental_state, new_order):
        state = incremental_state.get(DecodingState.KEY)
        if state is not None:
            state.reorder(new_order)


@register_model("rfa_transformer")
class RFATransformerModel(TransformerModel):
    """Transformer with Random Feature Attention (Peng et al., ICLR 2021)."""

    @classmethod
    def add_args(cls, parser):
        super().add_args(parser)
        add_rfa_args(parser)

    @classmethod
    def build_model(cls, args, task):
        if OmegaConf.is_config(args):
            # fairseq-hydra-train passes a DictConfig; TransformerConfig.from_namespace would
            # drop every field it does not know (all rfa_* options) from it, not from a Namespace
            args = argparse.Namespace(**OmegaConf.to_container(args, resolve=True))
        rfa_base_architecture(args)
        validate_rfa_args(args)
        # the RFAConfig rides in args only while fairseq builds the model (its cfg copies it for the hooks):
        # args are saved in checkpoints, which hold plain values only
        setattr(args, RFA_CONFIG, RFAConfig.from_args(args))
        try:
            with checkpoints.parameters_left_unset():  # a checkpoint's load sets them all, from its mapped pages
                model = super().build_model(args, task)
        finally:
            delattr(args, RFA_CONFIG)
        # fairseq-hydra-train hands over the config's model section alone, without common.seed; both CLIs seed
        # torch with it just before building the model
        seed = getattr(args, "seed", None)
        model.set_random_feature_seed(torch.initial_seed() if seed is None else seed)
        # a checkpoint loaded mapped lends the parameters its pages instead of being copied into them
        model.register_load_state_dict_pre_hook(checkpoints.share_mapped_tensors)
        model.decoder.source_dictionary = model.encoder.dictionary
        if args.rfa_shortlist:
            model.decoder.shortlist()  # read now: a missing or mismatched file is an error at load, naming the option
        for hook in MODEL_BUILT_HOOKS:
            hook(task, model)
        return model

    @classmethod
    def build_encoder(cls, cfg, src_dict, embed_tokens):
        return RFATransformerEncoder(cfg, src_dict, embed_tokens)

    @classmethod
    def build_decoder(cls, cfg, tgt_dict, embed_tokens):
        return RFATransformerDecoder(cfg, tgt_dict, embed_tokens, no_encoder_attn=cfg.no_cross_attention)

    prepared_for_inference = False  # set by prepare_for_inference_ (generation/batch_groups.py reads it)

    def prepare_for_inference_(self, cfg):
        """fairseq-generate, fairseq-interactive and the hub call this before they ask their task for batches."""
        super().prepare_for_inference_(cfg)
        self.prepared_for_inference = True

    def set_beam_size(self, beam_size: int) -> None:
        """Called by fairseq's SequenceGenerator: RFA cross-attention keeps one state per sentence."""
        self.decoder.set_beam_size(beam_size)

    @property
    def rfa_config(self) -> RFAConfig:
        """The model's RFA options (fairseq-generate's --model-overrides included)."""
        return self.decoder.rfa

    def rfa_modules(self):
        return [m for m in self.modules() if isinstance(m, RFAAttention)]

    def load_state_dict(self, state_dict, strict=True, model_cfg=None, args=None):
        if strict:  # strict=False callers (weight conversion) expect missing RFA entries
            self.check_rfa_state_dict(state_dict)
        return super().load_state_dict(state_dict, strict=strict, model_cfg=model_cfg, args=args)

    def check_rfa_state_dict(self, state_dict) -> None:
        """Name the RFA option when a checkpoint was trained with other RFA options than this model
        was built with (fairseq-generate --model-overrides, a changed fairseq-train command line),
        instead of torch's size mismatch or missing/unexpected keys."""
        from ..config import RFAOptionMismatchError, flag

        suffix = ".eval_random_matrix"
        own = {k[: -len(suffix)]: v.shape for k, v in self.state_dict().items() if k.endswith(suffix)}
        saved = {k[: -len(suffix)]: tuple(v.shape) for k, v in state_dict.items() if k.endswith(suffix)}
        if own and not saved:
            raise RFAOptionMismatchError(
                "the checkpoint has no RFA attention (no *.eval_random_matrix entries): it is a softmax transformer "
                "checkpoint. Convert it first: rfa-convert-transformer --input CKPT --output RFA_CKPT "
                "(scripts/convert_transformer_to_rfa.py), then fine-tune with --finetune-from-model RFA_CKPT"
            )
        problems = []

        def has(modules, role):
            return any(name.endswith(role) for name in modules)

        # (option, role of the attention module, whether the option being set means that role uses RFA)
        for option, role, rfa_when_set in (
            ("rfa_encoder_self_attn", "self_attn", True),
            ("rfa_softmax_cross_attn", "encoder_attn", False),
        ):
            side = "encoder." if option == "rfa_encoder_self_attn" else "decoder."
            in_ckpt = has([n for n in saved if n.startswith(side)], role)
            in_model = has([n for n in own if n.startswith(side)], role)
            if in_ckpt != in_model:
                trained_with = in_ckpt == rfa_when_set
                problems.append(
                    f"{flag(option)}: the checkpoint was trained {'with' if trained_with else 'without'} it, "
                    f"the model was built {'without' if trained_with else 'with'} it"
                )
        for name in sorted(set(own) & set(saved)):
            (heads, model_d, head_dim), (c_heads, ckpt_d, c_head_dim) = own[name], saved[name]
            if (heads, head_dim) == (c_heads, c_head_dim) and model_d != ckpt_d:
                problems.append(
                    f"{flag('rfa_num_features')}: the checkpoint was trained with {ckpt_d}, the model was built with "
                    f"{model_d} ({name}{suffix}: {tuple(saved[name])} vs {tuple(own[name])})"
                )
                break
        gate_key = ".gate_proj.weight"
        ckpt_gated = any(k.endswith(gate_key) for k in state_dict)
        model_gated = any(m.gate_proj is not None for m in self.rfa_modules())
        if ckpt_gated != model_gated:
            problems.append(
                f"{flag('rfa_gate')}: the checkpoint was trained {'with' if ckpt_gated else 'without'} it, "
                f"the model was built {'without' if ckpt_gated else 'with'} it"
            )
        if problems:
            raise RFAOptionMismatchError(
                "the checkpoint was trained with other RFA options than this model: " + "; ".join(problems)
                + ". Use the options the checkpoint was trained with (drop them from --model-overrides or "
                "the command line)."
            )

    def set_random_feature_seed(self, seed: int) -> None:
        """Number the RFA modules in a fixed order so draws depend on (seed, update, layer) only."""
        for index, module in enumerate(self.rfa_modules()):
            module.set_random_feature_seed(seed, index)


# ---------------------------------------------------------------- architectures


@register_model_architecture("rfa_transformer", "rfa_transformer")
def rfa_base_architecture(args):
    apply_rfa_defaults(args)
    base_architecture(args)


def _rfa_architecture(name, transformer_architecture):
    @register_model_architecture("rfa_transformer", name)
    def architecture(args):
        apply_rfa_defaults(args)
        transformer_architecture(args)

    architecture.__name__ = name
    return architecture


rfa_transformer_iwslt_de_en = _rfa_architecture("rfa_transformer_iwslt_de_en", transformer_iwslt_de_en)
rfa_transformer_wmt_en_de = _rfa_architecture("rfa_transformer_wmt_en_de", transformer_wmt_en_de)
rfa_transformer_wmt_en_de_big = _rfa_architecture("rfa_transformer_wmt_en_de_big", transformer_wmt_en_de_big)
rfa_transformer_vaswani_wmt_en_de_big = _rfa_architecture(
    "rfa_transformer_vaswani_wmt_en_de_big", transformer_vaswani_wmt_en_de_big
)
rfa_transformer_vaswani_wmt_en_fr_big = _rfa_architecture(
    "rfa_transformer_vaswani_wmt_en_fr_big", transformer_vaswani_wmt_en_fr_big
)
rfa_transformer_tiny = _rfa_architecture("rfa_transformer_tiny", tiny_architecture)
