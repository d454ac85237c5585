"""Random matrices and random feature maps (RFA paper, Sec. 2-3).

Shapes: x is (B, H, T, d) per-head queries or keys, random matrices are (H, D, d).
A feature map turns x into phi(x) of shape (B, H, T, F): F = 2D for sincos, D otherwise.

Kernel conventions (q, k are l2-normalized first, sigma scales them per head and dim):
  x' = sigma * x / |x|, w ~ N(0, I) (or orthogonal blocks with chi norms)
  sincos:   E[phi(x).phi(y)] = exp(-|x'-y'|^2 / 2)   (Gaussian kernel, paper Eq. 2)
  positive: E[phi(x).phi(y)] = exp(x'.y')            (FAVOR+, always > 0)
  arccos:   E[phi(x).phi(y)] ~ arc-cosine kernel of degree 1 (Cho & Saul 2009)
With |x| = 1 and a scalar sigma, both sincos and positive approximate softmax
attention with temperature 1 / sigma^2, since the norm factors cancel in the ratio.

Learned (deterministic) maps, beyond the paper: no random matrix, no estimator noise, and
phi >= 0 so the denominator never goes negative. They take the raw per-head q or k (no
l2 normalization: the norm carries information they can use), and w is a learned (H, D, d)
weight with a learned (H, D) bias, shared by queries and keys (so phi(q).phi(k) is a kernel):
  hedgehog: phi(x) = [softmax(w x + b), softmax(-(w x + b))]   F = 2D (Zhang et al. 2024)
  relu:     phi(x) = relu(w x + b) / sqrt(D)                    F = D  (T2R, Kasai et al. 2021)
  elu:      phi(x) = elu(x) + 1 (no weight)                     F = d  (Katharopoulos et al. 2020)
"""
import hashlib
import math
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

RANDOM_FEATURE_MAPS = ("sincos", "arccos", "positive")
LEARNED_FEATURE_MAPS = ("hedgehog", "relu", "elu")
FEATURE_MAPS = RANDOM_FEATURE_MAPS + LEARNED_FEATURE_MAPS
# maps whose features are > 0 (exp or softmax based): phi(q).z is a sum of positive terms, never a
# noisy estimate, and is zero only by underflow. (arccos and relu features are >= 0 but sparse:
# a query whose active features meet no key's has phi(q).z = 0 exactly, so they keep the floor.)
POSITIVE_FEATURE_MAPS = ("positive", "hedgehog", "elu")
RANDOM_MATRIX_KINDS = ("gaussian", "orthogonal")


def num_feature_dims(feature_map: str, num_features: int, head_dim: Optional[int] = None) -> int:
    """Size F of phi(x) for D random (or learned) vectors."""
    if feature_map in ("sincos", "hedgehog"):
        return 2 * num_features
    if feature_map == "elu":
        if head_dim is None:
            raise ValueError("the elu feature map has F = head_dim: pass head_dim")
        return head_dim
    return num_features


def random_matrix_seed(seed: int, update: int, module_index: int) -> int:
    """One 63-bit seed per (training seed, update number, attention module).

    A hash, not arithmetic, so that nearby (seed, update, layer) triples do not
    collide; identical on every data-parallel rank without communication.
    """
    digest = hashlib.sha256(f"rfa:{seed}:{update}:{module_index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def draw_random_matrix(
    num_heads: int, num_features: int, head_dim: int, kind: str, seed: int
) -> Tensor:
    """(H, D, d) random projections with N(0, I) marginals, drawn on the CPU in fp32.

    gaussian:   i.i.d. N(0, 1) entries.
    orthogonal: rows orthogonal within blocks of d (QR of a Gaussian matrix), each
                row rescaled by an independent chi(d) norm so that every row still
                has the N(0, I) distribution (Choromanski et al. 2021); lower
                variance than i.i.d. rows.
    """
    if kind not in RANDOM_MATRIX_KINDS:
        raise ValueError(f"unknown random matrix kind {kind!r}; expected one of {RANDOM_MATRIX_KINDS}")
    gen = torch.Generator(device="cpu").manual_seed(seed)
    if kind == "gaussian":
        return torch.randn(num_heads, num_features, head_dim, generator=gen)
    num_blocks = math.ceil(num_features / head_dim)
    gaussian = torch.randn(num_heads, num_blocks, head_dim, head_dim, generator=gen, dtype=torch.float64)
    q, r = torch.linalg.qr(gaussian)  # (H, nb, d, d)
    # sign fix makes Q Haar-distributed instead of biased by the QR convention
    q = q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1)).unsqueeze(-2)
    rows = q.transpose(-1, -2).reshape(num_heads, num_blocks * head_dim, head_dim)[:, :num_features]
    chi_norms = torch.randn(num_heads, num_features, head_dim, generator=gen, dtype=torch.float64).norm(dim=-1)
    return (rows * chi_norms.unsqueeze(-1)).float()


def scale_inputs(x: Tensor, sigma: Tensor) -> Tensor:
    """x' = sigma * x / |x|.   x: (B, H, T, d), sigma: (H, d) -> (B, H, T, d) fp32."""
    x = x if x.dtype == torch.float64 else x.float()
    x = x / x.norm(dim=-1, keepdim=True).clamp_min(1e-6)
    return x * sigma.to(x.dtype).unsqueeze(1)


def feature_map(x_scaled: Tensor, w: Tensor, kind: str, is_query: bool = False) -> Tensor:
    """phi(x') for x' from `scale_inputs`.   x_scaled: (B, H, T, d), w: (H, D, d) -> (B, H, T, F).

    is_query only matters for "positive": a per-query constant is subtracted before
    exp for range safety; it cancels between numerator and denominator. Keys get no
    such shift because a per-key constant would change the attention weights.
    """
    num_features = w.size(1)
    B, H, T, d = x_scaled.shape
    # one (H)-batched matmul; broadcasting (B, H, T, d) @ (H, d, D) would copy w B times
    proj = torch.bmm(x_scaled.transpose(0, 1).reshape(H, B * T, d), w.to(x_scaled.dtype).transpose(-1, -2))
    proj = proj.view(H, B, T, num_features).transpose(0, 1)  # (B, H, T, D)
    scale = num_features ** -0.5
    if kind == "sincos":
        return torch.cat([torch.sin(proj), torch.cos(proj)], dim=-1) * scale
    if kind == "arccos":
        return torch.relu(proj) * scale
    if kind == "positive":
        proj = proj - 0.5 * x_scaled.pow(2).sum(-1, keepdim=True)
        if is_query:
            proj = proj - proj.detach().amax(dim=-1, keepdim=True)
        return torch.exp(proj) * scale
    raise ValueError(f"unknown feature map {kind!r}; expected one of {FEATURE_MAPS}")


def learned_feature_map(x: Tensor, w: Optional[Tensor], b: Optional[Tensor], kind: str) -> Tensor:
    """phi(x) of a learned map.   x: (B, H, T, d) raw, w: (H, D, d), b: (H, D) -> (B, H, T, F) fp32."""
    x = x if x.dtype == torch.float64 else x.float()
    if kind == "elu":
        return F.elu(x) + 1
    B, H, T, d = x.shape
    num_features = w.size(1)
    proj = torch.bmm(x.transpose(0, 1).reshape(H, B * T, d), w.to(x.dtype).transpose(-1, -2))  # (H, B*T, D)
    proj = (proj + b.to(x.dtype).unsqueeze(1)).view(H, B, T, num_features).transpose(0, 1)  # (B, H, T, D)
    return activate_learned(proj, kind)


# learned maps whose phi is activate(W x + b): the decoding step folds W, b into its projection
AFFINE_FEATURE_MAPS = ("hedgehog", "relu")


def activate_learned_pair(p_q: Tensor, p_k: Tensor, kind: str) -> Tuple[Tensor, Tensor]:
    """activate_learned of two pre-activations of one shape (a decoding step's q and k), in fp32, in a few
    whole-tensor operations (a decoding step on a GPU pays per operation).   p_q, p_k: (..., D) -> (..., F) each."""
    if kind != "hedgehog":
        return activate_learned(p_q.float(), kind), activate_learned(p_k.float(), kind)
    both = torch.empty((2,) + p_q.shape[:-1] + (2, p_q.size(-1)), dtype=torch.float32, device=p_q.device)  # (2, ..., 2, D)
    both[0, ..., 0, :].copy_(p_q)
    both[1, ..., 0, :].copy_(p_k)
    torch.neg(both[..., 0, :], out=both[..., 1, :])
    features = torch.softmax(both, dim=-1).flatten(-2)  # (2, ..., 2D): [softmax(p), softmax(-p)] as activate_learned
    return features[0], features[1]


def activate_learned(p: Tensor, kind: str) -> Tensor:
    """The activation of an affine learned map, on its pre-activations p = W x + b.   p: (..., D) -> (..., F)."""
    if kind == "hedgehog":
        return torch.cat([torch.softmax(p, dim=-1), torch.softmax(-p, dim=-1)], dim=-1)
    if kind == "relu":
        return torch.relu(p) * p.size(-1) ** -0.5
    raise ValueError(f"{kind!r} is not a learned map with an affine first stage ({', '.join(AFFINE_FEATURE_MAPS)})")
