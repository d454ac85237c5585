"""Pure tensor functions of RFA: no fairseq imports here."""
from .decode_step import (  # noqa: F401
    CPU_ISAS,
    DECODE_KERNELS,
    DECODE_PRECISIONS,
    DECODE_STATES,
    cpp_can_run,
    rfa_step_kernels,
    step_kernels,
)
from .dispatch import SEQUENCE_KERNELS, causal_rfa  # noqa: F401
from .extension import load_fused_extension, require_fused_extension  # noqa: F401
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
from .triton_support import triton_import_error, triton_usable  # noqa: F401
from .rfa import (  # noqa: F401
    DENOMINATOR_EPS,
    POSITIVE_EPS,
    causal_rfa_chunked,
    denominator_eps,
    gate_keys,
    noncausal_rfa,
    noncausal_rfa_state,
)
