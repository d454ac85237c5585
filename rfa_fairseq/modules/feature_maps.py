"""Feature maps as small modules: phi turns per-head queries or keys into non-negative (or random) features.

    phi(x, w=None, is_query=False): (B, H, T, d) -> (B, H, T, F) fp32

Each map owns its parameters (a learned map its weight and bias, a random map its sigma); the random
matrix w is the attention's (it is redrawn per training update and tied to the layer's seed) and is
passed in. The formulas and their references are in ops/feature_maps.py and ops/naive.py.

Each map also supplies its part of the decoding step: `linear_part()` exposes the affine first stage of
the learned maps (p = W x + b per head), which the step folds into the attention's input projection, and
`step_activation` names the activation the step's kernel applies to p (ops.activate_learned, or its code in
the C++ kernel); maps without one (random maps, elu) give the step their features (`step_features`).
"""
from typing import Optional, Tuple

import torch
from torch import Tensor, nn

from ..config import RFAConfig
from ..ops import RANDOM_FEATURE_MAPS, feature_map, learned_feature_map, num_feature_dims, scale_inputs


class FeatureMap(nn.Module):
    kind: str = ""
    uses_random_matrix = False
    step_activation: Optional[str] = None  # what the decoding step's kernel applies to linear_part()'s p

    def __init__(self, num_heads: int, num_features: int, head_dim: int):
        super().__init__()
        self.num_heads, self.num_features, self.head_dim = num_heads, num_features, head_dim
        self.output_dim = num_feature_dims(self.kind, num_features, head_dim)  # F

    def reset_parameters(self) -> None:
        """Initial values of the map's own parameters (none for most maps)."""

    def linear_part(self) -> Optional[Tuple[Tensor, Tensor]]:
        """(weight (H, D, d), bias (H, D)) of p = W x + b when phi(x) = activate(p), else None."""
        return None

    def step_features(self, q: Tensor, k: Tensor, w: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
        """phi(q), phi(k) of one decoding step: (R, H * d) each -> (R, H * F) fp32 each."""
        R = q.size(0)
        heads = lambda t: t.reshape(R, self.num_heads, 1, self.head_dim)  # noqa: E731  (B, H, T = 1, d)
        return self(heads(q), w, is_query=True).reshape(R, -1), self(heads(k), w, is_query=False).reshape(R, -1)

    def extra_repr(self) -> str:
        return f"heads={self.num_heads}, D={self.num_features}, head_dim={self.head_dim}, F={self.output_dim}"


class LearnedLinearFeatureMap(FeatureMap):
    """phi(x) = activate(W x + b), W (H, D, d) and b (H, D) learned and shared by queries and keys."""

    def __init__(self, num_heads: int, num_features: int, head_dim: int, initialize: bool = True):
        super().__init__(num_heads, num_features, head_dim)
        self.weight = nn.Parameter(torch.empty(num_heads, num_features, head_dim))
        self.bias = nn.Parameter(torch.empty(num_heads, num_features))
        if initialize:
            self.reset_parameters()

    def forward(self, x: Tensor, w: Optional[Tensor] = None, is_query: bool = False) -> Tensor:
        return learned_feature_map(x, self.weight, self.bias, self.kind)

    def linear_part(self):
        return self.weight, self.bias

    @property
    def step_activation(self) -> str:
        return self.kind


class HedgehogFeatureMap(LearnedLinearFeatureMap):
    """[softmax(W x + b), softmax(-(W x + b))], F = 2D (Zhang et al. 2024)."""

    kind = "hedgehog"

    def reset_parameters(self):
        with torch.no_grad():
            # identity rows (repeated when D > d): phi starts as [softmax(x), softmax(-x)]
            eye = torch.eye(self.head_dim).repeat(-(-self.num_features // self.head_dim), 1)
            self.weight.copy_(eye[: self.num_features].expand_as(self.weight))
            self.bias.zero_()


class ReLUFeatureMap(LearnedLinearFeatureMap):
    """relu(W x + b) / sqrt(D), F = D (T2R, Kasai et al. 2021)."""

    kind = "relu"

    def reset_parameters(self):
        with torch.no_grad():
            nn.init.normal_(self.weight, std=self.head_dim ** -0.5)
            self.bias.zero_()


class ELUFeatureMap(FeatureMap):
    """elu(x) + 1, F = d, no parameters (Katharopoulos et al. 2020)."""

    kind = "elu"

    def forward(self, x: Tensor, w: Optional[Tensor] = None, is_query: bool = False) -> Tensor:
        return learned_feature_map(x, None, None, self.kind)


class RandomFeatureMap(FeatureMap):
    """Random features of sigma-scaled, l2-normalized inputs (paper Sec. 2-3): sincos, arccos or positive.

    sigma (H, d) is learned (the paper), fixed, or learned as exp(m * theta) ("log": Adam moves theta by
    ~lr per step, so log sigma moves by ~m * lr, a learning-rate multiplier m without an optimizer group).
    """

    uses_random_matrix = True

    def __init__(self, kind: str, num_heads: int, num_features: int, head_dim: int, sigma: str,
                 sigma_lr_multiplier: float, temperature: float):
        if kind not in RANDOM_FEATURE_MAPS:
            raise ValueError(f"unknown random feature map {kind!r}; expected one of {RANDOM_FEATURE_MAPS}")
        self.kind = kind
        super().__init__(num_heads, num_features, head_dim)
        self.sigma_mode = sigma
        initial = torch.full((num_heads, head_dim), temperature ** -0.5)  # (H, d)
        if sigma == "log":
            self.sigma_lr_multiplier = float(sigma_lr_multiplier)
            self.log_sigma = nn.Parameter(initial.log() / self.sigma_lr_multiplier)
        elif sigma == "learned":
            self.sigma = nn.Parameter(initial)
        else:
            self.register_buffer("sigma", initial)

    def current_sigma(self) -> Tensor:
        """(H, d) sigma scaling the random projections."""
        if self.sigma_mode == "log":
            return torch.exp(self.log_sigma * self.sigma_lr_multiplier)
        return self.sigma

    def set_sigma_(self, sigma: Tensor) -> None:
        """Set sigma (H, d) in place, whatever its parametrization (weight conversion)."""
        with torch.no_grad():
            if self.sigma_mode == "log":
                self.log_sigma.copy_(sigma.log() / self.sigma_lr_multiplier)
            else:
                self.sigma.copy_(sigma)

    def forward(self, x: Tensor, w: Optional[Tensor] = None, is_query: bool = False) -> Tensor:
        return feature_map(scale_inputs(x, self.current_sigma()), w, self.kind, is_query)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, sigma={self.sigma_mode}"


LEARNED_MAP_CLASSES = {"hedgehog": HedgehogFeatureMap, "relu": ReLUFeatureMap}


def build_feature_map(rfa: RFAConfig, num_heads: int, head_dim: int, initialize: bool = True) -> FeatureMap:
    """The feature map module named by rfa.rfa_feature_map (learned maps ignore the sigma options).
    initialize=False leaves learned weights uninitialized for a caller that calls reset_parameters()."""
    kind, num_features = str(rfa.rfa_feature_map), int(rfa.rfa_num_features)
    if kind == "elu":
        return ELUFeatureMap(num_heads, num_features, head_dim)
    if kind in LEARNED_MAP_CLASSES:
        return LEARNED_MAP_CLASSES[kind](num_heads, num_features, head_dim, initialize=initialize)
    return RandomFeatureMap(kind, num_heads, num_features, head_dim, str(rfa.rfa_sigma),
                            float(rfa.rfa_sigma_lr_multiplier), float(rfa.rfa_temperature))


# checkpoints written before the maps were modules kept their parameters on the attention module
LEGACY_PARAMETER_NAMES = {"feature_weight": "phi.weight", "feature_bias": "phi.bias", "sigma": "phi.sigma",
                          "log_sigma": "phi.log_sigma"}
