"""Adapters that give the evaluation one view of a model: unpruned outputs, reduced outputs.

Outputs are dicts with ``embedding [B, E]`` (CLS task) and, for models with a dense decoder,
``depth [B, H, W]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from pullback_ext.errors import PullbackError
from pullback_ext.prune import timm_vit
from pullback_ext.prune.pipeline import ReductionConfig, run_blocks


@dataclass
class Backbone:
    """A model seen by the evaluation: ``full(images)`` and ``reduced(cfg, images)`` -> outputs."""

    name: str
    depth: int
    num_prefix: int
    has_cls: bool
    image_size: int
    tasks: tuple
    full: Callable
    reduced: Callable
    features_dim: int


def demo_backbone(model) -> Backbone:
    """The demo model (timm backbone + CLS head + DPT depth head reading ``hook_layers``)."""
    bb = model.backbone

    def full(images: torch.Tensor) -> dict:
        return model(images)

    def reduced(cfg: ReductionConfig, images: torch.Tensor) -> dict:
        final, hooked = run_blocks(cfg, model.embed(images), bb.blocks, timm_vit.call_block, timm_vit.attention_probs,
                                   take=set(model.hook_layers))
        return model.decode(final, hooked)

    return Backbone(
        name="demo", depth=len(bb.blocks), num_prefix=int(bb.num_prefix_tokens), has_cls=bb.cls_token is not None,
        image_size=int(model.image_size), tasks=("cls", "depth"), full=full, reduced=reduced, features_dim=int(bb.embed_dim),
    )


def timm_backbone(model) -> Backbone:
    """A timm VisionTransformer; the CLS task compares pre-logits features."""
    if not all(hasattr(model, a) for a in ("patch_embed", "_pos_embed", "blocks", "forward_head")):
        raise PullbackError(f"--model must name a timm VisionTransformer; got {type(model).__name__}")

    def full(images: torch.Tensor) -> dict:
        return {"embedding": model.forward_head(model.forward_features(images), pre_logits=True)}

    def reduced(cfg: ReductionConfig, images: torch.Tensor) -> dict:
        return {"embedding": model.forward_head(timm_vit.forward_features(model, cfg, images), pre_logits=True)}

    size = model.patch_embed.img_size
    return Backbone(
        name=type(model).__name__, depth=len(model.blocks), num_prefix=int(model.num_prefix_tokens),
        has_cls=getattr(model, "cls_token", None) is not None, image_size=int(size[0] if isinstance(size, (tuple, list)) else size),
        tasks=("cls",), full=full, reduced=reduced, features_dim=int(model.embed_dim),
    )


def block_output_tokens(model, backbone: Backbone, images: torch.Tensor, layer: int) -> torch.Tensor:
    """Patch tokens ``[B, n, D]`` after block ``layer`` of the unreduced model (demo or timm)."""
    with torch.no_grad():
        if backbone.name == "demo":
            return model.run_blocks(model.embed(images), 0, layer + 1)[:, backbone.num_prefix:]
        return model.forward_intermediates(images, indices=[layer], output_fmt="NLC", intermediates_only=True)[0]
