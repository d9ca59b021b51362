"""Small timm ViTs and Hugging Face DPT / DINOv2 models with random weights for the token merging /
pruning tests."""

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


def tiny_dpt():
    """DPT (ViT backbone) for 32×32 images, patch 8, 4 layers of width 32, eager attention."""
    from transformers import DPTConfig, DPTForDepthEstimation

    cfg = DPTConfig(
        hidden_size=32, num_hidden_layers=4, num_attention_heads=2, intermediate_size=64, image_size=32, patch_size=8,
        backbone_out_indices=[0, 1, 2, 3], neck_hidden_sizes=[8, 16, 16, 16], fusion_hidden_size=16,
        reassemble_factors=[4, 2, 1, 0.5], initializer_range=0.3,
    )
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    return DPTForDepthEstimation(cfg).eval().requires_grad_(False)


def tiny_dinov2(attn: str = "eager", registers: int = 0):
    """DINOv2 (with ``registers`` register tokens if any) for 32×32 images, patch 8, 4 layers of width 32."""
    from transformers import Dinov2Config, Dinov2Model, Dinov2WithRegistersConfig, Dinov2WithRegistersModel

    options = dict(hidden_size=32, num_hidden_layers=4, num_attention_heads=2, intermediate_size=64, image_size=32,
                   patch_size=8, initializer_range=0.3, layerscale_value=1.0, attn_implementation=attn)
    torch.manual_seed(0)
    if registers:
        return Dinov2WithRegistersModel(Dinov2WithRegistersConfig(num_register_tokens=registers, **options)).eval().requires_grad_(False)
    return Dinov2Model(Dinov2Config(**options)).eval().requires_grad_(False)


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
