"""A hand-written, loop-based reference of importance_cluster, image by image with Python lists and
floats, from the rule's statement (pullback_ext/prune/methods/importance_cluster.py's docstring),
not from the module under test.

In each clustering block, between attention and MLP, the current patch tokens are clustered
bottom-up: a cluster has the size ``S`` and the energy ``E`` of its members added up and a key
centre, the size-weighted mean of its members' unit head-mean keys; the pair of clusters whose
merge costs least, ``(E_a S_b² + E_b S_a²) / (S_a + S_b)² · ‖c_a − c_b‖²`` computed afresh from the
members at every step, merges first (ties: the first pair by smallest members), until ATC's count
``int(N0 · keep_rate^s)`` remains (``int(N0 · keep_rate^(s^taper))`` with a taper). Energies:
``size · imp²`` of the head on block ``score_layer``'s output, each moved ``shrink`` toward the
image's mean per original patch token; without a head the sizes. Each cluster becomes one token
at its smallest member's place, the size-weighted mean.
"""

from __future__ import annotations

import torch

from helpers.atc_reference import cluster_count, greedy_clusters
from helpers.blocks import PLAIN, embed, places_of, unmerge


def merge_cost(unit: list, sizes: list, energy: list, first: list, second: list, weighted: bool = True) -> float:
    """The cost of merging the clusters ``first`` and ``second`` (lists of token indices); ``weighted``
    False: centres as plain means of the members' keys (a wrong rule, for the tests to tell apart)."""
    def stats(members):
        s = sum(sizes[m] for m in members)
        weights = [sizes[m] if weighted else 1.0 for m in members]
        return s, sum(energy[m] for m in members), sum(w * unit[m] for w, m in zip(weights, members)) / sum(weights)

    (sa, ea, ca), (sb, eb, cb) = stats(first), stats(second)
    return (ea * sb ** 2 + eb * sa ** 2) / (sa + sb) ** 2 * float((ca - cb).square().sum())


def agglomerate(unit: list, sizes: list, energy: list, count: int, weighted: bool = True) -> list:
    """The clusters (sorted lists of token indices, ordered by their smallest member) left when the
    tokens are merged greedily, cheapest pair first, until ``count`` remain."""
    return greedy_clusters(len(unit), count, lambda first, second: merge_cost(unit, sizes, energy, first, second, weighted))


def _cluster(x, keys, sizes, energy, sources, p, count):
    tokens = list(range(p, x.shape[0]))
    if count >= len(tokens):
        return x, sizes, energy, sources
    metric = keys.mean(dim=0)
    unit = [metric[t] / metric[t].norm() for t in tokens]
    local = agglomerate(unit, [sizes[t] for t in tokens], [energy[t] for t in tokens], count)
    groups = [[j] for j in range(p)] + [[tokens[i] for i in c] for c in local]
    rows = [sum(sizes[m] * x[m] for m in g) / sum(sizes[m] for m in g) for g in groups]
    return (torch.stack(rows), [sum(sizes[m] for m in g) for g in groups], [sum(energy[m] for m in g) for g in groups],
            [[t for m in g for t in sources[m]] for g in groups])


def importance_cluster_reference(model, images_, keep_rate, layers, head=None, score_layer=1, shrink=0.0, halves=PLAIN,
                                 taper=1.0):
    """importance_cluster on each image: ``(final [B, N, D] normed, [after block i [B, N, D] for every
    block])``, clustering at the 0-based blocks ``layers``, proportional attention on; ``taper``: the
    ``s``-th clustering block keeps ``int(N0 · keep_rate^(s^taper))`` (1: ATC's count)."""
    stages = sorted(layers)
    h = embed(model, images_)
    p, n = model.num_prefix_tokens, h.shape[1]
    finals, per_block = [], []
    for image in h:
        x, sizes, sources, energy, seen = image, [1.0] * n, [[t] for t in range(n)], None, []
        for i, block in enumerate(model.blocks):
            x, _, keys = halves.attend(block, x, torch.tensor(sizes, dtype=x.dtype).log(), places_of(sources, p, x.shape[0] - p))
            if i in stages:
                stage = stages.index(i) + 1
                count = (cluster_count(keep_rate, n - p, stage, x.shape[0] - p) if taper == 1.0 else
                         max(1, min(x.shape[0] - p, int((n - p) * keep_rate ** (stage ** taper)))))
                x, sizes, energy, sources = _cluster(x, keys, sizes, energy if energy is not None else list(sizes), sources, p, count)
                energy = energy if head is not None else None
            x = halves.feed(block, x)
            if head is not None and i == score_layer:
                with torch.no_grad():
                    imp = head(x[None])[0]
                raw = [sizes[t] * float(imp[t]) ** 2 for t in range(len(sizes))]
                mean = sum(raw[p:]) / sum(sizes[p:])
                energy = [(1.0 - shrink) * e + shrink * mean * s for e, s in zip(raw, sizes)]
            seen.append(unmerge(x, sources, n))
        finals.append(model.norm(seen[-1]))
        per_block.append(torch.stack(seen))
    return torch.stack(finals), list(torch.stack(per_block).transpose(0, 1))
