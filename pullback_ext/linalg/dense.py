"""Exact spectrum of a Jacobian whose smaller side is small.

The exact trace already needs J's products with the standard basis of its smaller side (M VJPs
when M ≤ P); keeping those products instead of only their norms gives J itself, and one float64
eigendecomposition of its small Gram matrix then yields every singular value, the top right
singular vectors, the trace and the full spectral entropy, exactly and with no further Jacobian
products.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from pullback_ext.linalg.operator import LinearOperatorBase
from pullback_ext.linalg.orthonormalize import orthonormalize
from pullback_ext.linalg.slq import SpectralEntropy, _xlogx
from pullback_ext.linalg.trace import basis_products
from pullback_ext.errors import PullbackError

DENSE_MAX_BYTES = 1 << 30
_ROWS = 16384  # rows of the tall factor converted to float64 at a time
_NULL = 1e-6  # σ_j / σ_1 below this counts as zero


@dataclass
class DenseSpectrum:
    """sigma[min(M,P)] (float64, descending: every singular value), V[P,r] top right singular
    vectors (the operator's dtype), trace = Σ σ², entropy over the whole spectrum (exact)."""

    sigma: Tensor
    V: Tensor
    trace: float
    entropy: SpectralEntropy


def dense_fits(op: LinearOperatorBase, max_bytes: int = DENSE_MAX_BYTES) -> bool:
    """Whether J [M, P] fits in ``max_bytes`` (in the operator's dtype)."""
    M, P = op.shape
    return M * P * torch.empty((), dtype=op.dtype).element_size() <= max_bytes


def _tall_factor(op: LinearOperatorBase, chunk: int) -> Tensor:
    """Jᵀ [P, M] when M ≤ P, else J [M, P]: the basis products side by side."""
    return torch.cat(list(basis_products(op, chunk)), dim=1)


def jacobian_transposed(op: LinearOperatorBase, chunk: int = 64) -> Tensor:
    """Jᵀ [P, M] from ``min(M, P)`` products with the standard basis of the smaller side."""
    M, P = op.shape
    A = _tall_factor(op, chunk)
    return A if M <= P else A.T


def _gram(A: Tensor) -> Tensor:
    """AᵀA in float64 for a tall A, converting a block of rows at a time."""
    G = torch.zeros(A.shape[1], A.shape[1], dtype=torch.float64, device=A.device)
    for start in range(0, A.shape[0], _ROWS):
        block = A[start:start + _ROWS].double()
        G += block.T @ block
    return G


def dense_spectrum(op: LinearOperatorBase, rank: int, chunk: int = 64) -> DenseSpectrum:
    """Exact spectrum of J [M, P] from ``min(M, P)`` products (see the module docstring).

    Right singular vectors of zero singular values are completed to an orthonormal set; singular
    values below about 1e-8·σ_1 are limited by the float64 Gram matrix.
    """
    M, P = op.shape
    n = min(M, P)
    if not 1 <= rank <= n:
        raise PullbackError(f"rank: expected 1 <= r <= min(M, P) = {n}, got {rank}")
    A = _tall_factor(op, chunk)
    if not bool(torch.isfinite(A).all()):
        raise PullbackError("probe: Jacobian products are not finite (NaN or inf in J)")
    lam, W = torch.linalg.eigh(_gram(A))
    lam, W = lam.flip(0).clamp_min(0), W.flip(1)
    sigma = lam.sqrt()
    if M <= P:
        # v_j = Jᵀ w_j / σ_j with w_j an eigenvector of J Jᵀ; squaring J in the Gram matrix leaves
        # σ accurate to about 1e-8·σ_1, so smaller ones are treated as zero and their v_j completed
        scale = torch.where(sigma[:rank] > sigma[0] * _NULL, 1.0 / sigma[:rank], torch.zeros_like(sigma[:rank]))
        coef = W[:, :rank] * scale
        V = orthonormalize(torch.cat([A[s:s + _ROWS].double() @ coef for s in range(0, P, _ROWS)]))
    else:
        V = W[:, :rank]
    trace = float(lam.sum())
    side = "JJt" if M <= P else "JtJ"
    if trace > 0:
        entropy = math.log(trace) - float(_xlogx(lam).sum()) / trace
        ent = SpectralEntropy(r_eff=math.exp(entropy), entropy=entropy, trace=trace, side=side, exact=True)
    else:
        ent = SpectralEntropy(r_eff=0.0, entropy=float("nan"), trace=trace, side=side, exact=True)
    return DenseSpectrum(sigma=sigma, V=V.to(op.dtype).contiguous(), trace=trace, entropy=ent)
