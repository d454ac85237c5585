"""The tests' tiny transformers, defined once. A test picks the sizes it needs (small enough for a
shared 2-core CPU, or a base model's head shape on CUDA); the option names and flags are written only
here, as fairseq model fields (Hydra overrides, YAML) or as command-line flags."""


def tiny_model_fields(embed_dim, ffn_dim, heads, encoder_layers, decoder_layers):
    """fairseq model options of a transformer of these sizes, the same on both sides: {field: value}."""
    return {
        "encoder_layers": encoder_layers, "decoder_layers": decoder_layers,
        "encoder_embed_dim": embed_dim, "decoder_embed_dim": embed_dim,
        "encoder_ffn_embed_dim": ffn_dim, "decoder_ffn_embed_dim": ffn_dim,
        "encoder_attention_heads": heads, "decoder_attention_heads": heads,
    }


def as_flags(fields):
    """{"encoder_layers": 1, ...} -> ["--encoder-layers", "1", ...]"""
    return [item for name, value in fields.items() for item in ("--" + name.replace("_", "-"), str(value))]


def tiny_model_flags(embed_dim, ffn_dim, heads, encoder_layers, decoder_layers, share_all_embeddings=True):
    """Command-line flags of tiny_model_fields(...), with --share-all-embeddings unless told otherwise."""
    shared = ["--share-all-embeddings"] if share_all_embeddings else []
    return shared + as_flags(tiny_model_fields(embed_dim, ffn_dim, heads, encoder_layers, decoder_layers))


# 16-dim model: fast on a shared 2-core CPU, still every RFA role (decoder self + cross); the CLI tests'
# model (tests/cli_support.py, test_generate_script.py, test_checkpoint_safety.py's Hydra run)
CLI_TINY_MODEL = tiny_model_flags(embed_dim=16, ffn_dim=32, heads=2, encoder_layers=1, decoder_layers=1)
