"""Hand-written, loop-based references of DTEM (Lee & Hong, NeurIPS 2024), image by image with
Python lists, written from the authors' code (movinghoon/DTEM@13f2046, ``dtem/dtem.py``,
``dtem/utils.py``), not from the module under test.

- :func:`soft_group_reference`: the soft grouping ``_select`` (dtem.py:113-148);
- :func:`soft_merge_reference`: one relaxed merge ``_merge_train`` (dtem.py:150-191), with the
  soft source matrix that gives dense readers their full-length features;
- :func:`relaxed_reference`: the training forward of a model, every block relaxed;
- :func:`dtem_reference`: inference, ToMe's bipartite rule (utils.py:10-77) on the learned metric.

``metric(i, x_in)`` is the decoupled embedding of block ``i`` on that block's input ``x_in [K, D]``,
``W_i · norm1_i(x_in) + b_i`` (dtem.py:19, 44-47, 208), written by the caller from the block's own
norm and the embedding's weights.
"""

from __future__ import annotations

import math

import torch

from helpers.blocks import PLAIN, places_of, unmerge

EPSILON = 1.1920928955078125e-07  # float32's eps, the authors' floor of the row mask (dtem.py:114)


def linear_metric(blocks, weights):
    """``metric(i, x_in)`` of the authors: ``W_i · norm1_i(x_in) + b_i`` with ``weights[i] = (W, b)``
    and each block's own pre-attention norm (``block.norm1``)."""
    def metric(i, x_in):
        weight, bias = (w.detach() for w in weights[i])
        return blocks[i].norm1(x_in) @ weight.T + bias

    return metric


def soft_group_reference(scores: list, r: int, k2: int, tau1: float, tau2: float) -> list:
    """``assign [|A|][|B|]`` from the cosine ``scores [|A|][|B|]``: each A row keeps its ``k2`` best
    scores over ``τ1``; ``r`` rounds of a softmax over all kept entries of the image at ``τ2``, each
    round added up and the picked rows damped by ``log(max(1 − row mass, ε))``; rows whose total
    exceeds 1 divided by it; scattered back to the B columns."""
    top = [sorted(range(len(row)), key=lambda b: (-row[b], b))[:k2] for row in scores]
    z = [[scores[a][b] / tau1 for b in top[a]] for a in range(len(scores))]
    khot = [[0.0] * len(row) for row in z]
    for _ in range(r):
        peak = max(v / tau2 for row in z for v in row)
        e = [[math.exp(v / tau2 - peak) for v in row] for row in z]
        total = sum(sum(row) for row in e)
        picked = [[v / total for v in row] for row in e]
        for a, row in enumerate(picked):
            khot[a] = [k + p for k, p in zip(khot[a], row)]
            damp = math.log(max(1.0 - sum(row), EPSILON))
            z[a] = [v + damp for v in z[a]]
    assign = [[0.0] * len(row) for row in scores]
    for a, row in enumerate(khot):
        scale = max(sum(row) - 1.0, 0.0) + 1.0
        for c, b in enumerate(top[a]):
            assign[a][b] += row[c] / scale
    return assign


def soft_merge_reference(x, sizes: list, source: list, metric, p: int, n: int, r: int, k2: int, tau1: float, tau2: float):
    """One relaxed merge on one image: ``x [K, D]`` (all tokens), ``sizes`` (K floats), ``source``
    (``N`` lists of K floats: how much of original token t each current token holds), ``metric
    [K, d]``; the first ``n`` tokens take part (``p`` prefix tokens first). Returns ``(x, sizes,
    source, n − r)`` with the tokens reordered ``[prefix, A ∪ B by size descending, the rest]``."""
    unit = metric / metric.norm(dim=-1, keepdim=True)
    set_a, set_b = list(range(p, n, 2)), list(range(p + 1, n, 2))
    r = min(r, (n - p) // 2)
    scores = [[float(unit[a] @ unit[b]) for b in set_b] for a in set_a]
    assign = soft_group_reference(scores, r, k2, tau1, tau2)
    rows, weight = {j: x[j] for j in range(x.shape[0])}, {j: sizes[j] for j in range(x.shape[0])}
    held = [list(row) for row in source]
    for j, b in enumerate(set_b):
        given = [(assign[i][j], a) for i, a in enumerate(set_a)]
        weight[b] = sizes[b] + sum(s * sizes[a] for s, a in given)
        rows[b] = (sizes[b] * x[b] + sum(s * sizes[a] * x[a] for s, a in given)) / weight[b]
        for t in range(len(held)):
            held[t][b] = source[t][b] + sum(s * source[t][a] for s, a in given)
    for i, a in enumerate(set_a):
        keep = min(max(1.0 - sum(assign[i]), 0.0), 1.0)
        weight[a] = sizes[a] * keep
        for t in range(len(held)):
            held[t][a] = source[t][a] * keep
    window = set_a + set_b
    ranked = [window[j] for j in sorted(range(len(window)), key=lambda j: (-weight[window[j]], j))]
    order = list(range(p)) + ranked + list(range(n, x.shape[0]))
    return (torch.stack([rows[j] for j in order]), [weight[j] for j in order],
            [[row[j] for j in order] for row in held], n - r)


def restore(x, source: list):
    """Full-length ``[N, D]``: original token t is ``Σ_j source[t][j] · x[j]``."""
    return torch.stack([sum(s * x[j] for j, s in enumerate(row)) for row in source])


def relaxed_reference(model, h, metric, r: int, k2: int = 3, tau1: float = 0.1, tau2: float = 0.1, halves=PLAIN):
    """The relaxed training forward on the block-0 input ``h [B, N, D]``: in every block, between
    attention (proportional: ``exp(a − max) · size``, i.e. ``+ log size``) and MLP, one
    :func:`soft_merge_reference` of ``r`` tokens on the metric of the block's *input*. Returns
    ``(final [B, N, D] normed, [after block i [B, N, D] for every block])``, full-length by
    :func:`restore`."""
    p = model.num_prefix_tokens
    finals, per_block = [], []
    for image in h:
        k = image.shape[0]
        x, sizes, n, seen = image, [1.0] * k, k, []
        source = [[1.0 if j == t else 0.0 for j in range(k)] for t in range(k)]
        for i, block in enumerate(model.blocks):
            x_in = x
            x, _, _ = halves.attend(block, x, torch.tensor(sizes, dtype=x.dtype).log(), list(range(p, k)))
            x, sizes, source, n = soft_merge_reference(x, sizes, source, metric(i, x_in), p, n, r, k2, tau1, tau2)
            x = halves.feed(block, x)
            seen.append(restore(x, source))
        finals.append(model.norm(seen[-1]))
        per_block.append(torch.stack(seen))
    return torch.stack(finals), list(torch.stack(per_block).transpose(0, 1))


def _bipartite_reference(x, metric, sizes: list, sources: list, p: int, r: int):
    """ToMe's bipartite soft matching (utils.py:10-77) on one image with the learned ``metric
    [K, d]``: A the even positions and B the odd ones after the ``p`` protected prefix tokens, each A
    to its most similar B, the ``r`` most similar A merge (size-weighted), tokens continue as
    ``[prefix, unmerged A in order, B]``."""
    k = x.shape[0]
    set_a = [j for j in range(p, k) if j % 2 == 0]
    set_b = [j for j in range(p, k) if j % 2 == 1]
    r = min(r, len(set_a)) if set_b else 0
    unit = metric / metric.norm(dim=-1, keepdim=True)
    best = {a: max(set_b, key=lambda b: float(unit[a] @ unit[b])) for a in set_a}
    gone = sorted(set_a, key=lambda a: -float(unit[a] @ unit[best[a]]))[:r]
    members = {j: [j] for j in range(k)}
    for a in gone:
        members[best[a]].append(a)
    order = list(range(p)) + [a for a in set_a if a not in gone] + set_b
    rows = [sum(sizes[m] * x[m] for m in members[j]) / sum(sizes[m] for m in members[j]) for j in order]
    return (torch.stack(rows), [sum(sizes[m] for m in members[j]) for j in order],
            [[t for m in members[j] for t in sources[m]] for j in order])


def dtem_reference(model, h, metric, merges: list, prop_attn: bool = True, halves=PLAIN):
    """DTEM at inference on the block-0 input ``h [B, N, D]``: in block ``i`` with ``merges[i]`` > 0,
    between attention and MLP, ToMe's rule on ``metric(i, x_in)`` of the block's input. Returns
    ``(final [B, N, D] normed, [after block i [B, N, D] for every block])``, unmerged."""
    p, n = model.num_prefix_tokens, h.shape[1]
    finals, per_block = [], []
    for image in h:
        x, sizes, sources, seen = image, [1.0] * n, [[t] for t in range(n)], []
        for i, block in enumerate(model.blocks):
            x_in = x
            log_sizes = torch.tensor(sizes, dtype=x.dtype).log() if prop_attn else None
            x, _, _ = halves.attend(block, x, log_sizes, places_of(sources, p, x.shape[0] - p))
            if merges[i]:
                x, sizes, sources = _bipartite_reference(x, metric(i, x_in), sizes, sources, p, merges[i])
            x = halves.feed(block, x)
            seen.append(unmerge(x, sources, n))
        finals.append(model.norm(seen[-1]))
        per_block.append(torch.stack(seen))
    return torch.stack(finals), list(torch.stack(per_block).transpose(0, 1))
