"""Which generator fairseq-generate / fairseq-interactive get for an `rfa_transformer`.

`build_generator` wraps `FairseqTask.build_generator` (installed by fairseq_compat.apply_patches): a
single RFATransformerModel with plain beam-search options gets the StaticBeamSearchGenerator (same
hypotheses and scores, fixed-shape buffers) unless its --rfa-static-beam-search is off; anything else gets
what fairseq builds, with one log line naming the reason. The generator is the task's for joining its batches
(`batch_groups.use_generator`).
"""
import contextlib
import functools
import logging

import torch

from . import batch_groups
from .static_beam_search import StaticBeamSearchGenerator

logger = logging.getLogger(__name__)

# generation options the static beam search does not serve, with the value that leaves them off
UNSUPPORTED_OPTIONS = {
    "score_reference": False, "sampling": False, "diverse_beam_groups": -1, "diversity_rate": -1.0,
    "match_source_len": False, "constraints": None, "prefix_allowed_tokens_fn": None, "print_alignment": None,
    "lm_path": None, "retain_dropout": False, "temperature": 1.0, "iter_decode_eos_penalty": 0.0,
    "iter_decode_max_iter": 10, "iter_decode_force_max_iter": False, "iter_decode_with_beam": 1,
    "iter_decode_with_external_reranker": False, "retain_iter_history": False,
}


def fallback_reason(models, args, seq_gen_cls=None, extra_gen_cls_kwargs=None, prefix_allowed_tokens_fn=None):
    """Why these models and options need fairseq's generator; None when the static one serves them."""
    from ..models.rfa_transformer import RFATransformerModel

    if len(models) != 1:
        return f"an ensemble of {len(models)} models"
    if not isinstance(models[0], RFATransformerModel):
        return f"the model is a {type(models[0]).__name__}, not an rfa_transformer"
    if not models[0].rfa_config.rfa_static_beam_search:
        return "--no-rfa-static-beam-search"
    if seq_gen_cls is not None:
        return f"the task asks for {seq_gen_cls.__name__}"
    if prefix_allowed_tokens_fn is not None:
        return "prefix_allowed_tokens_fn"
    for name, off in UNSUPPORTED_OPTIONS.items():
        value = getattr(args, name, off)
        if value != off and value is not None:
            return f"--{name.replace('_', '-')} {value}"
    extra = {k: v for k, v in (extra_gen_cls_kwargs or {}).items() if v is not None}
    extra.pop("lm_weight", None)  # fairseq-generate always passes it; it only matters with lm_model
    extra.pop("symbols_to_strip_from_output", None)
    if extra:
        return f"generator arguments {sorted(extra)}"
    return None


def forced_tokens_reach_shortlists(generator, models) -> None:
    """fairseq's generator forces a batch's prefix tokens and constraints, which its decoder does not see: each
    rfa_transformer with --rfa-shortlist gets them while the generator decodes a batch (its decoder's forcing_tokens),
    so that its batch's union holds them (none is dropped). Nothing for models without a shortlist."""
    from fairseq.token_generation_constraints import unpack_constraints

    from ..models.rfa_transformer import RFATransformerModel

    decoders = [m.decoder for m in models if isinstance(m, RFATransformerModel) and m.rfa_config.rfa_shortlist]
    generate = getattr(generator, "generate", None)
    if not decoders or generate is None:
        return

    @functools.wraps(generate)
    def generate_forcing(*args, prefix_tokens=None, constraints=None, **kwargs):
        constrained = None
        if constraints is not None:  # fairseq's packed rows: counts and 0 separators besides the tokens
            constrained = [c for row in constraints for c in unpack_constraints(row)]
            constrained = torch.cat(constrained) if constrained else None
        with contextlib.ExitStack() as stack:
            for decoder in decoders:
                stack.enter_context(decoder.forcing_tokens(prefix_tokens, constrained))
            if constraints is not None:
                kwargs["constraints"] = constraints
            return generate(*args, prefix_tokens=prefix_tokens, **kwargs)

    generator.generate = generate_forcing


def wrap_build_generator(original):
    """FairseqTask.build_generator, giving the static beam search where it serves (see module docstring)."""

    @functools.wraps(original)
    def build_generator(self, models, args, seq_gen_cls=None, extra_gen_cls_kwargs=None,
                        prefix_allowed_tokens_fn=None):
        reason = fallback_reason(models, args, seq_gen_cls, extra_gen_cls_kwargs, prefix_allowed_tokens_fn)
        if reason is not None:
            from ..models.rfa_transformer import RFATransformerModel

            if any(isinstance(m, RFATransformerModel) for m in models):
                logger.info(f"rfa_fairseq: fairseq's generator, not the static beam search: {reason}")
                parts = {m.rfa_config.rfa_decode_parts for m in models if isinstance(m, RFATransformerModel)}
                if any(p > 0 for p in parts):
                    logger.info(f"rfa_fairseq: --rfa-decode-parts {max(parts)} has no effect with fairseq's generator "
                                f"(only the static beam search splits batches into parts)")
            generator = original(self, models, args, seq_gen_cls=seq_gen_cls, extra_gen_cls_kwargs=extra_gen_cls_kwargs,
                                 prefix_allowed_tokens_fn=prefix_allowed_tokens_fn)
            forced_tokens_reach_shortlists(generator, models)
            batch_groups.use_generator(self, generator)  # the task's batches come one at a time
            return generator
        logger.info("rfa_fairseq: static beam search generator")
        generator = StaticBeamSearchGenerator(
            models[0], self.target_dictionary, beam_size=getattr(args, "beam", 5),
            max_len_a=getattr(args, "max_len_a", 0), max_len_b=getattr(args, "max_len_b", 200),
            min_len=getattr(args, "min_len", 1), normalize_scores=not getattr(args, "unnormalized", False),
            len_penalty=getattr(args, "lenpen", 1), unk_penalty=getattr(args, "unkpen", 0),
            no_repeat_ngram_size=getattr(args, "no_repeat_ngram_size", 0),
            symbols_to_strip_from_output=(extra_gen_cls_kwargs or {}).get("symbols_to_strip_from_output"),
            cuda_graphs=models[0].rfa_config.rfa_cuda_graphs, parts=models[0].rfa_config.rfa_decode_parts)
        batch_groups.use_generator(self, generator)  # it decides how many of the task's batches come joined
        return generator

    build_generator.rfa_fairseq_wrapper = True
    return build_generator


__all__ = ["StaticBeamSearchGenerator", "fallback_reason", "forced_tokens_reach_shortlists", "wrap_build_generator"]
