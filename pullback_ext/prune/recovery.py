"""Recovery of pruned dense features: interpolate between the frozen copy and the kept neighbours.

Where a pruned token ``t`` is re-inserted for a dense decoder, its feature is

    x_t = α · x_t^frozen + (1 − α) · m_t,

with ``x_t^frozen`` its own feature at the layer where it was removed (the read-out layer) and
``m_t`` the mean of the *kept* patch tokens among its 8 grid neighbours at that layer. α = 1 is
Last-Layer Fusion's frozen copy; α = 0 fills the hole from the neighbours. A token none of whose
neighbours was kept takes the mean of every kept patch token of its image instead (documented
choice: the nearest kept ring would make the cost depend on the data). Used by the layer studies'
recovery endpoints and by TAP's learned recovery scale; both share this one definition.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from pullback_ext.errors import PullbackError


def kept_neighbour_mean(x: torch.Tensor, kept: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """Mean of the kept 8-neighbours of every patch token.

    ``x [B, N, D]`` patch-token features on a ``grid = (h, w)`` patch grid (row-major, N = h·w),
    ``kept [B, N]`` bool. Returns ``m [B, N, D]``; where a token has no kept neighbour, the mean of
    all kept tokens of its image (zero for an image with none kept).
    """
    b, n, d = _check(x, kept, grid)
    h, w = grid
    mask = kept.to(x.dtype)
    masked = (x * mask[..., None]).transpose(1, 2).reshape(b, d, h, w)
    ring = torch.ones(1, 1, 3, 3, dtype=x.dtype, device=x.device)
    ring[0, 0, 1, 1] = 0
    sums = F.conv2d(masked.reshape(b * d, 1, h, w), ring, padding=1).reshape(b, d, n).transpose(1, 2)
    counts = F.conv2d(mask.reshape(b, 1, h, w), ring, padding=1).reshape(b, n, 1)
    image_mean = (x * mask[..., None]).sum(1, keepdim=True) / mask.sum(1).clamp_min(1)[:, None, None]
    local = sums / counts.clamp_min(1)
    return torch.where(counts > 0, local, image_mean.expand_as(x))


def recover(x: torch.Tensor, kept: torch.Tensor, grid: tuple[int, int], alpha) -> torch.Tensor:
    """``x`` with every pruned token replaced by ``α·x_t + (1 − α)·m_t`` (kept tokens unchanged).

    ``alpha``: a float in [0, 1], or a tensor broadcastable to ``[B, 1, 1]`` (a per-image scale,
    e.g. learned). Shapes as in :func:`kept_neighbour_mean`.
    """
    if not torch.is_tensor(alpha):
        if not 0.0 <= float(alpha) <= 1.0:
            raise PullbackError(f"alpha must lie in [0, 1], got {alpha}")
        alpha = torch.tensor(float(alpha), dtype=x.dtype, device=x.device)
    m = kept_neighbour_mean(x, kept, grid)
    filled = alpha * x + (1 - alpha) * m
    return torch.where(kept[..., None], x, filled)


def recover_pruned(state, grid: tuple[int, int], alpha, newest: Optional[int] = None):
    """``state`` (a pruned :class:`~pullback_ext.prune.tokens.TokenState`) with the frozen features
    of its pruned tokens replaced by :func:`recover` of the full features at this layer, the kept
    tokens being its current ones: the ``newest`` frozen rows only (those pruned last), or all.
    ``alpha`` as in :func:`recover`; ``grid``: the patch grid."""
    q = state.num_prefix
    full = state.full()
    kept = torch.zeros(full.shape[:2], dtype=torch.bool, device=full.device).scatter(1, state.positions, True)
    x = recover(full[:, q:], kept[:, q:], grid, alpha)
    start = 0 if newest is None else state.frozen.shape[1] - newest
    where = (state.frozen_positions[:, start:] - q)[..., None].expand(-1, -1, x.shape[-1])
    state.frozen = torch.cat([state.frozen[:, :start], torch.gather(x, 1, where)], dim=1)
    return state


def _check(x: torch.Tensor, kept: torch.Tensor, grid: tuple[int, int]) -> tuple[int, int, int]:
    if x.dim() != 3:
        raise PullbackError(f"x must be [B, N, D], got shape {tuple(x.shape)}")
    b, n, d = x.shape
    if kept.shape != (b, n) or kept.dtype != torch.bool:
        raise PullbackError(f"kept must be a bool tensor of shape {(b, n)}, got {kept.dtype} {tuple(kept.shape)}")
    h, w = grid
    if h * w != n:
        raise PullbackError(f"grid {grid} has {h * w} cells but x has {n} patch tokens")
    return b, n, d
