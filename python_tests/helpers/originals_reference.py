"""Hand-written, loop-based references of the original methods (ToMe, PiToMe, EViT, Expedite,
ASAP), image by image with Python lists, shared by their own tests and by the tests that run them
on other backbones (the Hugging Face families, the RoPE backbones)."""

from __future__ import annotations

import math

import torch

from helpers.blocks import PLAIN, attention_half, embed, mlp_half, per_block_merge_reference, places_of, unmerge


# tome

def _merge_reference(x, keys, sizes, sources, p, r):
    """One bipartite soft matching step on one image, with Python lists."""
    k = x.shape[0]
    set_a = [j for j in range(p, k) if j % 2 == 0]
    set_b = [j for j in range(p, k) if j % 2 == 1]
    r = min(r, len(set_a)) if set_b else 0
    metric = keys.mean(dim=0)
    unit = metric / metric.norm(dim=-1, keepdim=True)
    match = {a: max(set_b, key=lambda b: float(unit[a] @ unit[b])) for a in set_a}
    gone = sorted(set_a, key=lambda a: -float(unit[a] @ unit[match[a]]))[:r]
    groups = {j: [j] for j in range(k)}
    for a in gone:
        groups[match[a]].append(a)
    order = list(range(p)) + [a for a in set_a if a not in gone] + set_b
    rows, new_sizes, new_sources = [], [], []
    for j in order:
        weight = [sizes[m] for m in groups[j]]
        rows.append(sum(w * x[m] for w, m in zip(weight, groups[j])) / sum(weight))
        new_sizes.append(sum(weight))
        new_sources.append([t for m in groups[j] for t in sources[m]])
    return torch.stack(rows), new_sizes, new_sources


def tome_reference(model, images_, merges, prop_attn=True, halves=PLAIN):
    """ToMe on each image: ``(final [B, N, D] normed, [after block i [B, N, D] for every block])``."""
    step = lambda i, x, keys, sizes, sources, p, r: _merge_reference(x, keys, sizes, sources, p, r)  # noqa: E731
    return per_block_merge_reference(model, images_, merges, step, prop_attn, halves)


# pitome

def _energy_merge_reference(x, keys, sizes, sources, p, r, margin, alpha, protect):
    """One PiToMe step of its authors' code (hchautran/PiToMe, ``algo/pitome/merge.py``) on one
    image, with Python lists: the energy ``mean_j ELU(cos_ij − margin, alpha)`` over the patch
    tokens ranks them; with ``protect`` (``pitome``, the later blocks) the 2r highest alternate
    between A and B and every A token merges into its most similar B token, the rest untouched;
    without (``pitome_bsm``, the first half) all of them alternate and ToMe's r most similar A
    tokens merge."""
    k = x.shape[0]
    patch_tokens = list(range(p, k))
    r = min(r, len(patch_tokens) // 2)
    if r == 0:
        return x, sizes, sources
    metric = keys.mean(dim=0)
    unit = metric / metric.norm(dim=-1, keepdim=True)

    def cos(i, j):
        return float(unit[i] @ unit[j])

    def elu(v):
        return v if v > 0 else alpha * (math.exp(v) - 1.0)

    energy = {i: sum(elu(cos(i, j) - margin) for j in patch_tokens) / len(patch_tokens) for i in patch_tokens}
    ranked = sorted(patch_tokens, key=lambda i: -energy[i])
    candidates = ranked[:2 * r] if protect else ranked
    set_a, set_b, protected = candidates[0::2], candidates[1::2], ranked[len(candidates):]
    match = {a: max(set_b, key=lambda b: cos(a, b)) for a in set_a}
    gone = sorted(set_a, key=lambda a: -cos(a, match[a]))[:r]
    members = {j: [j] for j in range(k)}
    for a in gone:
        members[match[a]].append(a)
    rows, new_sizes, new_sources = [], [], []
    for j in list(range(p)) + protected + [a for a in set_a if a not in gone] + set_b:
        total = sum(sizes[m] for m in members[j])
        rows.append(sum(sizes[m] * x[m] for m in members[j]) / total)
        new_sizes.append(total)
        new_sources.append([t for m in members[j] for t in sources[m]])
    return torch.stack(rows), new_sizes, new_sources


def pitome_reference(model, images_, merges, margin=0.75, alpha=1.0, prop_attn=False, halves=PLAIN):
    """PiToMe as its authors' timm / DeiT patch runs it, on each image: ``(final [B, N, D] normed,
    [after block i [B, N, D] for every block])``; block ``i`` of ``L`` uses the margin
    ``margin · (1 − i/L)`` (``deit.py:98``) and protects low-energy tokens from block ``⌈L/2⌉`` on
    (``deit.py:33-34``)."""
    depth = len(model.blocks)

    def step(i, x, keys, sizes, sources, p, r):
        protect = i >= math.ceil(depth * 0.5)
        return _energy_merge_reference(x, keys, sizes, sources, p, r, margin * (1 - i / depth), alpha, protect)

    return per_block_merge_reference(model, images_, merges, step, prop_attn, halves)


# evit

def _reorganise_reference(x, probs, sources, p, num_patch, keep):
    """One EViT stage on one image: keep the most attended patch tokens, fuse the rest (and a
    fused token from before) into ``Σ a_i x_i``."""
    attentiveness = probs[:, 0, :].mean(dim=0)
    ranked = sorted(range(p, p + num_patch), key=lambda j: -float(attentiveness[j]))
    kept = sorted(ranked[:keep])
    fused_away = [j for j in range(p, x.shape[0]) if j not in kept]
    fused = sum(attentiveness[j] * x[j] for j in fused_away)
    order = list(range(p)) + kept
    rows = torch.stack([x[j] for j in order] + [fused])
    return rows, [sources[j] for j in order] + [[t for j in fused_away for t in sources[j]]]


def evit_reference(model, images_, keep_rate, stages, halves=PLAIN):
    """EViT on each image: ``(final [B, N, D] normed, [after block i [B, N, D] for every block])``."""
    h = embed(model, images_)
    p, n = model.num_prefix_tokens, h.shape[1]
    finals, per_block = [], []
    for image in h:
        x, sources, extra, seen = image, [[t] for t in range(n)], 0, []
        for i, block in enumerate(model.blocks):
            num_patch = x.shape[0] - p - extra
            keep = math.ceil(keep_rate * num_patch)
            places = places_of(sources, p, num_patch)
            if i in stages and keep < num_patch:
                x, probs, _ = halves.attend(block, x, None, places)
                x, sources = _reorganise_reference(x, probs, sources, p, num_patch, keep)
                x, extra = halves.feed(block, x), 1
            else:
                x = halves.feed(block, halves.attend(block, x, None, places)[0])
            seen.append(unmerge(x, sources, n))
        finals.append(model.norm(seen[-1]))
        per_block.append(torch.stack(seen))
    return torch.stack(finals), list(torch.stack(per_block).transpose(0, 1))


# expedite

def _softmax(values: list, tau: float) -> list:
    """``softmax(−v / τ)`` of a list of squared distances."""
    low = min(values)
    e = [math.exp(-(v - low) / tau) for v in values]
    return [v / sum(e) for v in e]


def _pooled(patches, side, h, w):
    """Adaptive average pooling, bin by bin: rows ``floor(i S / h) .. ceil((i+1) S / h)``."""
    centres = []
    for i in range(h):
        for j in range(w):
            rows = range(i * side // h, -(-(i + 1) * side // h))
            cols = range(j * side // w, -(-(j + 1) * side // w))
            centres.append(sum(patches[r * side + c] for r in rows for c in cols) / (len(rows) * len(cols)))
    return centres


def _neighbours(t, side, h, w, window):
    """The centres within ``window // 2`` cells of the cell holding token ``t`` (nearest upsampling)."""
    row, col = (t // side) * h // side, (t % side) * w // side
    return [i * w + j for i in range(h) for j in range(w) if abs(i - row) <= window // 2 and abs(j - col) <= window // 2]


def cluster_reference(patches, grid, window, iters, tau):
    """Expedite's clustering of one image's patches ``[n, D]``: the centres, one token at a time."""
    n, side, (h, w) = patches.shape[0], math.isqrt(patches.shape[0]), grid
    centres = _pooled(patches, side, h, w)
    for _ in range(iters):
        sums, weights = [torch.zeros_like(patches[0]) for _ in centres], [0.0] * len(centres)
        for t in range(n):
            near = _neighbours(t, side, h, w, window)
            q = _softmax([float(((patches[t] - centres[j]) ** 2).sum()) for j in near], tau)
            for j, qj in zip(near, q):
                sums[j] = sums[j] + qj * patches[t]
                weights[j] += qj
        centres = [s / wt if wt > 0 else c for s, wt, c in zip(sums, weights, centres)]
    return centres


def reconstruction_reference(patches, centres, k, tau):
    """For each token: its ``k`` nearest centres and their weights."""
    recorded = []
    for x in patches:
        d = [float(((x - c) ** 2).sum()) for c in centres]
        nearest = sorted(range(len(centres)), key=lambda j: d[j])[:k]
        recorded.append((nearest, _softmax([d[j] for j in nearest], tau)))
    return recorded


def rebuild(x, p, recorded):
    """Full-length ``[p + n, D]`` from ``x [p + m, D]`` (the current tokens), or ``x`` unclustered."""
    if recorded is None:
        return x
    rows = [x[j] for j in range(p)]
    rows += [sum(w * x[p + j] for j, w in zip(nearest, weights)) for nearest, weights in recorded]
    return torch.stack(rows)


def expedite_reference(model, images_, grid, layer, window=5, iters=5, tau=10.0, k=20):
    """Expedite on each image: ``(final [B, N, D] normed, [after block i [B, N, D] for every block])``."""
    h = embed(model, images_)
    p = model.num_prefix_tokens
    finals, per_block = [], []
    for image in h:
        x, recorded, seen = image, None, []
        for i, block in enumerate(model.blocks):
            if i == layer:
                centres = cluster_reference(x[p:], grid, window, iters, tau)
                recorded = reconstruction_reference(x[p:], centres, k, tau)
                x = torch.cat([x[:p], torch.stack(centres)])
            x = mlp_half(block, attention_half(block, x)[0])
            seen.append(rebuild(x, p, recorded))
        finals.append(model.norm(seen[-1]))
        per_block.append(torch.stack(seen))
    return torch.stack(finals), list(torch.stack(per_block).transpose(0, 1))


# asap

def walk_reference(attentions, alpha=0.5):
    """``(T, sink, d)`` of one image from its head-averaged attentions ``[K, K]``, oldest first."""
    k = attentions[0].shape[0]
    t = torch.eye(k, dtype=torch.float64)
    for a in attentions:
        t = (alpha * torch.eye(k, dtype=torch.float64) + (1 - alpha) * a.double()) @ t
    mass = [sum(float(t[i, j]) for i in range(k)) for j in range(k)]
    sink = max(range(k), key=lambda j: (mass[j], -j))  # the first of equal maxima
    d = [math.sqrt(sum((float(t[i, j] - t[sink, j])) ** 2 / max(mass[j] / k, 1e-12) for j in range(k))) for i in range(k)]
    return t, sink, d


def background_reference(d, sink, p, count):
    """The ``count`` patch tokens nearest the sink, nearest first (ties by position)."""
    return sorted((i for i in range(p, len(d)) if i != sink), key=lambda i: (d[i], i))[:count]


def _pool_reference(x, t, sink, members, rings, p):
    """Merge mode on one image: ``members`` (nearest first) in ``rings`` equal-count rings, each
    pooled with weights T_is into the place of its first member. Returns ``(x, sizes, sources)``."""
    base, extra = divmod(len(members), rings)
    groups, start = {}, 0
    for r in range(rings):
        ring = sorted(members[start:start + base + (1 if r < extra else 0)])
        start += len(ring)
        groups[ring[0]] = ring
    gone = {i for ring in groups.values() for i in ring[1:]}
    rows, sizes, sources = [], [], []
    for j in range(x.shape[0]):
        if j in gone:
            continue
        ring = groups.get(j, [j])
        w = [float(t[i, sink]) for i in ring]
        rows.append(sum(wi * x[i] for wi, i in zip(w, ring)) / sum(w))
        sizes.append(float(len(ring)))
        sources.append(ring)
    return torch.stack(rows), sizes, sources


def _prune_tail(model, x, removed, layer, seen, llf, halves=PLAIN):
    """Prune mode on one image from block ``layer`` on: ``removed`` frozen at the stage; with
    ``llf`` the last block runs on the full sequence ("full"), or only for the re-inserted tokens
    while the kept ones see the kept ones alone ("masked")."""
    n, p = x.shape[0], model.num_prefix_tokens
    kept = [j for j in range(n) if j not in removed]
    frozen = x.clone()
    cur = x[kept]
    depth = len(model.blocks)

    def run(block, y, places):
        return halves.feed(block, halves.attend(block, y, None, places)[0])

    for i in range(layer, depth):
        block = model.blocks[i]
        if llf and i == depth - 1:
            full = frozen.clone()
            full[kept] = cur
            out = run(block, full, list(range(p, n)))
            if llf == "masked":
                out[kept] = run(block, cur, kept[p:])
            seen.append(out)
            return
        cur = run(block, cur, kept[p:])
        full = frozen.clone()
        full[kept] = cur
        seen.append(full)


def asap_reference(model, images_, layer, ratio, rings=4, mode="merge", llf="masked", sinks=None, halves=PLAIN):
    """ASAP on each image: ``(final [B, N, D] normed, [after block i [B, N, D] for every block])``;
    ``sinks`` (a list) collects each image's sink."""
    h = embed(model, images_)
    p, n = model.num_prefix_tokens, h.shape[1]
    count = int(math.floor(ratio * (n - p) + 0.5))
    finals, per_block = [], []
    for image in h:
        x, attentions, seen = image, [], []
        for block in model.blocks[:layer]:
            x, probs, _ = halves.attend(block, x, None, list(range(p, n)))
            attentions.append(probs.mean(dim=0))
            x = halves.feed(block, x)
            seen.append(x)
        t, sink, d = walk_reference(attentions)
        if sinks is not None:
            sinks.append(sink)
        if mode == "prune":
            _prune_tail(model, x, background_reference(d, sink, p, count), layer, seen, llf, halves)
        else:
            m = min(rings, n - p - 1 - count)
            x, sizes, sources = _pool_reference(x, t, sink, background_reference(d, sink, p, count + m), m, p)
            for block in model.blocks[layer:]:
                log_sizes = torch.tensor(sizes, dtype=x.dtype).log()
                x = halves.feed(block, halves.attend(block, x, log_sizes, places_of(sources, p, x.shape[0] - p))[0])
                seen.append(unmerge(x, sources, n))
        finals.append(model.norm(seen[-1]))
        per_block.append(torch.stack(seen))
    return torch.stack(finals), list(torch.stack(per_block).transpose(0, 1))

