"""Small timm ViTs with random weights for the token merging / pruning tests."""

from __future__ import annotations

import torch


def tiny_vit(reg_tokens: int = 0, class_token: bool = True, depth: int = 4, seed: int = 0, dim: int = 32):
    """ViT on 32×32 images, patch 8: 16 patch tokens (+ CLS + registers), width ``dim``."""
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(seed)
    model = VisionTransformer(
        img_size=32, patch_size=8, embed_dim=dim, depth=depth, num_heads=2, num_classes=0, reg_tokens=reg_tokens,
        class_token=class_token, global_pool="token" if class_token else "avg", no_embed_class=reg_tokens > 0,
    )
    # larger position / class embeddings than timm's init, so tokens differ clearly
    with torch.no_grad():
        for name in ("pos_embed", "cls_token", "reg_token"):
            p = getattr(model, name, None)
            if p is not None:
                p.normal_(0.0, 0.5)
    return model.eval().requires_grad_(False)


def images(n: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, 3, 32, 32, generator=torch.Generator().manual_seed(seed))


def norm_scorer(F: torch.Tensor) -> torch.Tensor:
    """A stand-in importance head: the token norm (positive, deterministic)."""
    return F.norm(dim=-1)


def block_inputs(model, x: torch.Tensor) -> list:
    """The input of every block during ``model.forward_features(x)``."""
    seen: list = []
    handles = [blk.register_forward_pre_hook(lambda m, args: seen.append(args[0].detach().clone())) for blk in model.blocks]
    try:
        model.forward_features(x)
    finally:
        for h in handles:
            h.remove()
    return seen


def norm_prune_full_llf_reference(h: torch.Tensor, middle, last, count: int):
    """Hand-written 1-stage prune with full LLF for a model without a CLS-row shortcut: for each
    image of ``h [B, N, D]`` (the input of the stage), drop the ``count`` patch tokens of lowest
    norm, run the ``middle`` layers on the rest, re-insert the frozen tokens and run ``last`` on
    the full sequence. Returns ``(outputs [B, N, D], removed positions per image)``."""
    expected, frozen_at = [], []
    for b in range(h.shape[0]):
        removed = sorted((torch.argsort(h[b, 1:].norm(dim=-1))[:count] + 1).tolist())
        kept = [t for t in range(h.shape[1]) if t not in removed]
        y = h[b:b + 1, kept]
        for layer in middle:
            y = layer(y)
        full = h[b:b + 1].clone()
        full[:, kept] = y
        expected.append(last(full))
        frozen_at.append(removed)
    return torch.cat(expected), frozen_at
