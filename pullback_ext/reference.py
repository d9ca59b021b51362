"""Pure-torch implementations of the ops in :mod:`pullback_ext.ops`.

They are the test oracle for the compiled kernels and the fallback for every dtype or device the
compiled code does not cover (e.g. float16 on the CPU, or a build without the extension). They
are written for clarity, not speed, and are differentiable through torch's autograd.

Shapes: B batch, N tokens, D channels, P = N·D ambient dimension, r rank, k vectors.
"""

from __future__ import annotations

from typing import Optional

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
    "merge_step",
    "agglomerate",
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


# --- the greedy agglomeration of ATC and importance_cluster (agglomerate) -----------------------


def set_line(matrix: Tensor, at: Tensor, row: Tensor) -> Tensor:
    """``matrix [B, n, n]`` with row and column ``at [B]`` replaced by ``row [B, n]`` (symmetric). Out
    of place, so that the loop stays functional where export decomposes the op into it."""
    b, n, _ = matrix.shape
    index = at[:, None, None]
    matrix = matrix.scatter(1, index.expand(b, 1, n), row[:, None, :])
    return matrix.scatter(2, index.expand(b, n, 1), row[:, :, None])


def _linked(first: Tensor, second: Tensor, linkage: str) -> Tensor:
    if linkage == "single":
        return torch.minimum(first, second)
    if linkage == "complete":
        return torch.maximum(first, second)
    return first + second


def bound_weight(energy_a: Tensor, size_a: Tensor, energy_b: Tensor, size_b: Tensor) -> Tensor:
    """``(E_a S_b² + E_b S_a²) / (S_a + S_b)²`` (broadcast), the weight of importance_cluster's bound."""
    return (energy_a * size_b.square() + energy_b * size_a.square()) / (size_a + size_b).square()


def agglomerate(dist: Tensor, sizes: Optional[Tensor], energy: Optional[Tensor], count: int, linkage: str) -> Tensor:
    """The greedy agglomeration of ``ops.agglomerate`` as a loop of ``n - count`` steps of tensor
    ops: dist [B,n,n], sizes and energy [B,n] (``bound`` only) -> owner [B,n], the smallest member of
    each point's cluster. Each step merges the pair ``(a, z)`` of the least value, the first minimum
    of the symmetric matrix in row-major order (``a < z``), and updates the merged cluster's row."""
    if linkage == "bound":
        return _agglomerate_bound(dist, sizes, energy, count)
    b, n, _ = dist.shape
    totals = dist
    counts = torch.ones(b, n, dtype=dist.dtype, device=dist.device)
    owner = torch.arange(n, device=dist.device).expand(b, n)
    for _ in range(n - count):
        flat = dist.flatten(1).argmin(dim=1)
        a, z = flat // n, flat % n  # a < z: the first minimum of a symmetric matrix
        pair = torch.stack([a, z], dim=1)
        rows = torch.gather(totals, 1, pair[:, :, None].expand(b, 2, n))
        merged = _linked(rows[:, 0], rows[:, 1], linkage).scatter(1, pair, float("inf"))
        counts = counts.scatter_add(1, a[:, None], torch.gather(counts, 1, z[:, None]))
        totals = set_line(set_line(totals, z, torch.full_like(merged, float("inf"))), a, merged)
        dist = (set_line(set_line(dist, z, torch.full_like(merged, float("inf"))), a,
                         merged / (torch.gather(counts, 1, a[:, None]) * counts)) if linkage == "average" else totals)
        owner = torch.where(owner == z[:, None], a[:, None], owner)
    return owner


def _agglomerate_bound(squared: Tensor, sizes: Tensor, energy: Tensor, count: int) -> Tensor:
    """``agglomerate`` with the bound linkage: ``squared`` the squared distances of the points'
    centres, each merged centre's distances by Lance–Williams for centroids (clamped at 0)."""
    b, n, _ = squared.shape
    eye = torch.eye(n, dtype=torch.bool, device=squared.device)
    cost = (bound_weight(energy[:, :, None], sizes[:, :, None], energy[:, None], sizes[:, None]) * squared).masked_fill(
        eye, float("inf"))
    active = torch.ones(b, n, dtype=torch.bool, device=squared.device)
    owner = torch.arange(n, device=squared.device).expand(b, n)
    for _ in range(n - count):
        flat = cost.flatten(1).argmin(dim=1)
        a, z = (flat // n)[:, None], (flat % n)[:, None]  # a < z: the first minimum of a symmetric matrix
        size_a, size_z = sizes.gather(1, a), sizes.gather(1, z)
        merged_size, merged_energy = size_a + size_z, energy.gather(1, a) + energy.gather(1, z)
        row_a = squared.gather(1, a[..., None].expand(b, 1, n))[:, 0]
        row_z = squared.gather(1, z[..., None].expand(b, 1, n))[:, 0]
        between = row_a.gather(1, z)
        centre = ((size_a * row_a + size_z * row_z) / merged_size
                  - size_a * size_z * between / (merged_size * merged_size)).clamp_min(0.0)
        sizes, energy = sizes.scatter(1, a, merged_size), energy.scatter(1, a, merged_energy)
        active = active.scatter(1, z, False)
        row = (bound_weight(merged_energy, merged_size, energy, sizes) * centre).masked_fill(~active, float("inf"))
        squared = set_line(squared, a[:, 0], centre)
        cost = set_line(set_line(cost, z[:, 0], torch.full_like(row, float("inf"))), a[:, 0], row.scatter(1, a, float("inf")))
        owner = torch.where(owner == z, a, owner)
    return owner


# --- one merge step of ToMe's loop (merge_step) -------------------------------------------------
# The ranking rules' pieces are the library's one implementation: pullback_ext.prune.methods
# (merging, tome, pitome, importance_tome) run them unfused, and merge_step composes them.

def working_precision(x: Tensor) -> Tensor:
    """``x`` itself in float32/float64; reduced-precision tokens are scored in float32."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def key_metric(keys: Tensor) -> Tensor:
    """Unit vectors ``[B, K, hd]`` of the keys ``[B, H, K, hd]`` averaged over heads: ToMe's matching metric."""
    return torch.nn.functional.normalize(working_precision(keys.mean(dim=1)), dim=-1)


def bipartite_count(r: int, num_prefix: int, num_patch: int) -> int:
    """Tokens one ToMe merge takes: ``r`` clipped to ``|A|``, 0 when B is empty (a lone patch token)."""
    k = num_prefix + num_patch
    size_a = (k + 1) // 2 - (num_prefix + 1) // 2  # even positions in [num_prefix, k)
    return min(r, size_a) if num_patch - size_a > 0 else 0


def pitome_count(r: int, num_patch: int) -> int:
    """Tokens one PiToMe block merges: ``r`` clipped to half the ``num_patch`` current patch tokens (the
    ``2k`` candidates of the later blocks must be patch tokens)."""
    return min(r, num_patch // 2)


def merge_step_count(rule: str, r: int, num_prefix: int, k: int) -> int:
    """Tokens :func:`merge_step` merges away among ``k`` tokens (``num_prefix`` of them prefix) under ``rule``."""
    return pitome_count(r, k - num_prefix) if rule.startswith("pitome") else bipartite_count(r, num_prefix, k - num_prefix)


def alternating_order(num_prefix: int, k: int, batch: int, device) -> tuple[Tensor, int]:
    """ToMe's split of ``k`` tokens: ``(order [batch, k], |A|)`` with the order ``[prefix, A, B]``,
    A the even positions and B the odd ones among ``num_prefix .. k-1``."""
    first_even = num_prefix + num_prefix % 2
    set_a = torch.arange(first_even, k, 2, device=device)
    set_b = torch.arange(num_prefix + 1 - num_prefix % 2, k, 2, device=device)
    return torch.cat([torch.arange(num_prefix, device=device), set_a, set_b]).expand(batch, k), set_a.numel()


def matching_from_scores(order: Tensor, a_start: int, size_a: int, score: Tensor, match: Tensor,
                         count: int, descending: bool = True) -> tuple[Tensor, Tensor, Tensor]:
    """ToMe's rule on a split sequence ``order [B, K]`` ending with set A (``size_a`` positions from
    ``a_start``) and then set B: ``(order, src, dst)``, the ``count`` A tokens of the highest ``score
    [B, |A|]`` (lowest with ``descending=False``; ties by position) merging into their ``match [B, |A|]``
    (an index into B)."""
    src = torch.argsort(score, dim=1, descending=descending, stable=True)[:, :count]  # into A
    dst = torch.gather(match, 1, src) + a_start + size_a
    return order, src + a_start, dst


def best_match(metric: Tensor, order: Tensor, a_start: int, size_a: int) -> tuple[Tensor, Tensor]:
    """``(similarity [B, |A|], match [B, |A|])``: each A token's most similar B token by the unit
    vectors ``metric [B, K, d]`` of the current tokens (``order``, ``a_start``, ``size_a`` as in
    :func:`matching_from_scores`)."""
    ordered = torch.gather(metric, 1, order[..., None].expand(-1, -1, metric.shape[-1]))
    set_a, set_b = ordered[:, a_start:a_start + size_a], ordered[:, a_start + size_a:]
    return (set_a @ set_b.transpose(1, 2)).max(dim=-1)


def pair_costs(metric_a: Tensor, metric_b: Tensor, e_a: Tensor, e_b: Tensor, s_a: Tensor, s_b: Tensor, guard: float,
               partner: str) -> tuple[Tensor, Tensor]:
    """``(cost [B, |A|], match [B, |A|])``: each A token's merge cost and its partner in B.

    ``metric_a [B, |A|, hd]``, ``metric_b [B, |B|, hd]``: unit head-mean keys; ``e_*``, ``s_*``
    ``[B, |A|]`` / ``[B, |B|]``: energies and sizes. ``partner="cosine"``: ToMe's match (the largest
    cosine), costing ``e_a^(guard/2) · (1 − cos)``; ``"bound"``: the B token of the smallest
    ``((e_a s_b² + e_b s_a²) / (s_a + s_b)²)^(guard/2) · ‖a − b‖``."""
    cos = metric_a @ metric_b.transpose(1, 2)  # [B, |A|, |B|]
    if partner == "cosine":
        best, match = cos.max(dim=-1)
        return e_a.pow(guard / 2) * (1 - best), match
    dist = (2 - 2 * cos).clamp_min(0).sqrt()
    total = s_a[:, :, None] + s_b[:, None, :]
    moved = (e_a[:, :, None] * s_b[:, None, :].square() + e_b[:, None, :] * s_a[:, :, None].square()) / total.square()
    return (moved.pow(guard / 2) * dist).min(dim=-1)


def pitome_energy(metric: Tensor, margin: float, alpha: float) -> Tensor:
    """PiToMe's energy ``[B, n]`` of ``n`` tokens with unit vectors ``metric [B, n, hd]``: the mean
    over all ``n`` tokens of ``ELU(cos − margin, alpha)``."""
    cos = metric @ metric.transpose(1, 2)
    return torch.nn.functional.elu(cos - margin, alpha=alpha).mean(dim=-1)


def energy_order(ranked: Tensor, num_prefix: int, candidates: int) -> tuple[Tensor, int, int]:
    """``(order [B, K], a_start, |A|)``: the current indices as ``[prefix, protected, A, B]`` from the
    patch tokens ``ranked [B, n]`` by descending energy, the first ``candidates`` alternating
    between A and B, the rest protected."""
    prefix = torch.arange(num_prefix, device=ranked.device).expand(ranked.shape[0], num_prefix)
    chosen, protected = ranked[:, :candidates], ranked[:, candidates:]
    order = torch.cat([prefix, protected, chosen[:, 0::2], chosen[:, 1::2]], dim=1)
    return order, num_prefix + protected.shape[1], (candidates + 1) // 2


def positions_after_merge(order: Tensor, src: Tensor, dst: Tensor) -> Tensor:
    """``[B, K]``: where each current token is after the merge. ``order [B, K]``: the current index
    at each position of the reordered sequence; ``src``, ``dst [B, R]``: positions in it."""
    kept = torch.ones_like(order).scatter(1, src, 0)
    rank = kept.cumsum(1) - 1
    rank = rank.scatter(1, src, torch.gather(rank, 1, dst))  # a merged token goes where its match goes
    return torch.empty_like(rank).scatter(1, order, rank)


def places_after_merge(order: Tensor, src: Tensor) -> Tensor:
    """``[B, K - R]``: the current index at each position of the merged sequence (the reordered
    ``order [B, K]`` without its merged-away positions ``src [B, R]``; a destination keeps its place)."""
    kept = _kept_in_order(torch.ones_like(order).scatter(1, src, 0), order.shape[1] - src.shape[1])
    return torch.gather(order, 1, kept)


def guarded_ranking(metric: Tensor, sizes: Tensor, energy: Tensor, num_prefix: int, count: int, guard: float,
                    partner: str) -> tuple[Tensor, Tensor, Tensor]:
    """importance_tome's matching ``(order, src, dst)`` of ``count`` merges on the unit keys ``metric
    [B, K, hd]``, ``sizes`` and ``energy [B, K]``: the order ``[prefix, A, B]``, the ``count`` A tokens of
    the lowest :func:`pair_costs` into their partner."""
    p, (b, k, hd) = num_prefix, metric.shape
    order, size_a = alternating_order(p, k, b, metric.device)
    metric = torch.gather(metric, 1, order[..., None].expand(-1, -1, hd))
    sizes, energy = torch.gather(sizes, 1, order).to(metric.dtype), torch.gather(energy, 1, order)
    a, bb = slice(p, p + size_a), slice(p + size_a, k)
    cost, match = pair_costs(metric[:, a], metric[:, bb], energy[:, a], energy[:, bb], sizes[:, a], sizes[:, bb],
                             guard, partner)
    return matching_from_scores(order, p, size_a, cost, match, count, descending=False)


def merge_step_ranking(keys: Tensor, sizes: Tensor, energy: Optional[Tensor], num_prefix: int, count: int, rule: str,
                       guard: float, margin: float, alpha: float) -> tuple[Tensor, Tensor, Tensor]:
    """The matching ``(order [B, K], src, dst [B, count])`` of :func:`merge_step`'s ``rule`` (``count`` >= 1)."""
    p, (b, _, k, _) = num_prefix, keys.shape
    metric = key_metric(keys)
    if rule in ("cosine", "bound"):
        return guarded_ranking(metric, sizes, energy, p, count, guard, rule)
    if rule == "tome":
        (order, size_a), a_start = alternating_order(p, k, b, keys.device), p
    else:
        ranked = torch.argsort(pitome_energy(metric[:, p:], margin, alpha), dim=1, descending=True, stable=True) + p
        order, a_start, size_a = energy_order(ranked, p, 2 * count if rule == "pitome_protected" else k - p)
    best, match = best_match(metric, order, a_start, size_a)
    return matching_from_scores(order, a_start, size_a, best, match, count)


def merge_step(x: Tensor, keys: Tensor, sizes: Optional[Tensor], energy: Optional[Tensor], owner: Optional[Tensor],
               positions: Optional[Tensor], num_prefix: int, r: int, rule: str, guard: float, margin: float,
               alpha: float) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """One merge of ToMe's loop on the tokens ``x [B, K, D]`` matched by ``rule`` on ``keys [B, H, K, hd]``
    (see ``ops.merge_step``): ``(x', sizes', energy', owner', positions')``."""
    b, k, _ = x.shape
    count = merge_step_count(rule, r, num_prefix, k)
    sizes = torch.ones(b, k, dtype=x.dtype, device=x.device) if sizes is None else sizes
    index = torch.arange(k, device=x.device).expand(b, k)
    if count == 0:
        return (x.clone(), sizes.clone(), x.new_empty(0) if energy is None else energy.clone(),
                index.clone() if owner is None else owner.clone(), index.clone() if positions is None else positions.clone())
    order, src, dst = merge_step_ranking(keys, sizes, energy, num_prefix, count, rule, guard, margin, alpha)
    x_out, sizes_out = merge_tokens(gather_tokens(x, order), torch.gather(sizes, 1, order), src, dst)
    energy_out = x.new_empty(0)
    if energy is not None:
        ordered = torch.gather(energy, 1, order)
        energy_out = merge_tokens(torch.ones_like(ordered[..., None]), ordered, src, dst)[1]
    new_index, places = positions_after_merge(order, src, dst), places_after_merge(order, src)
    owner_out = new_index if owner is None else torch.gather(new_index, 1, owner)
    return x_out, sizes_out, energy_out, owner_out, places if positions is None else torch.gather(positions, 1, places)
