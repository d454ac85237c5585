"""The math of RFA: pure tensor functions (the feature maps, causal and cross RFA over whole sequences, the decoding
step's operations in torch) with their plain references (naive.py); no fairseq imports here, and none of the other
rooms: the CPU runtime is in rfa_fairseq/cpu/, the GPU kernels in rfa_fairseq/gpu/, and which of them runs a call is
decided in rfa_fairseq/kernel_choice.py."""
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
from .naive import (  # noqa: F401
    causal_rfa_recurrent,
    causal_rfa_reference,
    exact_kernel,
    feature_map_reference,
    learned_feature_map_reference,
    noncausal_rfa_reference,
    quantize_rows_reference,
    rfa_attention_weights,
)
from .rfa import (  # noqa: F401
    DENOMINATOR_EPS,
    POSITIVE_EPS,
    causal_rfa_chunked,
    denominator_eps,
    gate_keys,
    noncausal_rfa,
    noncausal_rfa_state,
)
