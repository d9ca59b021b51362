"""A hand-written, loop-based reference of MCTF (Lee et al., CVPR 2024), one image at a time with
Python lists, written from the authors' code (mlvlab/MCTF ``utils/mctf.py``,
``models/modules/blocks.py``), not from the library's module: in a merging block the tokens are
fused *before* the block's attention output, on the block's input, by bidirectional bipartite
matching on similarity × informativeness × size, averaged with attention × size weights, and the
attention half of the fused tokens uses the block's own attention fused alongside
("one-step-ahead")."""

from __future__ import annotations

import math

import torch

from helpers.blocks import embed, mlp_half, unmerge

FLOOR = 10  # the authors keep at least 10 tokens (utils/mctf.py:25)


def merges_here(r: int, k: int, p: int) -> int:
    """Tokens a block merges when asked for ``r`` with ``k`` current tokens, ``p`` of them prefix."""
    if k - r < FLOOR:
        r = k - FLOOR
    return max(0, min(r, (k - p) // 2))


def _layer_scale(ls):
    gamma = getattr(ls, "gamma", None)
    return 1.0 if gamma is None else gamma


def probabilities(block, x: torch.Tensor, log_sizes) -> torch.Tensor:
    """``softmax(q kᵀ / √hd + log s) [H, K, K]`` of a timm block on one image ``x [K, D]``."""
    attn, k = block.attn, x.shape[0]
    qkv = attn.qkv(block.norm1(x)).reshape(k, 3, attn.num_heads, attn.head_dim)
    q = attn.q_norm(qkv[:, 0].transpose(0, 1))
    keys = attn.k_norm(qkv[:, 1].transpose(0, 1))
    logits = q @ keys.transpose(1, 2) / math.sqrt(attn.head_dim)
    if log_sizes is not None:
        logits = logits + log_sizes[None, None, :]
    return torch.softmax(logits, dim=-1)


def attention_with(block, x: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """``x + γ1 · proj(probs @ V(norm1(x)))`` of a timm block on one image: its attention half with
    the given probabilities ``probs [H, K, K]`` instead of its own."""
    attn, k = block.attn, x.shape[0]
    values = attn.qkv(block.norm1(x)).reshape(k, 3, attn.num_heads, attn.head_dim)[:, 2].transpose(0, 1)
    mixed = (probs @ values).transpose(0, 1).reshape(k, -1)
    return x + _layer_scale(block.ls1) * attn.proj(attn.norm(mixed))


def _normalised_inverse(values: list) -> list:
    inverse = [1.0 / v for v in values]
    top = max(inverse)
    return [v / top for v in inverse]


def _score_fn(x, probs, sizes, taus):
    """``W(i, j)``: similarity × informativeness × size of tokens ``i``, ``j`` (current indices)."""
    tau_sim, tau_info, tau_size = taus
    unit = x / x.norm(dim=-1, keepdim=True)
    received = [float(probs[:, :, j].mean()) for j in range(x.shape[0])]
    info, small = _normalised_inverse(received), _normalised_inverse(sizes)

    def score(i, j):
        w = ((float(unit[i] @ unit[j]) + 1.0) / 2.0) ** (1.0 / tau_sim) if tau_sim else 1.0
        if tau_info > 0:
            w *= (info[i] * info[j]) ** (1.0 / tau_info)
        if tau_size:
            w *= (small[i] * small[j]) ** (1.0 / tau_size)
        return w

    return score, received


def _best(candidates: list, score) -> tuple:
    """``(max score, argmax)`` over ``candidates``, the first of equal maxima."""
    best, arg = -math.inf, None
    for c in candidates:
        s = score(c)
        if s > best:
            best, arg = s, c
    return best, arg


def _groups(x, probs, sizes, p, r, taus):
    """The bidirectional matching of one block: ``(new order, members of each current token)``,
    members listed destination first."""
    k = x.shape[0]
    set_a = [j for j in range(p, k) if j % 2 == 0]
    set_b = [j for j in range(p, k) if j % 2 == 1]
    score, received = _score_fn(x, probs, sizes, taus)
    r1, r2 = r // 2, r - r // 2
    step1 = {a: _best(set_b, lambda b: score(a, b)) for a in set_a}
    ranked_a = sorted(set_a, key=lambda a: -step1[a][0])  # stable: ties by position
    src1, unmerged = ranked_a[:r1], ranked_a[r1:]
    if p > 0:
        unmerged = sorted(unmerged)
    step2 = {b: _best(unmerged, lambda u: score(u, b)) for b in set_b}
    ranked_b = sorted(set_b, key=lambda b: -step2[b][0])
    src2, kept_b = ranked_b[:r2], ranked_b[r2:]
    members = {j: [j] for j in range(k)}
    for a in src1:
        members[step1[a][1]] += members[a]
    for b in src2:
        members[step2[b][1]] += members[b]
    return list(range(p)) + unmerged + kept_b, members, received


def fuse(x, probs, sizes, sources, p, r, taus):
    """One MCTF merge of ``r`` tokens on one image: the block input ``x [K, D]``, its attention
    ``probs [H, K, K]``, ``sizes`` and ``sources`` (lists). Returns ``(x [K − r, D], one-step-ahead
    attention [H, K − r, K − r], sizes, sources)``."""
    order, members, received = _groups(x, probs, sizes, p, r, taus)
    top = max(sizes)
    weight = [received[t] * sizes[t] / top for t in range(x.shape[0])]
    rows, new_sizes, new_sources = [], [], []
    for g in order:
        total = sum(weight[t] for t in members[g])
        rows.append(sum(weight[t] * x[t] for t in members[g]) / total)
        new_sizes.append(sum(sizes[t] for t in members[g]))
        new_sources.append([s for t in members[g] for s in sources[t]])
    heads, m = probs.shape[0], len(order)
    ahead = torch.zeros(heads, m, m, dtype=probs.dtype)
    for row, gq in enumerate(order):
        total = sum(weight[q] for q in members[gq])
        for col, gk in enumerate(order):
            mass = sum(weight[q] * probs[:, q, members[gk]].sum(dim=-1) for q in members[gq])
            ahead[:, row, col] = mass / total
    return torch.stack(rows), ahead, new_sizes, new_sources


def mctf_reference(model, images_, merges, tau_sim=1.0, tau_info=20.0, tau_size=40.0, prop_attn=True,
                   attention=probabilities, attend_with=attention_with, feed=mlp_half):
    """MCTF on each image of a timm-style model (``blocks``, ``num_prefix_tokens``, the embedding
    steps, ``norm``); block ``i`` is asked for ``merges[i]`` merges. Returns ``(final [B, N, D]
    normed, [after block i [B, N, D] for every block])``, merged tokens given back to their sources."""
    h = embed(model, images_)
    p, n = model.num_prefix_tokens, h.shape[1]
    taus = (tau_sim, tau_info, tau_size)
    finals, per_block = [], []
    for image in h:
        x, sizes, sources, seen = image, [1.0] * n, [[t] for t in range(n)], []
        for i, block in enumerate(model.blocks):
            log_sizes = torch.tensor(sizes, dtype=x.dtype).log() if prop_attn else None
            probs = attention(block, x, log_sizes)
            r = merges_here(merges[i], x.shape[0], p) if merges[i] else 0
            if r:
                x, probs, sizes, sources = fuse(x, probs, sizes, sources, p, r, taus)
            x = feed(block, attend_with(block, x, probs))
            seen.append(unmerge(x, sources, n))
        finals.append(model.norm(seen[-1]))
        per_block.append(torch.stack(seen))
    return torch.stack(finals), list(torch.stack(per_block).transpose(0, 1))
