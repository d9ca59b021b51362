"""Training losses of the SPN (RandNLA supervision) and the importance head (docs/formulas.md §3)."""

from __future__ import annotations

import torch
from torch import Tensor
from pullback_ext.errors import PullbackError


def _check_pair(a: Tensor, b: Tensor, names: tuple[str, str]) -> None:
    if a.shape != b.shape:
        raise PullbackError(f"{names[1]}: expected the shape of {names[0]} {tuple(a.shape)}, got {tuple(b.shape)}")


def _check_bases(U: Tensor, V: Tensor) -> None:
    if U.dim() != 3 or V.dim() != 3 or U.shape[:2] != V.shape[:2] or V.shape[2] > U.shape[2]:
        raise PullbackError(f"U, V: expected U[B,P,r] and V[B,P,m] with m <= r, got {tuple(U.shape)} and {tuple(V.shape)}")


def subspace_alignment(U: Tensor, V: Tensor) -> Tensor:
    """Per-image alignment ‖UᵀV‖_F²/m: U[B,P,r], V[B,P,m] orthonormal, m <= r -> [B].

    For m = r this is docs/formulas.md §2's ‖AᵀB‖_F²/r; for m < r (a probe with fewer than r nonzero modes)
    it is the fraction of the target subspace that U captures.
    """
    _check_bases(U, V)
    overlap = torch.einsum("bpi,bpj->bij", U, V.to(U.dtype))
    return overlap.pow(2).sum((1, 2)) / V.shape[-1]


def subspace_loss(U: Tensor, V: Tensor) -> Tensor:
    """Grassmannian loss 1 − ‖UᵀV‖_F²/m averaged over the batch (order-free)."""
    return 1.0 - subspace_alignment(U, V).mean()


def pairing_loss(U: Tensor, V: Tensor, mask: Tensor) -> Tensor:
    """1 − ⟨u_j, v̂_j⟩² averaged over the masked (non-degenerate) modes j < m.

    L_sub leaves the order of U's columns free, but λ_j is matched to the j-th target energy, and
    imp_θ and g_θ pair λ_j with u_j; this term ties column j to mode j wherever mode j is well
    separated from its neighbours (the same modes L_en supervises).
    """
    _check_bases(U, V)
    m = V.shape[-1]
    cos2 = (U[..., :m] * V.to(U.dtype)).sum(1).pow(2)
    return ((1.0 - cos2) * mask).sum() / mask.sum().clamp_min(1)


def nondegenerate_modes(sigma: Tensor, rank: int, ratio: float = 1.05) -> Tensor:
    """Modes whose energy can be supervised: mask[B,rank] from sigma[B,>=rank] (descending).

    Modes j and j+1 with σ_j/σ_{j+1} < ``ratio`` can swap between estimates, so both are
    excluded; the last mode is compared with σ_{rank+1} when that is given. Zero modes (no
    energy to match in log space) are excluded as well.
    """
    if sigma.dim() != 2 or sigma.shape[1] < rank:
        raise PullbackError(f"sigma: expected shape [B, >= {rank}], got {tuple(sigma.shape)}")
    s = sigma.double()
    tiny = torch.finfo(s.dtype).tiny
    close = s[:, :-1] / s[:, 1:].clamp_min(tiny) < ratio
    mask = torch.ones_like(s, dtype=torch.bool)
    mask[:, :-1] &= ~close
    mask[:, 1:] &= ~close
    mask &= s > s[:, :1] * 1e-6
    return mask[:, :rank]


def energy_loss(lam: Tensor, energy: Tensor, mask: Tensor) -> Tensor:
    """MSE(log λ, log Ŝ²) over the masked modes; lam, energy, mask[B,r] (mode j ↔ λ_j)."""
    _check_pair(lam, energy, ("lam", "energy"))
    _check_pair(lam, mask, ("lam", "mask"))
    safe = torch.where(mask, energy.to(lam.dtype), torch.ones_like(lam))
    err = (lam.log() - safe.log()).pow(2) * mask
    return err.sum() / mask.sum().clamp_min(1)


def log_regression_loss(scores: Tensor, target: Tensor) -> Tensor:
    """MSE between predicted log-importance scores[B,N] and log target[B,N] (target > 0)."""
    _check_pair(scores, target, ("scores", "target"))
    return (scores - target.to(scores.dtype).clamp_min(1e-30).log()).pow(2).mean()


def ranking_loss(scores: Tensor, target: Tensor) -> Tensor:
    """Pairwise logistic ranking loss over all token pairs of each image.

    Mean over ordered pairs (s, t) with target_s > target_t of log(1 + exp(−(score_s − score_t))).
    """
    _check_pair(scores, target, ("scores", "target"))
    diff = scores.unsqueeze(2) - scores.unsqueeze(1)
    better = (target.unsqueeze(2) > target.unsqueeze(1)).to(scores.dtype)
    return (torch.nn.functional.softplus(-diff) * better).sum() / better.sum().clamp_min(1)


def importance_loss(scores: Tensor, target: Tensor, w_rank: float = 0.5) -> Tensor:
    """Log-space regression + ``w_rank`` × pairwise ranking loss."""
    loss = log_regression_loss(scores, target)
    if w_rank:
        loss = loss + w_rank * ranking_loss(scores, target)
    return loss
