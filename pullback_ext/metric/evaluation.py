"""Held-out evaluation: per-image Spearman ρ of importance scores, SPN subspace alignment."""

from __future__ import annotations

import math

import torch
from torch import Tensor
from pullback_ext.errors import PullbackError


def _ranks(x: Tensor) -> Tensor:
    """Average ranks (ties share their mean rank) along the last dim: [B,N] -> [B,N] float64."""
    x = x.double()
    order = x.argsort(-1)
    sorted_x = x.gather(-1, order)
    B, N = x.shape
    pos = torch.arange(N, dtype=torch.float64, device=x.device).expand(B, N)
    ranks_sorted = torch.empty_like(pos)
    for b in range(B):
        _, inverse, counts = torch.unique_consecutive(sorted_x[b], return_inverse=True, return_counts=True)
        starts = torch.cumsum(counts, 0) - counts
        ranks_sorted[b] = (starts + (counts - 1) / 2.0).double()[inverse]
    return torch.empty_like(pos).scatter_(-1, order, ranks_sorted)


def spearman_per_image(scores: Tensor, target: Tensor) -> Tensor:
    """Spearman ρ over the tokens of each image: scores, target[B,N] -> rho[B].

    An image whose scores or target are constant has no defined ρ: NaN for that image.
    """
    if scores.shape != target.shape or scores.dim() != 2:
        raise PullbackError(f"scores, target: expected two [B,N] tensors of one shape, got {tuple(scores.shape)} and {tuple(target.shape)}")
    if scores.shape[1] < 2:
        raise PullbackError(f"scores: expected N >= 2 tokens per image, got {scores.shape[1]}")
    a, b = _ranks(scores), _ranks(target)
    a = a - a.mean(-1, keepdim=True)
    b = b - b.mean(-1, keepdim=True)
    denom = (a.pow(2).sum(-1) * b.pow(2).sum(-1)).sqrt()
    return torch.where(denom > 0, (a * b).sum(-1) / denom.clamp_min(1e-300), torch.full_like(denom, math.nan))


def summarize(values: Tensor) -> dict:
    """mean, std (population), min, max and count of the finite values of a 1-D tensor."""
    v = values.double()
    v = v[torch.isfinite(v)]
    if v.numel() == 0:
        return {"mean": math.nan, "std": math.nan, "min": math.nan, "max": math.nan, "count": 0}
    return {
        "mean": float(v.mean()),
        "std": float(v.std(unbiased=False)),
        "min": float(v.min()),
        "max": float(v.max()),
        "count": int(v.numel()),
    }
