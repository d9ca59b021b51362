"""Where a merged-away token goes: its nearest remaining patch token.

``pullback``: the single-token pullback distance of the learned metric,
``d(s, t)² = Σ_j λ_j ⟨u_j^(s), x_s − x_t⟩² + ε ‖x_s − x_t‖²`` with ``u_j^(s) ∈ R^D`` the block of
the SPN's ``U`` that belongs to the source token ``s``. ``cosine``: the largest cosine similarity.
Destinations are never prefix tokens (CLS, registers) nor other sources.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from pullback_ext.errors import PullbackError

MATCHINGS = ("pullback", "cosine")


def _candidate_mask(k: int, src: torch.Tensor, num_prefix: int) -> torch.Tensor:
    """``[B, K]`` bool: tokens that may receive a merge."""
    mask = torch.ones(src.shape[0], k, dtype=torch.bool, device=src.device).scatter(1, src, False)
    mask[:, :num_prefix] = False
    return mask


def pullback_distances(x: torch.Tensor, src: torch.Tensor, u: torch.Tensor, lam: torch.Tensor, eps: float) -> torch.Tensor:
    """Squared single-token pullback distances ``[B, R, K]`` from each source to every token.

    ``x [B, K, D]``, ``src [B, R]``, ``u [B, K*D, r]``, ``lam [B, r]``.
    """
    b, k, d = x.shape
    r = u.shape[-1]
    if tuple(u.shape) != (b, k * d, r) or tuple(lam.shape) != (b, r):
        raise PullbackError(f"SPN output must be U [{b}, {k * d}, r] and lam [{b}, r]; got {tuple(u.shape)} and {tuple(lam.shape)}")
    xf, uf, lamf = x.float(), u.float(), lam.float()
    u_src = torch.gather(uf.view(b, k, d, r), 1, src[:, :, None, None].expand(b, src.shape[1], d, r))  # [B,R,D,r]
    x_src = torch.gather(xf, 1, src[:, :, None].expand(b, src.shape[1], d))  # [B,R,D]
    proj = torch.einsum("brd,brdj->brj", x_src, u_src)[:, :, None, :] - torch.einsum("bkd,brdj->brkj", xf, u_src)
    dist = (proj.square() * lamf[:, None, None, :]).sum(-1)
    if eps:
        dist = dist + eps * torch.cdist(x_src, xf).square()
    return dist


def nearest_destinations(
    x: torch.Tensor,
    src: torch.Tensor,
    num_prefix: int,
    matching: str,
    spn: Optional[Callable] = None,
    eps: Optional[float] = None,
) -> torch.Tensor:
    """Destination ``[B, R]`` (indices into ``x``) of each source token ``src [B, R]``.

    ``eps`` is the isotropic floor of the pullback distance (default: the SPN's ``eps``, else 0).
    """
    k = x.shape[1]
    if matching == "pullback":
        if spn is None:
            raise PullbackError("matching='pullback' needs spn= (an SPN returning U and lam); use matching='cosine' without one")
        out = spn(x)
        u, lam = out[0], out[1]
        eps = float(getattr(spn, "eps", 0.0)) if eps is None else float(eps)
        dist = pullback_distances(x, src, u, lam, eps)
    elif matching == "cosine":
        xn = torch.nn.functional.normalize(x if x.dtype in (torch.float32, torch.float64) else x.float(), dim=-1)
        x_src = torch.gather(xn, 1, src[:, :, None].expand(-1, -1, x.shape[-1]))
        dist = -(x_src @ xn.transpose(1, 2))
    else:
        raise PullbackError(f"matching must be one of {', '.join(MATCHINGS)}; got {matching!r}")
    allowed = _candidate_mask(k, src, num_prefix)
    dist = dist.masked_fill(~allowed[:, None, :], float("inf"))
    return dist.argmin(dim=-1)
