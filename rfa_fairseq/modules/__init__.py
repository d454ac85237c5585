from .rfa_attention import RFAAttention  # noqa: F401
from .softmax_cross_attention import SoftmaxCrossAttention  # noqa: F401
