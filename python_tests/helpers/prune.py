"""Small timm ViTs and Hugging Face models (DPT, DINOv2, ViT, CLIP and SigLIP vision, DINOv3) with
random weights for the token merging / pruning tests, and hand-written references of one reduction
stage."""

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


HF_OPTIONS = dict(hidden_size=32, num_hidden_layers=4, num_attention_heads=2, intermediate_size=64, image_size=32,
                  patch_size=8, initializer_range=0.3)


def tiny_hf(family: str, attn: str = "eager", registers: int = 2, **extra):
    """A 4-layer Hugging Face vision model of ``family`` (``vit``: ``ViTModel``, ``vit_cls``:
    ``ViTForImageClassification``, ``clip``: ``CLIPVisionModel``, ``clip_projection``:
    ``CLIPVisionModelWithProjection``, ``siglip``: ``SiglipVisionModel``, ``dinov3``:
    ``DINOv3ViTModel`` with ``registers``) for 32×32 images, patch 8, width 32."""
    import transformers as tf

    classes = {"vit": ("ViTConfig", "ViTModel"), "vit_cls": ("ViTConfig", "ViTForImageClassification"),
               "clip": ("CLIPVisionConfig", "CLIPVisionModel"),
               "clip_projection": ("CLIPVisionConfig", "CLIPVisionModelWithProjection"),
               "siglip": ("SiglipVisionConfig", "SiglipVisionModel"), "dinov3": ("DINOv3ViTConfig", "DINOv3ViTModel"),
               "dinov3_backbone": ("DINOv3ViTConfig", "DINOv3ViTBackbone")}
    config_class, model_class = classes[family]
    options = dict(HF_OPTIONS, attn_implementation=attn, **extra)
    if family.startswith("dinov3"):
        options.update(num_register_tokens=registers, layerscale_value=0.5)
    if family == "vit_cls":
        options.update(num_labels=5)
    torch.manual_seed(0)
    model = getattr(tf, model_class)(getattr(tf, config_class)(**options))
    return model.eval().requires_grad_(False)


def tiny_eva(name: str = "eva02_tiny_patch14_224", img_size: int = 56, depth: int = 4):
    """A random-weight timm ``Eva`` in float64 (16 patches at the default sizes), with LayerScale
    factors and embeddings large enough to matter (see :func:`helpers.blocks.small_timm`)."""
    from helpers.blocks import small_timm

    model = small_timm(name, img_size, depth=depth)
    with torch.no_grad():
        for name_, p in model.named_parameters():
            if name_.endswith(("gamma_1", "gamma_2")):
                p.normal_(0.0, 0.5)
    return model


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


def _plain_layer(layer, y, kept):
    return layer(y)


def norm_prune_full_llf_reference(h: torch.Tensor, middle, last, count: int, num_prefix: int = 1, call=_plain_layer):
    """Hand-written 1-stage prune with full LLF for a model without a CLS-row shortcut: for each
    image of ``h [B, N, D]`` (the input of the stage), drop the ``count`` patch tokens of lowest
    norm, run the ``middle`` layers on the rest, re-insert the frozen tokens and run ``last`` on
    the full sequence; ``call(layer, y, kept)`` runs a layer on the tokens at positions ``kept``
    (all positions for ``last``). Returns ``(outputs [B, N, D], removed positions per image)``."""
    expected, frozen_at = [], []
    for b in range(h.shape[0]):
        removed = sorted((torch.argsort(h[b, num_prefix:].norm(dim=-1))[:count] + num_prefix).tolist())
        kept = [t for t in range(h.shape[1]) if t not in removed]
        y = h[b:b + 1, kept]
        for layer in middle:
            y = call(layer, y, kept)
        full = h[b:b + 1].clone()
        full[:, kept] = y
        expected.append(call(last, full, list(range(h.shape[1]))))
        frozen_at.append(removed)
    return torch.cat(expected), frozen_at


def norm_merge_reference(h: torch.Tensor, rest, count: int, num_prefix: int = 1, call=_plain_layer):
    """Hand-written 1-stage merge (no proportional attention): for each image of ``h [B, N, D]``
    (the input of the stage) the ``count`` patch tokens of lowest norm merge into their most
    cosine-similar remaining patch token (size-weighted averages), the ``rest`` layers run on the
    remaining tokens (``call(layer, y, kept)``, ``kept``: their positions, a merged token is at its
    destination's) and every original token takes the output of the token it went into.
    Returns the unmerged outputs ``[B, N, D]``."""
    out = []
    for b in range(h.shape[0]):
        tokens = h[b]
        src = (torch.argsort(tokens[num_prefix:].norm(dim=-1))[:count] + num_prefix).tolist()
        kept = [t for t in range(h.shape[1]) if t not in src]
        members = {t: [t] for t in kept}
        candidates = [t for t in kept if t >= num_prefix]
        for s in src:
            similarity = torch.nn.functional.cosine_similarity(tokens[s][None], tokens[candidates], dim=-1)
            members[candidates[int(similarity.argmax())]].append(s)
        y = torch.stack([tokens[members[t]].mean(dim=0) for t in kept])[None]
        for layer in rest:
            y = call(layer, y, kept)
        full = torch.empty_like(h[b:b + 1])
        for row, t in enumerate(kept):
            full[0, members[t]] = y[0, row]
        out.append(full)
    return torch.cat(out)


def attention_prune_reference(h: torch.Tensor, layers, call, attention, stages: tuple, count: int, num_prefix: int = 1):
    """Hand-written ``evit_score`` prune without LLF: for each image of ``h [B, N, D]`` (the input of
    layer 0), before each layer of ``stages`` the ``count`` patch tokens the CLS token attended to
    least in the layer before go, frozen as they are; ``attention(layer, y, kept) -> [1, K, K]``
    gives a layer's head-averaged attention on the tokens ``y`` at positions ``kept``, ``call(layer,
    y, kept)`` runs it. Returns the full-length outputs ``[B, N, D]``."""
    expected = []
    for b in range(h.shape[0]):
        kept, frozen, y, probs = list(range(h.shape[1])), {}, h[b:b + 1], None
        for i, layer in enumerate(layers):
            if i in stages:
                drop = (torch.argsort(probs[0, 0, num_prefix:])[:count] + num_prefix).tolist()
                frozen.update({kept[j]: y[0, j] for j in drop})
                rows = [j for j in range(len(kept)) if j not in drop]
                kept, y = [kept[j] for j in rows], y[:, rows]
            probs = attention(layer, y, kept)
            y = call(layer, y, kept)
        expected.append(torch.stack([frozen[t] if t in frozen else y[0, kept.index(t)] for t in range(h.shape[1])]))
    return torch.stack(expected)
