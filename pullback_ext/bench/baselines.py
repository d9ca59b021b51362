"""Eager baselines of the op benchmark where the targets name ToMe-style code rather than the
pure-torch references: a gather + scatter_reduce merge and a scatter reinsertion."""

from __future__ import annotations

import torch
from torch import Tensor


def tome_merge(x: Tensor, w: Tensor, src_idx: Tensor, dst_idx: Tensor) -> tuple[Tensor, Tensor]:
    """Eager ToMe-style weighted merge (gather + scatter_reduce), same result as merge_tokens."""
    B, N, D = x.shape
    R = src_idx.shape[1]
    xw = x * w.unsqueeze(-1)
    expand_src = src_idx.unsqueeze(-1).expand(-1, -1, D)
    expand_dst = dst_idx.unsqueeze(-1).expand(-1, -1, D)
    xw = xw.scatter_reduce(1, expand_dst, xw.gather(1, expand_src), reduce="sum")
    wsum = w.scatter_reduce(1, dst_idx, w.gather(1, src_idx), reduce="sum")
    keep = torch.ones(B, N, dtype=torch.bool, device=x.device).scatter(1, src_idx, False)
    kept = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)[:, : N - R]
    wk = wsum.gather(1, kept)
    xk = xw.gather(1, kept.unsqueeze(-1).expand(-1, -1, D)) / wk.unsqueeze(-1)
    return xk, wk


def tome_reinsert(kept: Tensor, kept_idx: Tensor, pruned: Tensor, pruned_idx: Tensor) -> Tensor:
    """Eager scatter-based reinsertion of kept and pruned tokens."""
    B, K, D = kept.shape
    out = kept.new_empty(B, K + pruned.shape[1], D)
    out.scatter_(1, kept_idx.unsqueeze(-1).expand(-1, -1, D), kept)
    out.scatter_(1, pruned_idx.unsqueeze(-1).expand(-1, -1, D), pruned)
    return out
