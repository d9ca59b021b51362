"""Spectral Pullback Network: F[B,N,D] -> a rank-r metric g_θ(F) = ε I + U diag(λ) Uᵀ (docs/formulas.md §3)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from pullback_ext.metric.trunk import TokenEncoder
from pullback_ext.errors import PullbackError


def orthonormalize(X: Tensor) -> Tensor:
    """X[B,P,r] -> Q[B,P,r] with orthonormal columns spanning X.

    Differentiable (Householder QR) when a gradient is needed; otherwise the fused
    ``block_orthonormalize`` kernel, which is forward-only. Half-precision inputs are
    orthonormalised in float32.
    """
    work = X if X.dtype in (torch.float32, torch.float64) else X.float()
    if torch.is_grad_enabled() and work.requires_grad:
        with torch.autocast(device_type=work.device.type, enabled=False):
            return torch.linalg.qr(work, mode="reduced").Q.contiguous()
    from pullback_ext import ops

    return ops.block_orthonormalize(work)


@dataclass
class LowRankMetric:
    """g(F) = ε I + U diag(λ) Uᵀ for a batch of feature maps, applied through the kernels.

    U[B,P,r] has orthonormal columns (P = N·D, token-major), lam[B,r] >= 0, eps >= 0.
    Vectors are given either as v[B,P,k] (k tangents per image) or as v[B,N,D] (one tangent
    shaped like the features).
    """

    U: Tensor
    lam: Tensor
    eps: float
    num_tokens: int

    def _as_columns(self, v: Tensor, name: str) -> tuple[Tensor, bool]:
        B, P, _ = self.U.shape
        if not isinstance(v, Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(v).__name__}")
        if v.dim() == 3 and v.shape[0] == B and v.shape[1] * v.shape[2] == P and v.shape[1] == self.num_tokens:
            return v.reshape(B, P, 1), True
        if v.dim() == 3 and v.shape[0] == B and v.shape[1] == P:
            return v, False
        raise PullbackError(
            f"{name}: expected shape [B={B},P={P},k] or [B={B},N={self.num_tokens},D={P // self.num_tokens}],"
            f" got {tuple(v.shape)}"
        )

    def apply(self, v: Tensor) -> Tensor:
        """g v: [B,P,k] -> [B,P,k], or [B,N,D] -> [B,N,D]."""
        from pullback_ext import ops

        cols, feature_shaped = self._as_columns(v, "v")
        out = ops.lowrank_metric_apply(self.U, self.lam, cols.to(self.U.dtype), self.eps)
        return out.reshape(v.shape) if feature_shaped else out

    def quadform(self, v: Tensor) -> Tensor:
        """vᵀ g v: [B,P,k] -> [B,k], or [B,N,D] -> [B]."""
        from pullback_ext import ops

        cols, feature_shaped = self._as_columns(v, "v")
        out = ops.lowrank_metric_quadform(self.U, self.lam, cols.to(self.U.dtype), self.eps)
        return out[:, 0] if feature_shaped else out

    def importance(self) -> Tensor:
        """imp_θ(t) = sqrt(Σ_j λ_j ‖u_j^(t)‖²): [B,N]."""
        from pullback_ext import ops

        return ops.token_importance(self.U, self.lam, self.num_tokens)


class SPN(nn.Module):
    """``spn(F[B,N,D]) -> (U[B,P,r], lam[B,r])``, P = N·D.

    Token encoder (TokenEncoder), per-token Linear(H→D·r) reshaped to P×r and orthonormalised
    into U; energy branch mean-pool → MLP → Softplus into λ > 0, times a fixed ``energy_scale``
    (a buffer set from the training targets with ``set_energy_scale``, so the Softplus works
    around 1 whatever the probe's units).
    """

    def __init__(self, dim: int, rank: int, hidden: int = 256, heads: int = 4, eps: float = 1e-3) -> None:
        super().__init__()
        if not isinstance(rank, int) or rank < 1:
            raise PullbackError(f"rank: expected a positive int, got {rank!r}")
        if not eps >= 0:
            raise PullbackError(f"eps: expected >= 0, got {eps!r}")
        self.dim, self.rank, self.hidden, self.heads, self.eps = dim, rank, hidden, heads, float(eps)
        self.encoder = TokenEncoder(dim, hidden, heads)
        self.basis = nn.Linear(hidden, dim * rank)
        self.energy = nn.Sequential(nn.LayerNorm(hidden), nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, rank))
        self.register_buffer("energy_scale", torch.ones(()))

    @torch.no_grad()
    def set_energy_scale(self, energies: Tensor) -> None:
        """Set the energy unit to the geometric mean of the positive target energies σ² given."""
        positive = energies[energies > 0].double()
        if positive.numel() == 0:
            raise PullbackError("energies: expected some positive target energies σ², got none")
        self.energy_scale.fill_(float(positive.log().mean().exp()))

    def config(self) -> dict:
        return {"dim": self.dim, "rank": self.rank, "hidden": self.hidden, "heads": self.heads, "eps": self.eps}

    def forward(self, F: Tensor) -> tuple[Tensor, Tensor]:
        h = self.encoder(F)
        B, N, _ = h.shape
        if self.rank > N * self.dim:
            raise PullbackError(f"rank: expected <= P = N·D = {N * self.dim}, got {self.rank}")
        X = self.basis(h).view(B, N, self.dim, self.rank).reshape(B, N * self.dim, self.rank)
        U = orthonormalize(X)
        lam = (nn.functional.softplus(self.energy(h.mean(1)).float()) + 1e-8) * self.energy_scale.float()
        return U.to(F.dtype), lam.to(F.dtype)

    def metric(self, F: Tensor, eps: float | None = None) -> LowRankMetric:
        """The learned metric at F[B,N,D] (ε defaults to the model's isotropic floor)."""
        U, lam = self(F)
        return LowRankMetric(U, lam, self.eps if eps is None else float(eps), F.shape[1])

    def distance(self, F1: Tensor, F2: Tensor, steps: int = 1, eps: float | None = None) -> Tensor:
        """Geodesic surrogate d(F1,F2) ≈ Σ_{k<K} sqrt(δᵀ g_θ(F1 + (k+½)δ) δ), δ = (F2−F1)/K: [B].

        K = ``steps``; K = 1 is the local (Mahalanobis-like) distance at the midpoint.
        """
        if not isinstance(steps, int) or steps < 1:
            raise PullbackError(f"steps: expected a positive int, got {steps!r}")
        for name, X in (("F1", F1), ("F2", F2)):
            self.encoder.check_input(X)
        if F1.shape != F2.shape:
            raise PullbackError(f"F2: expected the shape of F1 {tuple(F1.shape)}, got {tuple(F2.shape)}")
        B, N, D = F1.shape
        delta = (F2 - F1) / steps
        t = (torch.arange(steps, dtype=F1.dtype, device=F1.device) + 0.5).view(1, steps, 1, 1)
        points = (F1.unsqueeze(1) + t * delta.unsqueeze(1)).reshape(B * steps, N, D)
        g = self.metric(points, eps)
        tangents = delta.unsqueeze(1).expand(B, steps, N, D).reshape(B * steps, N * D, 1)
        q = g.quadform(tangents).view(B, steps)
        return q.clamp_min(0).sqrt().sum(1)
