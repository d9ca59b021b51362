"""Randomized SVD (Halko–Martinsson–Tropp) of a matrix-free operator, with block power rounds."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor

from pullback_ext.linalg.operator import LinearOperatorBase
from pullback_ext.linalg.orthonormalize import orthonormalize
from pullback_ext.errors import PullbackError


@dataclass
class RSVDResult:
    """Top-r singular triplets of J[M,P].

    sigma[r] (descending), V[P,r] right singular vectors, U[M,r] left singular vectors,
    defects[i] = 1 − alignment of the top-r subspace estimates before and after power round i+1,
    converged: the last defect fell below ``adaptive_tol`` (always True without a tolerance),
    power: the number of power rounds run.
    """

    sigma: Tensor
    V: Tensor
    U: Tensor
    defects: list[float] = field(default_factory=list)
    converged: bool = True
    power: int = 0

    @property
    def energy(self) -> float:
        """Σ_j σ_j² = ‖J V‖_F², the exact energy of the captured subspace."""
        return float((self.sigma.double() ** 2).sum())


def subspace_alignment(A: Tensor, B: Tensor) -> float:
    """‖AᵀB‖_F² / r for orthonormal A[P,r], B[P,r]: 1 for the same subspace, 0 for orthogonal ones."""
    if not isinstance(A, Tensor) or not isinstance(B, Tensor):
        raise TypeError("A, B: expected torch.Tensors [P,r]")
    if A.dim() != 2 or A.shape != B.shape:
        raise PullbackError(f"A, B: expected two [P,r] tensors of the same shape, got {tuple(A.shape)} and {tuple(B.shape)}")
    if A.shape[1] == 0:
        raise PullbackError("A, B: expected r >= 1 columns, got 0")
    C = A.double().T @ B.double()
    return float((C**2).sum() / A.shape[1])


def _ritz_top(Q: Tensor, Z: Tensor, rank: int) -> Tensor:
    """Top-`rank` Ritz vectors of JᵀJ on range(Q), given Z = JᵀJ Q."""
    H = Q.double().T @ Z.double()
    _, W = torch.linalg.eigh(0.5 * (H + H.T))
    return Q @ W[:, -rank:].flip(1).to(Q.dtype)


def randomized_svd(
    op: LinearOperatorBase,
    rank: int,
    oversample: int = 10,
    power: int = 2,
    generator: Optional[torch.Generator] = None,
    adaptive_tol: Optional[float] = None,
    max_power: int = 10,
) -> RSVDResult:
    """Top-``rank`` SVD of ``op`` from a Gaussian sketch with ``power`` rounds Ω ← orth(Jᵀ J Ω).

    With ``adaptive_tol`` set, ``power`` is ignored: rounds continue (at most ``max_power``) until
    the defect between the top-r subspace estimates of consecutive rounds is below the tolerance.

    Cost: (q + 1)·r0 JVPs and q·r0 VJPs with r0 = min(rank + oversample, P).
    """
    if not isinstance(op, LinearOperatorBase):
        raise TypeError(f"op: expected a JacobianOperator-like operator, got {type(op).__name__}")
    M, P = op.shape
    if not isinstance(rank, int) or rank < 1 or rank > min(M, P):
        raise PullbackError(f"rank: expected an int in [1, min(M, P) = {min(M, P)}] (M={M}, P={P}), got {rank!r}")
    if not isinstance(oversample, int) or oversample < 0:
        raise PullbackError(f"oversample: expected an int >= 0, got {oversample!r}")
    if not isinstance(power, int) or power < 0:
        raise PullbackError(f"power: expected an int >= 0, got {power!r}")
    if adaptive_tol is not None and not (0 < adaptive_tol < 1):
        raise PullbackError(f"adaptive_tol: expected a float in (0, 1) or None, got {adaptive_tol!r}")
    if not isinstance(max_power, int) or max_power < 1:
        raise PullbackError(f"max_power: expected an int >= 1, got {max_power!r}")
    r0 = min(rank + oversample, P)

    omega = torch.randn(P, r0, generator=generator, dtype=torch.float64, device="cpu")
    Q = orthonormalize(omega.to(dtype=op.dtype, device=op.device))
    rounds = max_power if adaptive_tol is not None else power
    defects: list[float] = []
    previous: Optional[Tensor] = None
    converged = adaptive_tol is None
    done = 0
    for _ in range(rounds):
        done += 1
        Z = op.gram(Q)
        current = _ritz_top(Q, Z, rank)
        if previous is not None:
            defects.append(1.0 - subspace_alignment(previous, current))
        previous = current
        Q = orthonormalize(Z)
        if adaptive_tol is not None and defects and defects[-1] < adaptive_tol:
            converged = True
            break
    B = op.jvp(Q)
    Ub, S, Wh = torch.linalg.svd(B.double(), full_matrices=False)
    V = Q @ Wh[:rank].T.to(Q.dtype)
    if previous is not None:
        defects.append(1.0 - subspace_alignment(previous, V))
    return RSVDResult(
        sigma=S[:rank].to(op.dtype),
        V=V,
        U=Ub[:, :rank].to(op.dtype),
        defects=defects,
        converged=converged,
        power=done,
    )
