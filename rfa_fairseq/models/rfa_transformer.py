"""The `rfa_transformer` model: fairseq's transformer with RFA attention, wired through hooks.

Only `build_*` hooks are overridden; every forward pass is fairseq's own.
Defaults follow the paper's MT setup: RFA in decoder self-attention and in
encoder-decoder attention, softmax encoder self-attention unless --rfa-encoder-self-attn.
"""
import argparse

import torch
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
from fairseq.modules.transformer_layer import TransformerDecoderLayerBase, TransformerEncoderLayerBase
from fairseq.modules.checkpoint_activations import checkpoint_wrapper
from omegaconf import OmegaConf

from ..config import add_rfa_args, apply_rfa_defaults, validate_rfa_args
from ..modules import RFAAttention
from ..modules.static_decoding import StaticDecodeState, Workspace


def rfa_attention_options(cfg) -> dict:
    """The RFAAttention keyword arguments of a model cfg: its rfa_* options, unpacked once per layer."""
    return dict(
        feature_map=str(cfg.rfa_feature_map),
        num_features=cfg.rfa_num_features,
        random_matrix=str(cfg.rfa_random_matrix),
        fixed_random_matrix=bool(getattr(cfg, "rfa_fixed_random_matrix", False)),
        sigma=str(cfg.rfa_sigma),
        sigma_lr_multiplier=float(cfg.rfa_sigma_lr_multiplier),
        temperature=float(cfg.rfa_temperature),
        gate=bool(cfg.rfa_gate),
        chunk_size=cfg.rfa_chunk_size,
        decode_kernel=str(getattr(cfg, "rfa_decode_kernel", "auto")),
        sequence_kernel=str(getattr(cfg, "rfa_sequence_kernel", "auto")),
    )


def _wrap_layer(layer, cfg):
    """Activation checkpointing / FSDP wrapping, as fairseq's own build_*_layer hooks do."""
    checkpoint = cfg.checkpoint_activations
    if checkpoint:
        layer = checkpoint_wrapper(layer, offload_to_cpu=cfg.offload_activations)
    return fsdp_wrap(layer, min_num_params=cfg.min_params_to_wrap if not checkpoint else 0)


class RFATransformerEncoderLayer(TransformerEncoderLayerBase):
    def build_self_attention(self, embed_dim, cfg):
        return RFAAttention(
            embed_dim,
            cfg.encoder.attention_heads,
            dropout=cfg.attention_dropout,
            self_attention=True,
            q_noise=self.quant_noise,
            qn_block_size=self.quant_noise_block_size,
            **rfa_attention_options(cfg),
        )


class RFATransformerDecoderLayer(TransformerDecoderLayerBase):
    def build_self_attention(self, embed_dim, cfg, add_bias_kv=False, add_zero_attn=False):
        if add_bias_kv or add_zero_attn:
            raise ValueError("RFA decoder self-attention does not support add_bias_kv / add_zero_attn")
        return RFAAttention(
            embed_dim,
            cfg.decoder.attention_heads,
            dropout=cfg.attention_dropout,
            self_attention=True,
            causal=True,
            q_noise=self.quant_noise,
            qn_block_size=self.quant_noise_block_size,
            **rfa_attention_options(cfg),
        )

    def build_encoder_attention(self, embed_dim, cfg):
        if cfg.rfa_softmax_cross_attn:
            return super().build_encoder_attention(embed_dim, cfg)
        return RFAAttention(
            embed_dim,
            cfg.decoder.attention_heads,
            kdim=cfg.encoder.embed_dim,
            vdim=cfg.encoder.embed_dim,
            dropout=cfg.attention_dropout,
            encoder_decoder_attention=True,
            q_noise=self.quant_noise,
            qn_block_size=self.quant_noise_block_size,
            **rfa_attention_options(cfg),
        )


class RFATransformerEncoder(TransformerEncoderBase):
    # encoder_out entry: the source row each row is a copy of (beam search copies every sentence beam times)
    ROW_SOURCE = "rfa_row_source"

    def build_encoder_layer(self, cfg):
        if not cfg.rfa_encoder_self_attn:
            return super().build_encoder_layer(cfg)
        return _wrap_layer(RFATransformerEncoderLayer(cfg, return_fc=self.return_fc), cfg)

    def reorder_encoder_out(self, encoder_out, new_order):
        """fairseq's reorder, skipped when it would replace every row by an identical copy: beam search
        reorders within each sentence's beams at every step, and those rows are copies of one source row.
        Which rows are copies of which is recorded at the first reorder (the expansion to beams)."""
        if not encoder_out["encoder_out"]:
            return super().reorder_encoder_out(encoder_out, new_order)
        rows = encoder_out["encoder_out"][0].size(1)
        recorded = encoder_out.get(self.ROW_SOURCE)
        source = recorded[0] if recorded else torch.arange(rows, device=new_order.device)
        new_source = source.index_select(0, new_order)
        if new_source.numel() == rows and torch.equal(new_source, source):
            return encoder_out
        reordered = super().reorder_encoder_out(encoder_out, new_order)
        reordered[self.ROW_SOURCE] = [new_source]
        return reordered


class RFATransformerDecoder(TransformerDecoderBase):
    """fairseq's decoder with RFA layers; incremental decoding without autograd runs the static step
    (modules/static_decoding.py) unless --no-rfa-static-decode or the model needs what it lacks."""

    def __init__(self, cfg, dictionary, embed_tokens, no_encoder_attn=False, output_projection=None):
        super().__init__(cfg, dictionary, embed_tokens, no_encoder_attn=no_encoder_attn,
                         output_projection=output_projection)
        self.static_decode = bool(getattr(cfg, "rfa_static_decode", True))
        self.static_unsupported = StaticDecodeState.supports(self)  # None, or why the eager path runs
        self._static_workspace = None

    def build_decoder_layer(self, cfg, no_encoder_attn=False):
        return _wrap_layer(RFATransformerDecoderLayer(cfg, no_encoder_attn), cfg)

    def forward(self, prev_output_tokens, encoder_out=None, incremental_state=None, features_only: bool = False,
                full_context_alignment: bool = False, alignment_layer=None, alignment_heads=None, src_lengths=None,
                return_all_hiddens: bool = False):
        static = None
        if incremental_state is not None and not (features_only or full_context_alignment or return_all_hiddens
                                                  or alignment_heads is not None
                                                  or alignment_layer not in (None, self.num_layers - 1)):
            static = self._static_decode_state(prev_output_tokens, encoder_out, incremental_state)
        if static is not None:
            return static.step(prev_output_tokens, incremental_state)
        return super().forward(prev_output_tokens, encoder_out=encoder_out, incremental_state=incremental_state,
                               features_only=features_only, full_context_alignment=full_context_alignment,
                               alignment_layer=alignment_layer, alignment_heads=alignment_heads,
                               src_lengths=src_lengths, return_all_hiddens=return_all_hiddens)

    def _static_decode_state(self, prev_output_tokens, encoder_out, incremental_state):
        """The batch's StaticDecodeState: the one it started with, a new one at its first step when the
        static step applies, or None (the eager path: autograd, training, unsupported model, ...)."""
        entry = incremental_state.get(StaticDecodeState.KEY)
        if entry is not None:
            if self.training or torch.is_grad_enabled():
                raise RuntimeError("this incremental state was started by the static decoding step, which runs "
                                   "without autograd in eval mode; decode under torch.no_grad(), or build the model "
                                   "with --no-rfa-static-decode")
            return entry["state"]
        weight = self.embed_tokens.weight
        # CPU fp32 for now; on CUDA the eager path (fla's step) runs until the static step is captured as graphs
        if (not self.static_decode or self.training or torch.is_grad_enabled() or incremental_state
                or self.static_unsupported is not None or weight.dtype != torch.float32 or weight.device.type != "cpu"):
            return None  # incremental_state non-empty: eager decoding started it
        state = StaticDecodeState(self, encoder_out, prev_output_tokens.size(0), weight.device, weight.dtype)
        incremental_state[StaticDecodeState.KEY] = {"state": state}
        return state

    def reorder_incremental_state_scripting(self, incremental_state, new_order):
        entry = incremental_state.get(StaticDecodeState.KEY)
        if entry is not None:
            entry["state"].reorder_(new_order)
            return
        super().reorder_incremental_state_scripting(incremental_state, new_order)

    def get_normalized_probs(self, net_output, log_probs, sample=None):
        extra = net_output[1] if len(net_output) > 1 else None
        static = extra.get("rfa_static") if isinstance(extra, dict) else None
        if static is not None and log_probs:
            return static.log_probs(net_output[0])  # into the step's reused buffer
        return super().get_normalized_probs(net_output, log_probs, sample)

    def take_static_workspace(self) -> Workspace:
        """The buffers of the last finished batch (a new set when none is free)."""
        workspace, self._static_workspace = self._static_workspace, None
        return workspace if workspace is not None else Workspace()

    def return_static_workspace(self, workspace: Workspace) -> None:
        self._static_workspace = workspace

    def buffered_future_mask(self, tensor):
        # Causal RFA needs to know only *that* the pass is causal. A zero-stride
        # (T, T) stand-in carries that without fairseq's T x T mask in memory;
        # RFAAttention checks for it (and validates any materialized mask).
        dim = tensor.size(0)
        return tensor.new_zeros(()).expand(dim, dim)


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
        model = super().build_model(args, task)
        model.set_random_feature_seed(getattr(args, "seed", 1))
        return model

    @classmethod
    def build_encoder(cls, cfg, src_dict, embed_tokens):
        return RFATransformerEncoder(cfg, src_dict, embed_tokens)

    @classmethod
    def build_decoder(cls, cfg, tgt_dict, embed_tokens):
        return RFATransformerDecoder(cfg, tgt_dict, embed_tokens, no_encoder_attn=cfg.no_cross_attention)

    def set_beam_size(self, beam_size: int) -> None:
        """Called by fairseq's SequenceGenerator: RFA cross-attention keeps one state per sentence."""
        self.decoder.set_beam_size(beam_size)

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
