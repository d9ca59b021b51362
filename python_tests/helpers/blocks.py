"""Plain, one-image references of a timm ViT block and of small ViTs with LayerScale / registers,
for the ToMe and EViT tests: the block's halves are written out from its weights (explicit
softmax, explicit LayerScale factors) instead of calling the block or the library."""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import torch


def small_timm(name: str, img_size: int, depth: int = 3, seed: int = 0):
    """A random-weight timm model in float64 whose LayerScale factors and embeddings are large
    enough that skipping one, or any wrong merge, shows in the outputs."""
    import timm

    torch.manual_seed(seed)
    model = timm.create_model(name, pretrained=False, img_size=img_size, depth=depth, num_classes=0)
    with torch.no_grad():
        for name_, p in model.named_parameters():
            if name_.endswith(("ls1.gamma", "ls2.gamma")):
                p.normal_(0.0, 0.5)
            if name_ in ("pos_embed", "cls_token", "reg_token"):
                p.normal_(0.0, 0.5)
    return model.double().eval().requires_grad_(False)


def embed(model, images: torch.Tensor) -> torch.Tensor:
    """The input of the first block ``[B, N, D]``."""
    return model.norm_pre(model.patch_drop(model._pos_embed(model.patch_embed(images))))


def _layer_scale(ls) -> torch.Tensor | float:
    gamma = getattr(ls, "gamma", None)
    return 1.0 if gamma is None else gamma


def attention_half(block, x: torch.Tensor, log_sizes: torch.Tensor | None = None):
    """``x [K, D]`` (one image) -> ``(x + γ1 · attention output [K, D], probabilities [H, K, K],
    keys [H, K, hd])``; ``log_sizes [K]`` is added to every query's logits."""
    attn = block.attn
    k_tokens = x.shape[0]
    qkv = attn.qkv(block.norm1(x)).reshape(k_tokens, 3, attn.num_heads, attn.head_dim)
    q = attn.q_norm(qkv[:, 0].transpose(0, 1))
    keys = attn.k_norm(qkv[:, 1].transpose(0, 1))
    values = qkv[:, 2].transpose(0, 1)
    logits = q @ keys.transpose(1, 2) / math.sqrt(attn.head_dim)
    if log_sizes is not None:
        logits = logits + log_sizes[None, None, :]
    probs = torch.softmax(logits, dim=-1)
    mixed = (probs @ values).transpose(0, 1).reshape(k_tokens, -1)
    return x + _layer_scale(block.ls1) * attn.proj(attn.norm(mixed)), probs, keys


def mlp_half(block, x: torch.Tensor) -> torch.Tensor:
    """``x [K, D]`` -> ``x + γ2 · mlp(norm2(x))``."""
    return x + _layer_scale(block.ls2) * block.mlp(block.norm2(x))


def unmerge(x: torch.Tensor, sources: list, n: int) -> torch.Tensor:
    """Full-length ``[n, D]``: original token ``t`` gets the row of ``x [K, D]`` whose source list holds it."""
    out = torch.empty(n, x.shape[1], dtype=x.dtype)
    for row, members in enumerate(sources):
        for t in members:
            out[t] = x[row]
    return out


def tokens_after_each_block(model, x):
    """Tokens of every block's output, seen at the MLP (which runs after any merge)."""
    counts = []
    hooks = [block.mlp.register_forward_pre_hook(lambda m, args: counts.append(args[0].shape[1])) for block in model.blocks]
    try:
        model.forward_features(x)
    finally:
        for hook in hooks:
            hook.remove()
    return counts


class Halves(NamedTuple):
    """A block in two halves, one image at a time: ``attend(block, x [K, D], log_sizes [K] | None,
    places) -> (x + attention branch [K, D], probabilities [H, K, K], keys [H, K, hd])`` and
    ``feed(block, x [K, D]) -> [K, D]``. ``places``: the original position of each current patch
    token (a RoPE block's rotary rows; the tokens after them, EViT's fused token, have none)."""

    attend: Callable
    feed: Callable


PLAIN = Halves(lambda block, x, log_sizes, places: attention_half(block, x, log_sizes), mlp_half)  # timm Block


def places_of(sources: list, p: int, count: int) -> list:
    """The original positions of the ``count`` current patch tokens after the ``p`` prefix tokens:
    the references list a merged token's own sources first, so its first source is its
    destination's position (a kept token's, its own)."""
    return [sources[j][0] for j in range(p, p + count)]


def per_block_merge_reference(model, images: torch.Tensor, merges: list, merge, prop_attn: bool = True,
                              halves: Halves = PLAIN):
    """A per-block merging method run image by image: in block ``i`` with ``merges[i]`` > 0,
    ``merge(i, x, keys, sizes, sources, p, r) -> (x, sizes, sources)`` runs between attention and
    MLP (``x [K, D]``, ``keys [H, K, hd]``, ``sizes``: list, ``sources``: original tokens of each).
    Returns ``(final [B, N, D] normed, [after block i [B, N, D] for every block])``, unmerged."""
    h = embed(model, images)
    p, n = model.num_prefix_tokens, h.shape[1]
    finals, per_block = [], []
    for image in h:
        x, sizes, sources, seen = image, [1.0] * n, [[t] for t in range(n)], []
        for i, block in enumerate(model.blocks):
            log_sizes = torch.tensor(sizes, dtype=x.dtype).log() if prop_attn else None
            x, _, keys = halves.attend(block, x, log_sizes, places_of(sources, p, x.shape[0] - p))
            if merges[i]:
                x, sizes, sources = merge(i, x, keys, sizes, sources, p, merges[i])
            x = halves.feed(block, x)
            seen.append(unmerge(x, sources, n))
        finals.append(model.norm(seen[-1]))
        per_block.append(torch.stack(seen))
    return torch.stack(finals), list(torch.stack(per_block).transpose(0, 1))


def assert_zero_reduction_is_unpatched(model, x: torch.Tensor, patch_fn, **options) -> torch.Tensor:
    """``patch_fn(model, **options)`` (a reduction that removes nothing) leaves ``forward_features``
    and ``forward_intermediates`` (blocks 0 and 2) bit-identical; returns the unpatched features."""
    plain, plain_inter = model.forward_features(x), model.forward_intermediates(x, indices=[0, 2])
    patch_fn(model, **options)
    assert torch.equal(model.forward_features(x), plain)
    final, inter = model.forward_intermediates(x, indices=[0, 2])
    assert torch.equal(final, plain_inter[0]) and all(torch.equal(a, b) for a, b in zip(inter, plain_inter[1]))
    return plain


def matches_reference(model, x: torch.Tensor, expected: torch.Tensor, expected_blocks, num_prefix: int | None = None) -> bool:
    """Whether a patched timm ``model`` gives, at 1e-9, the reference's final features ``expected``
    and, after every block, its full-length features ``expected_blocks`` (patch tokens compared;
    ``num_prefix``: the model's prefix tokens unless given)."""
    p = model.num_prefix_tokens if num_prefix is None else num_prefix
    _, blocks = model.forward_intermediates(x, indices=list(range(len(model.blocks))), output_fmt="NLC")
    return torch.allclose(model.forward_features(x), expected, rtol=1e-9, atol=1e-9) and all(
        torch.allclose(got, want[:, p:], rtol=1e-9, atol=1e-9) for got, want in zip(blocks, expected_blocks))
