"""Pure-torch implementations of the ops in :mod:`pullback_ext.ops`.

They are the test oracle for the compiled kernels and the fallback for every dtype or device the
compiled code does not cover (e.g. float16 on the CPU, or a build without the extension). They
are written for clarity, not speed, and are differentiable through torch's autograd.

Shapes: B batch, N tokens, D channels, P = N·D ambient dimension, r rank, k vectors.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "lowrank_metric_apply",
    "lowrank_metric_quadform",
    "token_importance",
    "block_orthonormalize",
    "gather_tokens",
    "merge_tokens",
    "reinsert_tokens",
    "select_with_partners",
]


def lowrank_metric_apply(U: Tensor, lam: Tensor, v: Tensor, eps: float) -> Tensor:
    """``eps·v + U (lam ⊙ Uᵀ v)``: U [B,P,r], lam [B,r], v [B,P,k] -> [B,P,k]."""
    coeff = lam.unsqueeze(-1) * (U.transpose(1, 2) @ v)
    return eps * v + U @ coeff


def lowrank_metric_quadform(U: Tensor, lam: Tensor, v: Tensor, eps: float) -> Tensor:
    """``eps‖v‖² + Σ_j lam_j ⟨u_j, v⟩²``: U [B,P,r], lam [B,r], v [B,P,k] -> [B,k]."""
    proj = U.transpose(1, 2) @ v
    return eps * (v * v).sum(1) + (lam.unsqueeze(-1) * proj * proj).sum(1)


def token_importance(U: Tensor, lam: Tensor, num_tokens: int) -> Tensor:
    """``sqrt(Σ_j lam_j ‖u_j^(t)‖²)`` per token: U [B,N·D,r], lam [B,r] -> [B,N]."""
    B, P, r = U.shape
    blocks = U.reshape(B, num_tokens, P // num_tokens, r)
    energy = (blocks * blocks).sum(2)
    return (energy * lam.unsqueeze(1)).sum(-1).sqrt()


def block_orthonormalize(X: Tensor, return_r: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """Householder QR with diag(R) >= 0: X [B,P,r] -> Q [B,P,r] (and R [B,r,r]).

    Computed in float64 and cast back to X's dtype; for a rank-deficient X the columns of Q are
    still orthonormal (the basis is completed) and the matching diagonal entries of R are ~0.
    """
    Q, R = torch.linalg.qr(X.to(torch.float64), mode="reduced")
    sign = torch.where(R.diagonal(dim1=-2, dim2=-1) < 0, -1.0, 1.0).to(R.dtype)
    Q = (Q * sign.unsqueeze(-2)).to(X.dtype)
    R = (R * sign.unsqueeze(-1)).to(X.dtype)
    return (Q, R) if return_r else Q


def gather_tokens(x: Tensor, idx: Tensor) -> Tensor:
    """``x[b, idx[b, i]]``: x [B,N,D], idx [B,K] int64 -> [B,K,D]."""
    return torch.gather(x, 1, idx.unsqueeze(-1).expand(-1, -1, x.shape[-1]))


def merge_tokens(x: Tensor, w: Tensor, src_idx: Tensor, dst_idx: Tensor) -> tuple[Tensor, Tensor]:
    """Weighted merge of src tokens into dst tokens with weight tracking.

    x [B,N,D], w [B,N], src_idx [B,R], dst_idx [B,R] -> (x' [B,N-R,D], w' [B,N-R]): the tokens not
    in src_idx in their original order; a dst token d becomes
    ``(w_d x_d + Σ_{s->d} w_s x_s) / (w_d + Σ_{s->d} w_s)`` (unchanged if that sum is 0) and its
    weight ``w_d + Σ_{s->d} w_s``.
    """
    B, N, D = x.shape
    R = src_idx.shape[1]
    weighted = torch.cat([x * w.unsqueeze(-1), w.unsqueeze(-1)], dim=-1)
    moved = torch.gather(weighted, 1, src_idx.unsqueeze(-1).expand(-1, -1, D + 1))
    totals = weighted.scatter_add(1, dst_idx.unsqueeze(-1).expand(-1, -1, D + 1), moved)
    keep = torch.ones(B, N, dtype=torch.bool, device=x.device)
    keep[torch.arange(B, device=x.device).unsqueeze(1), src_idx] = False
    totals = totals[keep].reshape(B, N - R, D + 1)
    x_kept = x[keep].reshape(B, N - R, D)
    w_new = totals[..., D]
    positive = w_new > 0
    x_new = torch.where(positive.unsqueeze(-1), totals[..., :D] / torch.where(positive, w_new, 1).unsqueeze(-1), x_kept)
    return x_new, w_new


def reinsert_tokens(kept: Tensor, kept_idx: Tensor, pruned: Tensor, pruned_idx: Tensor) -> Tensor:
    """Every token back at its position: kept [B,K,D], pruned [B,R,D] -> [B,K+R,D]."""
    tokens = torch.cat([kept, pruned], dim=1)
    positions = torch.cat([kept_idx, pruned_idx], dim=1)
    order = torch.argsort(positions, dim=1)
    return torch.gather(tokens, 1, order.unsqueeze(-1).expand(-1, -1, kept.shape[-1]))


def select_with_partners(order: Tensor, partner: Tensor, count: int) -> Tensor:
    """The greedy of ``ops.select_with_partners`` as a loop of tensor ops, one step per candidate:
    order [B,n], partner [B,n] -> [B,count], the selected tokens in increasing order.

    Each taken source spares one partner, so at most as many candidates are skipped as are taken:
    the first 2·count candidates always fill the budget unless n < 2·count (then the fill-up does).
    """
    b, n = order.shape
    partner_of_candidate = torch.gather(partner, 1, order)
    chosen = torch.zeros(b, n, dtype=torch.bool, device=order.device)
    spared = torch.zeros_like(chosen)
    taken = torch.zeros(b, dtype=torch.long, device=order.device)
    rows = torch.arange(b, device=order.device)
    for j in range(min(n, 2 * count)):
        candidate = order[:, j]
        ok = ~spared[rows, candidate] & (taken < count)
        chosen[rows, candidate] |= ok
        spared[rows, partner_of_candidate[:, j]] |= ok
        taken += ok.long()
    left = (~torch.gather(chosen, 1, order)).long()
    fill = left.bool() & (left.cumsum(1) <= (count - taken)[:, None])
    chosen |= torch.zeros_like(chosen).scatter(1, order, fill)
    return torch.argsort((~chosen).to(torch.int8), dim=1, stable=True)[:, :count]
