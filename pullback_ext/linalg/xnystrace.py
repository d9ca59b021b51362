"""XNysTrace: the exchangeable Nyström trace estimator of a PSD operator (Epperly, Tropp & Webber,
"XTrace: Making the most of every sample in stochastic trace estimation", SIMAX 2024).

With test vectors Ω = [ω_1 … ω_m] (standard Gaussian) and Â_(i) the Nyström approximation of A
from every test vector but ω_i, each

    t_i = Tr Â_(i) + ω_iᵀ (A − Â_(i)) ω_i

is unbiased for Tr A (ω_i is independent of Â_(i)); the estimate is their mean and its error
estimate the standard error of the mean of the t_i. All m leave-one-out terms come from the
m×m factors of the full Nyström approximation, so the m matvecs are the whole cost.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch
from torch import Tensor

from pullback_ext.errors import PullbackError

SHIFT_RETRIES = 8


def _shifted_cholesky(Omega: Tensor, Y: Tensor, shift: float, max_shift: float) -> tuple[Tensor, float]:
    """Lower Cholesky factor L of H_ν = Ωᵀ(Y + νΩ) (symmetrised; float64 [m,m]) and the shift ν used.

    ν starts at ``shift``; while rounding leaves H_ν numerically indefinite (a deflated remainder
    at rounding level, say) it grows to twice what lifts the most negative eigenvalue of H = ΩᵀY
    above 0 (at least tenfold), but never past ``max_shift``: beyond that A is not PSD.
    """
    H = Omega.T @ Y
    H = 0.5 * (H + H.T)
    gram = Omega.T @ Omega
    for _ in range(SHIFT_RETRIES):
        L, info = torch.linalg.cholesky_ex(H + shift * gram)
        if int(info) == 0:
            return L, shift
        lift = -float(torch.linalg.eigvalsh(H)[0]) / float(torch.linalg.eigvalsh(gram)[0])
        shift = max(10.0 * shift, 2.0 * lift)
        if shift > max_shift:
            break
    raise PullbackError(f"matvec: the Nyström core Ωᵀ A Ω is not positive semidefinite even with shift {shift:.3g}; is A PSD?")


def leave_one_out_traces(Omega: Tensor, Y: Tensor, eps: float, scale: Optional[float] = None) -> Tensor:
    """The exchangeable estimates t[m] (float64) of Tr A from Ω[n,m] and Y = A Ω [n,m].

    ``scale``: the magnitude the rounding of Y is relative to (default ‖Y‖_F); the shift may grow
    to √eps·scale to absorb that rounding. Numerically stable Nyström (the paper's safeguards):
    A_ν = A + νI with ν = eps·‖Y‖_F to start,
    Y_ν = R-factor of a QR, H_ν = L Lᵀ by Cholesky, B = R L⁻ᵀ so that Â_ν = (QB)(QB)ᵀ. With
    s_i = L⁻¹ e_i, (H_ν⁻¹)_ii = ‖s_i‖² and Y_ν H_ν⁻¹ e_i = Q B s_i, hence

        t_i = ‖B‖_F² − ‖B s_i‖² / ‖s_i‖² + 1 / ‖s_i‖² − ν n

    (Nyström trace without ω_i, the Schur-complement residual ω_iᵀ(A_ν − Â_ν,(i))ω_i, the shift).
    """
    Omega, Y = Omega.double(), Y.double()
    n, m = Omega.shape
    norm = float(torch.linalg.matrix_norm(Y))
    if norm == 0.0:  # A Ω = 0 for Gaussian Ω: A = 0 almost surely
        return torch.zeros(m, dtype=torch.float64)
    L, shift = _shifted_cholesky(Omega, Y, eps * norm, math.sqrt(eps) * (norm if scale is None else max(scale, norm)))
    R = torch.linalg.qr(Y + shift * Omega, mode="r").R
    B = torch.linalg.solve_triangular(L, R.T, upper=False).T  # R L⁻ᵀ
    S = torch.linalg.solve_triangular(L, torch.eye(m, dtype=torch.float64, device=L.device), upper=False)
    s2 = (S**2).sum(0)
    BS2 = ((B @ S) ** 2).sum(0)
    t = (B**2).sum() - BS2 / s2 + 1.0 / s2 - shift * n
    return t.cpu()


def xnystrace(
    matvec: Callable[[Tensor], Tensor],
    n: int,
    probes: int,
    dtype: torch.dtype,
    device,
    generator: Optional[torch.Generator] = None,
    scale: Optional[float] = None,
) -> tuple[float, float]:
    """(estimate, standard error) of Tr A for a PSD A[n,n] known by ``matvec``: X[n,k] -> A X [n,k].

    Runs ``probes`` = m matvecs on standard Gaussian test vectors (2 ≤ m ≤ n; drawn on the CPU from
    ``generator``, in ``dtype`` on ``device``); the small algebra is in float64. The shift uses the
    machine epsilon of ``dtype`` (the precision of the matvecs); ``scale`` as in ``leave_one_out_traces``.
    """
    if not isinstance(probes, int) or isinstance(probes, bool) or probes < 2:
        raise PullbackError(f"probes: expected an int >= 2 (needed for a standard error), got {probes!r}")
    if probes > n:
        raise PullbackError(f"probes: XNysTrace needs at most n = {n} test vectors, got {probes}; use the exact trace")
    Omega = torch.randn(n, probes, generator=generator, dtype=torch.float64).to(dtype=dtype, device=device)
    t = leave_one_out_traces(Omega, matvec(Omega), torch.finfo(dtype).eps, scale)
    return float(t.mean()), float(t.std(unbiased=True) / math.sqrt(probes))
