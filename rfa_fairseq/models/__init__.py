from .rfa_transformer import RFATransformerModel  # noqa: F401  (registers rfa_transformer and its architectures)
