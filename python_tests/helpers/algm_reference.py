"""A hand-written, loop-based reference of ALGM (Norouzi et al., "Adaptive Local-then-Global Token
Merging", CVPR 2024) from the paper and the authors' code (``tue-mps/algm-segmenter``:
``algm/algm/local_merge.py``, ``global_merge.py``, ``patch/algm_segmenter_patch.py``), not from the
module under test. The batch is walked image by image with Python lists and floats, window by
window and pair by pair; only the two counts (the smallest over the batch) and the batch means
of the global threshold join the images.

In the blocks of ``layers``, between attention and MLP, on the tokens themselves (input plus
attention output):

- the first pools windows: the ``h × w`` windows of the square patch grid (row-major, their tokens
  row-major), a window's similarity the mean cosine over its ordered pairs of distinct tokens;
  ``c`` = the smallest count over the batch of windows at or above ``threshold``; each image pools
  its ``c`` most similar windows (ties: the first window) into one token each, the size-weighted
  mean of its tokens, in the place of the window's last token; the tokens continue as
  ``[prefix, pooled windows by descending similarity, the other patch tokens in order]``;
- each later one (``l`` its 1-based number) merges globally: A = the even positions after the
  prefix, B = the odd ones (positions in the whole sequence), each A token's most similar B token
  (the first of equal maxima) and its cosine ``s``; the threshold is the batch mean of the
  images' means of ``s`` plus the batch mean of their sample standard deviations, over ``l``;
  ``c`` = the smallest count over the batch of A tokens at or above it; each image merges its
  ``c`` A tokens of highest ``s`` (ties by position) into their B tokens (size-weighted means,
  sizes adding up); the tokens continue as ``[prefix, unmerged A, B]``.
"""

from __future__ import annotations

import math

import torch

from helpers.blocks import PLAIN, embed, places_of, unmerge


def cosine(u: torch.Tensor, v: torch.Tensor) -> float:
    return float(u @ v) / (float(u.norm()) * float(v.norm()))


def grid_windows(side: int, window: tuple) -> list:
    """The patch indices of each window of the ``side × side`` grid, windows and tokens row-major."""
    wh, ww = window
    return [[(gy * wh + dy) * side + gx * ww + dx for dy in range(wh) for dx in range(ww)]
            for gy in range(side // wh) for gx in range(side // ww)]


def window_similarities(x: torch.Tensor, p: int, window: tuple) -> list:
    """One image ``x [K, D]``: the mean cosine over the ordered pairs of distinct tokens of each window."""
    side = math.isqrt(x.shape[0] - p)
    sims = []
    for members in grid_windows(side, window):
        pairs = [cosine(x[p + a], x[p + b]) for a in members for b in members if a != b]
        sims.append(sum(pairs) / len(pairs))
    return sims


def _regroup(image: dict, groups: list) -> None:
    """Replace the tokens of ``image`` by one per group (lists of current indices, the destination
    first): the size-weighted mean of the group, sizes added, sources joined (the destination's first)."""
    x, sizes, sources = image["x"], image["sizes"], image["sources"]
    image["x"] = torch.stack([sum(sizes[m] * x[m] for m in g) / sum(sizes[m] for m in g) for g in groups])
    image["sizes"] = [sum(sizes[m] for m in g) for g in groups]
    image["sources"] = [[t for m in g for t in sources[m]] for g in groups]


def local_step(images_: list, p: int, window: tuple, threshold: float) -> None:
    sims = [window_similarities(image["x"], p, window) for image in images_]
    count = min(sum(1 for s in per_image if s >= threshold) for per_image in sims)
    if count == 0:
        return
    for image, per_image in zip(images_, sims):
        k = image["x"].shape[0]
        windows = grid_windows(math.isqrt(k - p), window)
        ranked = sorted(range(len(windows)), key=lambda w: -per_image[w])[:count]  # stable: ties to the first window
        groups, pooled = [[j] for j in range(p)], set()
        for w in ranked:
            members = [p + t for t in windows[w]]
            groups.append([members[-1]] + members[:-1])
            pooled.update(members)
        groups += [[j] for j in range(p, k) if j not in pooled]
        _regroup(image, groups)


def _sample_std(values: list) -> float:
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def global_step(images_: list, p: int, layer_number: int) -> None:
    k = images_[0]["x"].shape[0]
    set_a = [j for j in range(p, k) if j % 2 == 0]
    set_b = [j for j in range(p, k) if j % 2 == 1]
    if len(set_a) < 2 or not set_b:
        return
    best, match = [], []
    for image in images_:
        x = image["x"]
        scores = {a: [cosine(x[a], x[b]) for b in set_b] for a in set_a}
        best.append({a: max(scores[a]) for a in set_a})
        match.append({a: set_b[scores[a].index(max(scores[a]))] for a in set_a})  # the first of equal maxima
    means = [sum(s.values()) / len(s) for s in best]
    stds = [_sample_std(list(s.values())) for s in best]
    threshold = sum(means) / len(means) + (sum(stds) / len(stds)) / layer_number
    count = min(sum(1 for v in s.values() if v >= threshold) for s in best)
    if count == 0:
        return
    for image, s, m in zip(images_, best, match):
        gone = sorted(set_a, key=lambda a: -s[a])[:count]  # ties by position
        groups = [[j] for j in range(p)] + [[a] for a in set_a if a not in gone]
        groups += [[b] + [a for a in set_a if a in gone and m[a] == b] for b in set_b]
        _regroup(image, groups)


def algm_reference(model, images_, layers, threshold=0.88, window=(2, 2), prop_attn=False, halves=PLAIN):
    """ALGM on the batch: ``(final [B, N, D] normed, [after block i [B, N, D] for every block])``,
    pooling locally at block ``layers[0]`` and merging globally at the later ``layers`` (0-based)."""
    h = embed(model, images_)
    p, n = model.num_prefix_tokens, h.shape[1]
    batch = [{"x": image, "sizes": [1.0] * n, "sources": [[t] for t in range(n)]} for image in h]
    per_block = [[] for _ in batch]
    for i, block in enumerate(model.blocks):
        for image in batch:
            log_sizes = torch.tensor(image["sizes"], dtype=image["x"].dtype).log() if prop_attn else None
            places = places_of(image["sources"], p, image["x"].shape[0] - p)
            image["x"] = halves.attend(block, image["x"], log_sizes, places)[0]
        if i == layers[0]:
            local_step(batch, p, window, threshold)
        elif i in layers[1:]:
            global_step(batch, p, i + 1)
        for image, seen in zip(batch, per_block):
            image["x"] = halves.feed(block, image["x"])
            seen.append(unmerge(image["x"], image["sources"], n))
    finals = torch.stack([model.norm(seen[-1]) for seen in per_block])
    return finals, list(torch.stack([torch.stack(seen) for seen in per_block]).transpose(0, 1))


def local_similarities(model, images_, layer, window=(2, 2), halves=PLAIN) -> list:
    """Per image, the window similarities :func:`local_step` sees at block ``layer`` when nothing
    was merged before it (to choose thresholds that pool some windows and not others)."""
    h = embed(model, images_)
    p, n = model.num_prefix_tokens, h.shape[1]
    out = []
    for x in h:
        places = list(range(p, n))
        for block in list(model.blocks)[:layer]:
            x = halves.feed(block, halves.attend(block, x, None, places)[0])
        out.append(window_similarities(halves.attend(model.blocks[layer], x, None, places)[0], p, window))
    return out
