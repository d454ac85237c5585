"""The fairseq functions the native encoder (cpu/csrc/encoder_program.cpp, modules/encoding.py) repeats instead of
calling them, fingerprinted as fairseq_compat's patches are (fairseq_sources): NATIVE_ENCODER_MIRRORS, docs/design.md's
table (`mirror_table_markdown`, a test keeps the two equal). Where one is not the source it repeats (another fairseq
version, another package's replacement), the native encoder must not run: its output would silently differ from
fairseq's forward (`native_encoder_mirrors_hold`, one NativeEncoderDisabled warning naming what differs)."""
import dataclasses
import warnings
from typing import List

from .fairseq_sources import ALL_TAGS, CHECKED_FAIRSEQ, owner_of, record_table, source_difference


class NativeEncoderDisabled(UserWarning):
    """The native encoder does not run: a fairseq function it repeats is not the source it was checked against."""


@dataclasses.dataclass(frozen=True)
class FairseqMirror:
    """A fairseq function (`module`.`attribute`, possibly Class.method) whose computation the native encoder
    (cpu/csrc/encoder_program.cpp, modules/encoding.py) repeats instead of calling it, what repeats it, and the
    fingerprint of the source it repeats."""
    module: str
    attribute: str
    repeated_by: str
    fingerprint: str  # source_fingerprint of the attribute in ve-fairseq 0.12.3
    same_source_in: str  # other fairseq sources with the same fingerprint

    @property
    def target(self) -> str:
        return f"{self.module}.{self.attribute}"


_DIFFER_IN_TAGS = "fairseq main (3d262bb); v0.12.2, v0.12.3 (git tags) differ"
NATIVE_ENCODER_MIRRORS = (
    FairseqMirror(
        "fairseq.models.transformer.transformer_encoder", "TransformerEncoderBase.forward_scriptable",
        "`EncoderProgram::encode` and `EncodingRuntime.encode`: the padding mask, the padded rows zeroed, the layers, "
        "the final norm, `src_lengths` and the output's fields",
        "68b523965c42c34d", _DIFFER_IN_TAGS),
    FairseqMirror(
        "fairseq.models.transformer.transformer_encoder", "TransformerEncoderBase.forward_embedding",
        "`EncoderProgram::encode`: the token embedding times `embed_scale`, the positions added, the embedding's norm",
        "d032986c0eadadd9", ALL_TAGS),
    FairseqMirror(
        "fairseq.utils", "make_positions",
        "`EncoderProgram::encode`: each token's position (from padding_idx + 1 on, padding at padding_idx)",
        "c2f12c3fcb209d57", ALL_TAGS),
    FairseqMirror(
        "fairseq.modules.sinusoidal_positional_embedding", "SinusoidalPositionalEmbedding.forward",
        "`position_table` (the table grown for a longer source, kept where `auto_expand`) and `EncoderProgram::encode` "
        "(its rows at the positions)",
        "7e64ee8380486fc2", _DIFFER_IN_TAGS),
    FairseqMirror(
        "fairseq.modules.learned_positional_embedding", "LearnedPositionalEmbedding.forward",
        "`EncoderProgram::encode`: the embedding's rows at the positions",
        "aab11aa2e9ff928e", ALL_TAGS),
    FairseqMirror(
        "fairseq.modules.transformer_layer", "TransformerEncoderLayerBase.forward",
        "`encoder_layer`: the self-attention and FFN sublayers, their residuals, post-norm or pre-norm",
        "17354f68c9fdb450", "fairseq v0.12.3 (git tag) and main (3d262bb); v0.12.2 (git tag) differs"),
    FairseqMirror(
        "fairseq.modules.transformer_layer", "TransformerEncoderLayerBase.residual_connection",
        "`encoder_layer`: the residual added by the linear layer before it",
        "1c6230dbfed67760", ALL_TAGS),
    FairseqMirror(
        "fairseq.modules.multihead_attention", "MultiheadAttention.forward",
        "`encoder_layer`'s self-attention: q, k and v as one product, torch's `scaled_dot_product_attention` with "
        "the key padding mask (scale head_dim^-0.5), the output projection",
        "be5a014cd20009d4", _DIFFER_IN_TAGS),
    FairseqMirror(
        "fairseq.modules.gelu", "gelu",
        "`encoder_layer`: the FFN activation `gelu` (torch's, in fp32)",
        "0de24078000675a6", ALL_TAGS),
)
_WARNED_MIRROR_DIFFERENCES = set()  # the native encoder's warnings given in this process


def mirror_differences(mirrors=NATIVE_ENCODER_MIRRORS) -> List[str]:
    """For each of `mirrors` whose fairseq function is not the source it repeats: how it differs."""
    differences = []
    for mirror in mirrors:
        try:
            owner, attribute = owner_of(mirror)
            difference = source_difference(getattr(owner, attribute), mirror.fingerprint)
        except (ImportError, AttributeError):
            difference = "does not exist"
        if difference is not None:
            differences.append(f"{mirror.target} {difference}, not {mirror.fingerprint}")
    return differences


def native_encoder_mirrors_hold() -> bool:
    """Whether every fairseq function the native encoder repeats is the source it was checked against; where one
    is not, the native encoder must not run (its output would silently differ from fairseq's forward), and one
    NativeEncoderDisabled warning names what differs (once per process for the same differences)."""
    differences = mirror_differences()
    if not differences:
        return True
    message = (f"rfa_fairseq: the native encoder does not run, fairseq's forward does (slower on the CPU): it repeats "
               f"fairseq functions as {CHECKED_FAIRSEQ} has them, and {'; '.join(differences)} (another fairseq "
               f"version, or another package replaced them)")
    if message not in _WARNED_MIRROR_DIFFERENCES:
        _WARNED_MIRROR_DIFFERENCES.add(message)
        warnings.warn(message, NativeEncoderDisabled, stacklevel=2)
    return False


def mirror_table_markdown() -> str:
    """docs/design.md's table of NATIVE_ENCODER_MIRRORS."""
    return record_table("| fairseq function | repeated by | fairseq versions checked |", NATIVE_ENCODER_MIRRORS,
                        lambda mirror: [f"`{mirror.target}`", mirror.repeated_by])
