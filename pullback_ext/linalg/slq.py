"""Stochastic Lanczos quadrature (SLQ) for spectral sums Tr f(A) of a PSD operator A."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import Tensor

from pullback_ext.linalg.operator import LinearOperatorBase
from pullback_ext.linalg.trace import rademacher
from pullback_ext.errors import PullbackError


@dataclass
class Quadrature:
    """Gauss quadrature nodes θ[m,k] and weights τ[m,k] (Σ_k τ = 1) of each probe, and dimension n.

    Tr f(A) ≈ n · mean_i Σ_k τ_ik f(θ_ik).
    """

    nodes: Tensor
    weights: Tensor
    n: int

    def trace_of(self, f: Callable[[Tensor], Tensor]) -> tuple[float, float]:
        """Estimate of Tr f(A) and its standard error over the probes."""
        per_probe = self.n * (self.weights * f(self.nodes)).sum(1)
        m = per_probe.numel()
        stderr = float(per_probe.std(unbiased=True) / math.sqrt(m)) if m > 1 else float("nan")
        return float(per_probe.mean()), stderr


def lanczos_quadrature(
    matvec: Callable[[Tensor], Tensor],
    n: int,
    probes: int,
    steps: int,
    dtype: torch.dtype,
    device,
    generator: Optional[torch.Generator] = None,
    batch: int = 32,
) -> Quadrature:
    """Runs ``probes`` independent Lanczos processes on the symmetric A (``matvec``: [n,b] -> [n,b]),
    ``batch`` at a time, each with full reorthogonalisation, and returns their quadrature rules.

    Each probe starts from a Rademacher vector; the k×k tridiagonal matrices are diagonalised in
    float64. A process that exhausts its Krylov space stops contributing (zero weights beyond).
    """
    if not isinstance(probes, int) or probes < 2:
        raise PullbackError(f"probes: expected an int >= 2, got {probes!r}")
    if not isinstance(steps, int) or steps < 1:
        raise PullbackError(f"steps: expected an int >= 1, got {steps!r}")
    k = min(steps, n)
    nodes, weights = [], []
    for start in range(0, probes, batch):
        b = min(batch, probes - start)
        Z = rademacher(n, b, generator, dtype, device)
        q = Z / math.sqrt(n)
        basis = torch.zeros(k, n, b, dtype=dtype, device=device)
        alpha = torch.zeros(b, k, dtype=torch.float64)
        beta = torch.zeros(b, k, dtype=torch.float64)
        alive = torch.ones(b, dtype=torch.bool, device=device)
        for j in range(k):
            basis[j] = q
            w = matvec(q)
            a = (q * w).sum(0)
            alpha[:, j] = a.double().cpu()
            # full reorthogonalisation against every stored vector, twice for stability
            for _ in range(2):
                w = w - torch.einsum("knb,kb->nb", basis[: j + 1], torch.einsum("knb,nb->kb", basis[: j + 1], w))
            nrm = w.norm(dim=0)
            scale = alpha[:, : j + 1].abs().max(dim=1).values.to(nrm.device, nrm.dtype).clamp_min(1e-30)
            alive = alive & (nrm > 1e3 * torch.finfo(dtype).eps * scale)
            beta[:, j] = torch.where(alive, nrm, torch.zeros_like(nrm)).double().cpu()
            q = torch.where(alive, w / nrm.clamp_min(torch.finfo(dtype).tiny), torch.zeros_like(w))
        T = torch.diag_embed(alpha) + torch.diag_embed(beta[:, :-1], 1) + torch.diag_embed(beta[:, :-1], -1)
        theta, S = torch.linalg.eigh(T)
        nodes.append(theta)
        weights.append(S[:, 0, :] ** 2)
    return Quadrature(torch.cat(nodes), torch.cat(weights), n)


def _xlogx(x: Tensor) -> Tensor:
    x = x.clamp_min(0)
    return torch.where(x > 0, x * torch.log(torch.where(x > 0, x, torch.ones_like(x))), torch.zeros_like(x))


@dataclass
class SpectralEntropy:
    """Full-spectrum effective rank exp(H), H = −Σ (λ/T) log(λ/T), estimated by SLQ."""

    r_eff: float
    entropy: float
    trace: float
    side: str
    exact: bool = False


def slq_effective_rank(
    op: LinearOperatorBase,
    probes: int = 100,
    steps: int = 30,
    generator: Optional[torch.Generator] = None,
    batch: int = 32,
) -> SpectralEntropy:
    """exp(H) over all eigenvalues of JᵀJ, using H = log T − (1/T) Σ λ log λ with both Σ λ = T and
    Σ λ log λ from the same SLQ probes. Lanczos runs on J Jᵀ (M×M) when M < P (same nonzero spectrum).
    When that side has at most ``steps`` dimensions, the matrix is formed from n products instead and
    the entropy is exact.
    """
    M, P = op.shape
    if M < P:
        side, n, matvec = "JJt", M, op.gram_t
    else:
        side, n, matvec = "JtJ", P, op.gram
    if n <= steps:
        A = matvec(torch.eye(n, dtype=op.dtype, device=op.device)).double()
        lam = torch.linalg.eigvalsh(0.5 * (A + A.T)).clamp_min(0)
        trace, xlogx, exact = float(lam.sum()), float(_xlogx(lam).sum()), True
    else:
        quad = lanczos_quadrature(matvec, n, probes, steps, op.dtype, op.device, generator, batch)
        trace, _ = quad.trace_of(lambda x: x.clamp_min(0))
        xlogx, _ = quad.trace_of(_xlogx)
        exact = False
    if not trace > 0:
        return SpectralEntropy(r_eff=0.0, entropy=float("nan"), trace=trace, side=side, exact=exact)
    entropy = math.log(trace) - xlogx / trace
    return SpectralEntropy(r_eff=math.exp(entropy), entropy=entropy, trace=trace, side=side, exact=exact)
