"""Per-token sensitivity energy of a low-rank factorisation."""

from __future__ import annotations

from torch import Tensor

from pullback_ext import ops
from pullback_ext.errors import PullbackError


def token_energy(V: Tensor, sigma: Tensor, num_tokens: int) -> Tensor:
    """e_t = Σ_j σ_j² ‖v_j^{(t)}‖² for V[P,r] (P = N·D, token-major) and sigma[r] -> e[N] (float64)."""
    if V.dim() != 2 or V.shape[0] % num_tokens != 0 or sigma.shape != (V.shape[1],):
        raise PullbackError(
            f"V, sigma: expected V[N·D, r] with N={num_tokens} and sigma[r], got {tuple(V.shape)} and {tuple(sigma.shape)}"
        )
    lam = sigma.double() ** 2
    return ops.token_importance(V.double().unsqueeze(0), lam.unsqueeze(0), num_tokens)[0] ** 2
