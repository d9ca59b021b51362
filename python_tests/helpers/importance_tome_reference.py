"""A float64 loop reference of ``importance_tome`` for one image at a time: explicit tokens, groups
of original tokens and per-block merges, written from the method's definition (docs/prune.md), not
from its code. ``model``: anything with timm ``blocks`` (``attn.qkv``, ``attn.proj``, ``norm1``,
``norm2``, ``mlp``; no LayerScale) and ``num_prefix_tokens``."""

from __future__ import annotations

import math

import torch

from helpers.blocks import unmerge


def attention_half(block, x: torch.Tensor, sizes: list | None):
    """``x [K, D]`` -> ``(x + attention output, keys [H, K, hd])``, ``log(size)`` added to the logits."""
    attn = block.attn
    k = x.shape[0]
    qkv = attn.qkv(block.norm1(x)).reshape(k, 3, attn.num_heads, attn.head_dim).transpose(0, 2)  # [H, 3, K, hd]
    q, keys, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
    logits = q @ keys.transpose(1, 2) / math.sqrt(attn.head_dim)
    if sizes is not None:
        logits = logits + torch.tensor(sizes, dtype=x.dtype).log()
    mixed = (logits.softmax(-1) @ v).transpose(0, 1).reshape(k, -1)
    return x + attn.proj(getattr(attn, "norm", torch.nn.Identity())(mixed)), keys


def cost_of(a: int, b: int, cos: float, energy: list, sizes: list, guard: float, partner: str) -> float:
    """The merge cost of A token ``a`` into B token ``b`` (indices into the current sequence)."""
    if partner == "cosine":
        return energy[a] ** (guard / 2) * (1 - cos)
    moved = (energy[a] * sizes[b] ** 2 + energy[b] * sizes[a] ** 2) / (sizes[a] + sizes[b]) ** 2
    return moved ** (guard / 2) * math.sqrt(max(2 - 2 * cos, 0.0))


def choose(keys: torch.Tensor, seq_a: list, seq_b: list, count: int, energy, sizes, guard, partner) -> list:
    """``[(a, b)]``: the ``count`` merges of one block (ToMe's rule while ``energy`` is None)."""
    unit = torch.nn.functional.normalize(keys.mean(0), dim=-1)
    ranked = []
    for j, a in enumerate(seq_a):
        cos = [float(unit[a] @ unit[b]) for b in seq_b]
        if energy is None:  # before the score: ToMe's rule
            best = max(range(len(seq_b)), key=lambda m: (cos[m], -m))
            ranked.append((-cos[best], j, a, seq_b[best]))
            continue
        costs = [cost_of(a, b, c, energy, sizes, guard, partner) for b, c in zip(seq_b, cos)]
        if partner == "cosine":
            best = max(range(len(seq_b)), key=lambda m: (cos[m], -m))
        else:
            best = min(range(len(seq_b)), key=lambda m: (costs[m], m))
        ranked.append((costs[best], j, a, seq_b[best]))
    return [(a, b) for _, _, a, b in sorted(ranked)[:count]]


def merge_one(x, sizes, energy, groups, p, pairs):
    """Apply ``pairs`` and reorder as ``[prefix, unmerged A, B]`` (A: even positions)."""
    k = x.shape[0]
    seq_a = [i for i in range(p, k) if i % 2 == 0]
    seq_b = [i for i in range(p, k) if i % 2 == 1]
    rows, new_sizes, new_energy, new_groups = {}, {}, {}, {}
    for i in range(k):
        rows[i], new_sizes[i], new_groups[i] = x[i] * sizes[i], sizes[i], set(groups[i])
        new_energy[i] = None if energy is None else energy[i]
    for a, b in pairs:
        rows[b] = rows[b] + x[a] * sizes[a]
        new_sizes[b] += sizes[a]
        new_groups[b] |= groups[a]
        if energy is not None:
            new_energy[b] += energy[a]
    gone = {a for a, _ in pairs}
    order = list(range(p)) + [a for a in seq_a if a not in gone] + seq_b
    x = torch.stack([rows[i] / new_sizes[i] for i in order])
    energy = None if energy is None else [new_energy[i] for i in order]
    return x, [new_sizes[i] for i in order], energy, [new_groups[i] for i in order]


def schedule_of(r: int, schedule: str, start: int, stop: int, depth: int) -> list:
    """Merges requested in each block: ``r`` (constant) or ``2r`` falling linearly to 0
    (decreasing, floored) over the blocks ``start .. stop-1``, none elsewhere."""
    n = stop - start
    inside = [r] * n if schedule == "constant" or n == 1 else [math.floor(2 * r * (n - 1 - j) / (n - 1)) for j in range(n)]
    return [inside[i - start] if start <= i < stop else 0 for i in range(depth)]


def reference(model, head, x: torch.Tensor, r: int, schedule: str, score_layer: int, guard: float, partner: str,
              block_range=None, take=(), shrink: float = 0.0):
    """Float64 loop reference of one image ``x [N, D]`` (the embedded tokens): final and taken
    full-length features, and the groups of original tokens at the end. ``shrink``: every original
    patch token's imp² moved that far toward their average over the image's original patch tokens."""
    p, depth = int(model.num_prefix_tokens), len(model.blocks)
    start, stop = block_range or (score_layer + 1, depth)
    merges = schedule_of(r, schedule, start, stop, depth)
    n = x.shape[0]
    sizes, energy, groups, merged, taken = [1.0] * n, None, [{i} for i in range(n)], False, {}
    for i, block in enumerate(model.blocks):
        x, keys = attention_half(block, x, sizes if merged else None)
        k = x.shape[0]
        seq_a = [t for t in range(p, k) if t % 2 == 0]
        seq_b = [t for t in range(p, k) if t % 2 == 1]
        count = min(merges[i], len(seq_a)) if seq_b else 0
        if count:
            pairs = choose(keys, seq_a, seq_b, count, energy, sizes, guard, partner)
            x, sizes, energy, groups = merge_one(x, sizes, energy, groups, p, pairs)
            merged = True
        x = x + block.mlp(block.norm2(x))
        if i == score_layer and any(merges):
            per_original = [float(v) ** 2 for v in head(x[None])[0]]  # imp² of each original token it holds
            originals = [t for t in range(p, len(groups)) for _ in groups[t]]
            average = sum(per_original[t] for t in originals) / len(originals)
            energy = [((1 - shrink) * e + shrink * average) * s for e, s in zip(per_original, sizes)]
        if i in take:
            taken[i] = unmerge(x, groups, n)
    return unmerge(x, groups, n), taken, groups
