from .rfa_attention import RFAAttention  # noqa: F401
