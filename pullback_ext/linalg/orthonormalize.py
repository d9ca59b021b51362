"""Orthonormal basis of a tall-skinny block, through the project's ``block_orthonormalize`` op."""

from __future__ import annotations

from torch import Tensor

from pullback_ext import ops
from pullback_ext.errors import PullbackError


def orthonormalize(X: Tensor) -> Tensor:
    """X[P,k] (k ≤ P) -> Q[P,k] with QᵀQ = I spanning range(X) (completed when X is rank-deficient).

    Uses ``pullback_ext.ops.block_orthonormalize`` (CholeskyQR2 with Householder fallback).
    """
    if X.dim() != 2 or X.shape[1] > X.shape[0]:
        raise PullbackError(f"X: expected a tall-skinny block [P,k] with k <= P, got {tuple(X.shape)}")
    return ops.block_orthonormalize(X.unsqueeze(0))[0]
