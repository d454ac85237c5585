"""Feature maps as small modules: phi turns per-head queries or keys into non-negative (or random) features.

    phi(x, w=None, is_query=False): (B, H, T, d) -> (B, H, T, F) fp32

Each map owns its parameters (a learned map its weight and bias, a random map its sigma); the random
matrix w is the attention's (it is redrawn per training update and tied to the layer's seed) and is
passed in. The formulas and their references are in ops/feature_maps.py and ops/naive.py.

`linear_part()` exposes the affine first stage of the learned maps (p = W x + b per head) so that the
static decoding step can fold it into the attention's input projection; `activate(p)` is the rest.
"""
from typing import Optional, Tuple

import torch
from torch import Tensor, nn

from ..ops import (
    LEARNED_FEATURE_MAPS,
    activate_learned,
    POSITIVE_FEATURE_MAPS,
    RANDOM_FEATURE_MAPS,
    feature_map,
    learned_feature_map,
    num_feature_dims,
    scale_inputs,
)

SIGMA_MODES = ("learned", "fixed", "log")


class FeatureMap(nn.Module):
    kind: str = ""
    uses_random_matrix = False

    def __init__(self, num_heads: int, num_features: int, head_dim: int):
        super().__init__()
        self.num_heads, self.num_features, self.head_dim = num_heads, num_features, head_dim
        self.output_dim = num_feature_dims(self.kind, num_features, head_dim)  # F
        self.positive = self.kind in POSITIVE_FEATURE_MAPS  # features > 0: only an underflow guard needed

    def reset_parameters(self) -> None:
        """Initial values of the map's own parameters (none for most maps)."""

    def linear_part(self) -> Optional[Tuple[Tensor, Tensor]]:
        """(weight (H, D, d), bias (H, D)) of p = W x + b when phi(x) = activate(p), else None."""
        return None

    def activate(self, p: Tensor) -> Tensor:
        raise NotImplementedError(f"{type(self).__name__} has no linear first stage")

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

    def activate(self, p: Tensor) -> Tensor:
        return activate_learned(p if p.dtype == torch.float64 else p.float(), self.kind)


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

    def __init__(self, kind: str, num_heads: int, num_features: int, head_dim: int, sigma: str = "learned",
                 sigma_lr_multiplier: float = 10.0, temperature: float = 1.0):
        if kind not in RANDOM_FEATURE_MAPS:
            raise ValueError(f"unknown random feature map {kind!r}; expected one of {RANDOM_FEATURE_MAPS}")
        if sigma not in SIGMA_MODES:
            raise ValueError(f"sigma={sigma!r} is not one of {', '.join(SIGMA_MODES)}")
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


LEARNED_MAP_CLASSES = {"hedgehog": HedgehogFeatureMap, "relu": ReLUFeatureMap, "elu": ELUFeatureMap}


def build_feature_map(kind: str, num_heads: int, num_features: int, head_dim: int, sigma: str = "learned",
                      sigma_lr_multiplier: float = 10.0, temperature: float = 1.0, initialize: bool = True) -> FeatureMap:
    """The feature map module named by --rfa-feature-map (learned maps ignore the sigma options).
    initialize=False leaves learned weights uninitialized for a caller that calls reset_parameters()."""
    if kind == "elu":
        return ELUFeatureMap(num_heads, num_features, head_dim)
    if kind in LEARNED_FEATURE_MAPS:
        return LEARNED_MAP_CLASSES[kind](num_heads, num_features, head_dim, initialize=initialize)
    return RandomFeatureMap(kind, num_heads, num_features, head_dim, sigma, sigma_lr_multiplier, temperature)


# checkpoints written before the maps were modules kept their parameters on the attention module
LEGACY_PARAMETER_NAMES = {"feature_weight": "phi.weight", "feature_bias": "phi.bias", "sigma": "phi.sigma",
                          "log_sigma": "phi.log_sigma"}
