"""A hand-written, loop-based reference of ATC (Haurum et al., "Agglomerative Token Clustering",
ECCV 2024), image by image with Python lists and floats, from the paper and the authors' code
(``JoakimHaurum/ATC``, ``ATC_setup/models/atc.py``), not from the module under test.

In each reduction block, between attention and MLP, the current patch tokens are clustered
bottom-up on the cosine distance ``1 - cos`` of their keys averaged over heads, the two closest
clusters merged at each step until ``int(N0 · keep_rate^s)`` clusters remain at the ``s``-th
reduction block (``N0``: the patch tokens of the input; at least one, at most the current count).
Linkages, from their definitions over all member pairs: ``single`` (the least distance),
``complete`` (the largest), ``average`` (the mean). Ties: among the closest pairs, the one whose
clusters' smallest members ``(a, b)``, ``a < b``, come first lexicographically. Prefix tokens are
never clustered. Each cluster becomes one token at the place of its smallest member (the tokens
keep their order), its features the size-weighted mean of its members (with proportional
attention; without it, the plain mean, the authors' sizes being reset after every block).
"""

from __future__ import annotations

import torch

from helpers.blocks import PLAIN, embed, per_block_merge_reference


def linkage_distance(dist: list, first: list, second: list, linkage: str) -> float:
    """The distance of two clusters (lists of point indices) under ``linkage``, from ``dist`` (a
    symmetric list of lists of floats)."""
    pairs = [dist[a][b] for a in first for b in second]
    if linkage == "single":
        return min(pairs)
    if linkage == "complete":
        return max(pairs)
    if linkage == "average":
        return sum(pairs) / (len(first) * len(second))
    raise ValueError(linkage)


def greedy_clusters(n: int, count: int, distance) -> list:
    """The clusters (sorted lists of point indices, ordered by their smallest member) left when ``n``
    points are merged greedily, the pair of the least ``distance(first, second)`` (two clusters)
    first, until ``count`` remain."""
    clusters = [[i] for i in range(n)]
    while len(clusters) > count:
        best = None
        for a in range(len(clusters)):
            for b in range(a + 1, len(clusters)):
                d = distance(clusters[a], clusters[b])
                if best is None or d < best[0]:  # strict: the first of equal distances wins
                    best = (d, a, b)
        _, a, b = best
        clusters[a] = sorted(clusters[a] + clusters[b])
        del clusters[b]
    return clusters


def agglomerate(dist: list, count: int, linkage: str) -> list:
    """:func:`greedy_clusters` of the ``len(dist)`` points under ``linkage``."""
    return greedy_clusters(len(dist), count, lambda first, second: linkage_distance(dist, first, second, linkage))


def cosine_distances(keys: torch.Tensor, tokens: list) -> list:
    """``1 - cos`` of the head-mean keys (``keys [H, K, hd]``) of ``tokens``, as a symmetric list of lists."""
    metric = keys.mean(dim=0)
    unit = [metric[t] / metric[t].norm() for t in tokens]
    n = len(tokens)
    dist = [[0.0] * n for _ in range(n)]
    for a in range(n):
        for b in range(a + 1, n):
            dist[a][b] = dist[b][a] = 1.0 - float(unit[a] @ unit[b])
    return dist


def cluster_count(keep_rate: float, num_patch: int, stage: int, current: int) -> int:
    """Clusters at the ``stage``-th (1-based) reduction block: ``int(N0 · keep_rate^stage)`` of the
    ``num_patch`` input patch tokens, between 1 and the ``current`` patch tokens."""
    return max(1, min(current, int(num_patch * keep_rate ** stage)))


def _cluster_merge(x, keys, sizes, sources, p, count, linkage, weighted):
    """One ATC reduction on one image: ``(x, sizes, sources)`` after clustering the patch tokens
    of ``x [K, D]`` into ``count`` tokens."""
    tokens = list(range(p, x.shape[0]))
    if count >= len(tokens):
        return x, sizes, sources
    clusters = [[tokens[i] for i in c] for c in agglomerate(cosine_distances(keys, tokens), count, linkage)]
    groups = [[j] for j in range(p)] + clusters
    rows, new_sizes, new_sources = [], [], []
    for members in groups:
        weight = [sizes[m] if weighted else 1.0 for m in members]
        rows.append(sum(w * x[m] for w, m in zip(weight, members)) / sum(weight))
        new_sizes.append(sum(sizes[m] for m in members))
        new_sources.append([t for m in members for t in sources[m]])  # the smallest member's first
    return torch.stack(rows), new_sizes, new_sources


def atc_reference(model, images_, keep_rate, layers, linkage="average", prop_attn=True, halves=PLAIN):
    """ATC on each image: ``(final [B, N, D] normed, [after block i [B, N, D] for every block])``,
    reducing at the 0-based blocks ``layers``."""
    stages = sorted(layers)
    merges = [1 if i in stages else 0 for i in range(len(model.blocks))]
    n0 = embed(model, images_).shape[1] - model.num_prefix_tokens

    def step(i, x, keys, sizes, sources, p, _):
        count = cluster_count(keep_rate, n0, stages.index(i) + 1, x.shape[0] - p)
        return _cluster_merge(x, keys, sizes, sources, p, count, linkage, prop_attn)

    return per_block_merge_reference(model, images_, merges, step, prop_attn, halves)
