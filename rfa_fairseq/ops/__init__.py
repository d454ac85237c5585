"""Pure tensor functions of RFA: no fairseq imports here."""
from .feature_maps import (  # noqa: F401
    AFFINE_FEATURE_MAPS,
    FEATURE_MAPS,
    LEARNED_FEATURE_MAPS,
    POSITIVE_FEATURE_MAPS,
    RANDOM_FEATURE_MAPS,
    RANDOM_MATRIX_KINDS,
    activate_learned,
    draw_random_matrix,
    feature_map,
    learned_feature_map,
    num_feature_dims,
    random_matrix_seed,
    scale_inputs,
)
from .dispatch import (  # noqa: F401
    SEQUENCE_KERNELS,
    CausalRFAState,
    add_layer_norm,
    causal_layer_step,
    causal_rfa,
    causal_rfa_decode_step,
    is_identity_order,
    softmax_cross_step,
)
from .fla_backend import causal_rfa_fla, causal_rfa_step_fla, fla_available, fla_import_error  # noqa: F401
from .fused_step import DECODE_KERNELS, causal_rfa_step_fused, load_fused_extension  # noqa: F401
from .naive import (  # noqa: F401
    causal_rfa_recurrent,
    causal_rfa_reference,
    exact_kernel,
    feature_map_reference,
    learned_feature_map_reference,
    noncausal_rfa_reference,
    rfa_attention_weights,
)
from .rfa import (  # noqa: F401
    DENOMINATOR_EPS,
    POSITIVE_EPS,
    causal_rfa_chunked,
    causal_rfa_step_,
    denominator_eps,
    gate_keys,
    noncausal_rfa,
    noncausal_rfa_state,
)
