"""A hand-written, loop-based reference of ToFu (Kim et al., WACV 2024) as the comparisons in the
field run it, image by image with Python lists: ToMe's bipartite matching in every block; in the
blocks before ``merge_from`` the matched A token is pruned (its destination unchanged), from
``merge_from`` on it is merged with MLERP, the unweighted mean of the destination and its sources
rescaled by ``max(‖x_d‖, ‖x_s‖) / ‖x_d‖`` (``‖x_d‖`` the destination's norm before the merge)."""

from __future__ import annotations

import torch

from helpers.blocks import PLAIN, per_block_merge_reference


def _matched_groups(keys, p, k, r):
    """ToMe's matching on one image: ``(order, members)``; ``members[j]`` lists token ``j`` first,
    then the A tokens that merge into it."""
    set_a = [j for j in range(p, k) if j % 2 == 0]
    set_b = [j for j in range(p, k) if j % 2 == 1]
    r = min(r, len(set_a)) if set_b else 0
    metric = keys.mean(dim=0)
    unit = metric / metric.norm(dim=-1, keepdim=True)
    match = {a: max(set_b, key=lambda b: float(unit[a] @ unit[b])) for a in set_a}  # first of equal maxima
    gone = sorted(set_a, key=lambda a: -float(unit[a] @ unit[match[a]]))[:r]  # ties by position
    members = {j: [j] for j in range(k)}
    for a in gone:
        members[match[a]].append(a)
    return list(range(p)) + [a for a in set_a if a not in gone] + set_b, members


def mlerp(rows: list) -> torch.Tensor:
    """MLERP of a destination ``rows[0]`` and its sources ``rows[1:]`` (each ``[D]``)."""
    mean = sum(rows) / len(rows)
    return mean * (max(float(v.norm()) for v in rows) / float(rows[0].norm()))


def tofu_step(x, keys, sizes, sources, p, r, prune):
    """One ToFu step on one image ``x [K, D]`` (``keys [H, K, hd]``): pruned when ``prune``, else MLERP."""
    order, members = _matched_groups(keys, p, x.shape[0], r)
    rows, new_sizes, new_sources = [], [], []
    for j in order:
        group = members[j]
        rows.append(x[j] if prune or len(group) == 1 else mlerp([x[m] for m in group]))
        new_sizes.append(sum(sizes[m] for m in group))
        new_sources.append([t for m in group for t in sources[m]])
    return torch.stack(rows), new_sizes, new_sources


def tofu_reference(model, images_, merges, merge_from=None, prop_attn=False, halves=PLAIN):
    """ToFu on each image: ``(final [B, N, D] normed, [after block i [B, N, D] for every block])``;
    block ``i`` asks for ``merges[i]`` merges, prunes when ``i < merge_from`` (default ``L // 2 + 1``
    of the model's ``L`` blocks) and merges with MLERP otherwise."""
    first_merge = len(model.blocks) // 2 + 1 if merge_from is None else merge_from

    def step(i, x, keys, sizes, sources, p, r):
        return tofu_step(x, keys, sizes, sources, p, r, prune=i < first_merge)

    return per_block_merge_reference(model, images_, merges, step, prop_attn, halves)
