"""Oracles of ``pullback_ext.prune.matching.select_with_partners``, the greedy choice of merge
sources that spares the partner of every source it takes.

- :func:`select_with_partners_loop`: the library's implementation before the greedy became one op,
  kept as it was (a loop of tensor ops, one step per candidate): the new one must select exactly
  what it selected.
- :func:`greedy_per_image`: the rule written out on Python lists, one image at a time.
"""

from __future__ import annotations

import torch


def select_with_partners_loop(cost: torch.Tensor, nearest: torch.Tensor, count: int, num_prefix: int) -> torch.Tensor:
    """``count`` merge sources per image ``[B, count]`` (indices into the sequence, increasing) from
    ``cost [B, n]`` and the ``nearest`` partners ``[B, n]`` (indices into the sequence)."""
    b, n = cost.shape
    order = torch.argsort(cost, dim=1, stable=True)
    partner = torch.gather(nearest - num_prefix, 1, order)  # partner of the j-th cheapest token
    chosen = torch.zeros(b, n, dtype=torch.bool, device=cost.device)
    protected = torch.zeros_like(chosen)
    taken = torch.zeros(b, dtype=torch.long, device=cost.device)
    rows = torch.arange(b, device=cost.device)
    for j in range(min(n, 2 * count)):
        candidate = order[:, j]
        ok = ~protected[rows, candidate] & (taken < count)
        chosen[rows, candidate] |= ok
        protected[rows, partner[:, j]] |= ok
        taken += ok.long()
    missing = count - taken  # [B], 0 unless the candidates ran out (2·count > n)
    spare = (~torch.gather(chosen, 1, order)).long()
    fill = spare.bool() & (spare.cumsum(1) <= missing[:, None])
    chosen |= torch.zeros_like(chosen).scatter(1, order, fill)
    return torch.argsort((~chosen).to(torch.int8), dim=1, stable=True)[:, :count] + num_prefix


def greedy_per_image(cost: list, partner: list, count: int) -> list[int]:
    """One image: ``cost[t]`` and ``partner[t]`` (patch-relative) of every patch token ``t`` -> the
    ``count`` selected tokens, increasing. Candidates by increasing cost (ties: lower index first;
    NaN last, as ``torch.sort`` puts it), each taken unless a source taken before it named it as
    its partner; the cheapest tokens not taken fill what is left of the budget."""
    order = sorted(range(len(cost)), key=lambda t: (cost[t] != cost[t], cost[t] if cost[t] == cost[t] else 0.0, t))
    chosen, spared = [], set()
    for t in order:
        if len(chosen) < count and t not in spared:
            chosen.append(t)
            spared.add(partner[t])
    chosen += [t for t in order if t not in chosen][: count - len(chosen)]
    return sorted(chosen)
