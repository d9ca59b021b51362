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


def _kept_in_order(flag: Tensor, count: int) -> Tensor:
    """Positions ``[B, count]`` of the ones of ``flag [B, n]`` (int64 0/1 with ``count`` ones per
    row), in increasing order: each position's rank among its kind, inverted by one scatter (no
    data-dependent shape, no sort: the form ``pullback_ext.export`` needs too)."""
    ones_first = flag.cumsum(1) - 1
    zeros_after = count + (1 - flag).cumsum(1) - 1
    slot = torch.where(flag == 1, ones_first, zeros_after)
    positions = torch.arange(flag.shape[1], device=flag.device).expand_as(flag)
    return torch.zeros_like(flag).scatter(1, slot, positions)[:, :count]


def _token_index(idx: Tensor, width: int) -> Tensor:
    return idx.unsqueeze(-1).expand(-1, -1, width)


def merge_tokens(x: Tensor, w: Tensor, src_idx: Tensor, dst_idx: Tensor) -> tuple[Tensor, Tensor]:
    """Weighted merge of src tokens into dst tokens with weight tracking.

    x [B,N,D], w [B,N], src_idx [B,R], dst_idx [B,R] -> (x' [B,N-R,D], w' [B,N-R]): the tokens not
    in src_idx in their original order; a dst token d becomes
    ``(w_d x_d + Σ_{s->d} w_s x_s) / (w_d + Σ_{s->d} w_s)`` (unchanged if that sum is 0) and its
    weight ``w_d + Σ_{s->d} w_s``. ``w'`` is computed from ``w`` alone, as the op's autograd has it
    (a ``w'`` needing grad with ``x`` would make the proportional-attention mask need grad too).
    """
    b, n, d = x.shape
    r = src_idx.shape[1]
    kept = _kept_in_order(torch.ones(b, n, dtype=torch.int64, device=x.device).scatter(1, src_idx, 0), n - r)
    w_new = torch.gather(w.scatter_add(1, dst_idx, torch.gather(w, 1, src_idx)), 1, kept)
    weighted = x * w.unsqueeze(-1)
    sums = weighted.scatter_add(1, _token_index(dst_idx, d), torch.gather(weighted, 1, _token_index(src_idx, d)))
    positive = w_new > 0
    merged = torch.gather(sums, 1, _token_index(kept, d)) / torch.where(positive, w_new, 1).unsqueeze(-1)
    return torch.where(positive.unsqueeze(-1), merged, torch.gather(x, 1, _token_index(kept, d))), w_new


def reinsert_tokens(kept: Tensor, kept_idx: Tensor, pruned: Tensor, pruned_idx: Tensor) -> Tensor:
    """Every token back at its position, one scatter: kept [B,K,D], pruned [B,R,D] -> [B,K+R,D]."""
    tokens = torch.cat([kept, pruned], dim=1)
    positions = torch.cat([kept_idx, pruned_idx], dim=1)
    return torch.zeros_like(tokens).scatter(1, _token_index(positions, tokens.shape[-1]), tokens)


def select_with_partners(order: Tensor, partner: Tensor, count: int) -> Tensor:
    """The greedy of ``ops.select_with_partners`` as a loop of tensor ops, one step per candidate,
    with int64 0/1 masks: order [B,n], partner [B,n] -> [B,count], the selected tokens in increasing
    order.

    Each taken source spares one partner, so at most as many candidates are skipped as are taken:
    the first 2·count candidates always fill the budget unless n < 2·count (then the fill-up does).
    """
    n = order.shape[1]
    partner_of_candidate = torch.gather(partner, 1, order)
    chosen = torch.zeros_like(order)
    spared = torch.zeros_like(order)
    taken = torch.zeros_like(order[:, :1])
    for j in range(min(n, 2 * count)):
        candidate, its_partner = order[:, j:j + 1], partner_of_candidate[:, j:j + 1]
        ok = (1 - torch.gather(spared, 1, candidate)) * (taken < count).long()  # [B,1]
        chosen = chosen.scatter(1, candidate, ok)  # every candidate comes once: it was 0
        spared = spared.scatter(1, its_partner, torch.maximum(torch.gather(spared, 1, its_partner), ok))
        taken = taken + ok
    left = 1 - torch.gather(chosen, 1, order)  # in candidate order
    fill = left * (left.cumsum(1) <= count - taken).long()
    chosen = torch.maximum(chosen, torch.zeros_like(chosen).scatter(1, order, fill))
    return _kept_in_order(chosen, count)
