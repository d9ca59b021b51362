"""How redundant a set of tokens is: the share of tokens that have a near-duplicate.

Token merging can only be judged on images whose tokens are not already near-copies of one
another (where merging them costs nothing); this measures that.
"""

from __future__ import annotations

import torch
from torch import Tensor

from pullback_ext.errors import PullbackError

NEAR_DUPLICATE_COSINE = 0.999


def near_duplicate_fraction(tokens: Tensor, threshold: float = NEAR_DUPLICATE_COSINE) -> Tensor:
    """tokens[B, n, D] (patch tokens, no prefix tokens) -> fraction[B]: the share of each image's
    tokens whose nearest other token (by cosine similarity) has cosine > ``threshold``."""
    if not isinstance(tokens, Tensor) or tokens.dim() != 3 or tokens.shape[1] < 2:
        shape = tuple(tokens.shape) if isinstance(tokens, Tensor) else type(tokens).__name__
        raise PullbackError(f"tokens: expected a tensor [B, n, D] with n >= 2, got {shape}")
    if not -1.0 <= threshold < 1.0:
        raise PullbackError(f"threshold: expected a cosine in [-1, 1), got {threshold}")
    unit = torch.nn.functional.normalize(tokens.double(), dim=-1)
    cosine = unit @ unit.transpose(1, 2)
    cosine.diagonal(dim1=1, dim2=2).fill_(-2.0)  # a token is not its own neighbour
    return (cosine.amax(dim=2) > threshold).double().mean(dim=1)
