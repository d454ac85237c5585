"""The `rfa_transformer` model: fairseq's transformer with RFA attention, wired through hooks.

Only `build_*` hooks are overridden; every forward pass is fairseq's own.
Defaults follow the paper's MT setup: RFA in decoder self-attention and in
encoder-decoder attention, softmax encoder self-attention unless --rfa-encoder-self-attn.
"""
import argparse

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
    def build_encoder_layer(self, cfg):
        if not cfg.rfa_encoder_self_attn:
            return super().build_encoder_layer(cfg)
        return _wrap_layer(RFATransformerEncoderLayer(cfg, return_fc=self.return_fc), cfg)


class RFATransformerDecoder(TransformerDecoderBase):
    def build_decoder_layer(self, cfg, no_encoder_attn=False):
        return _wrap_layer(RFATransformerDecoderLayer(cfg, no_encoder_attn), cfg)

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
