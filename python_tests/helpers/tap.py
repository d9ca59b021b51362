"""An oracle for a TAP register's held-out CLS distortion, written out apart from
``pullback_ext.tap_training.evaluation`` (the code the commands call)."""

from __future__ import annotations

import torch


def cls_distortion_x100(model, register, images: torch.Tensor, rho: float) -> float:
    """Mean over ``images [B, 3, H, W]`` of 100·(1 − cos) between the demo ``model``'s CLS embedding
    with ``register`` deployed at keep rate ``rho`` (tokens removed), each image reduced alone (TAP
    splits its budget by the batch's mean share, so a matched-cost point measures it image by image),
    and the unpruned model's own forward ``model(images)``; the cosine from float64 dot products and norms."""
    from pullback_ext.comparison.backbones import demo_backbone
    from pullback_ext.prune.reduction_options import BackboneShape, ReductionOptions

    register.eval()
    backbone = demo_backbone(model)
    shape = BackboneShape(depth=backbone.depth, num_prefix=backbone.num_prefix, has_cls=backbone.has_cls)
    with torch.no_grad():
        full = model(images)["embedding"].double()
        reduction = ReductionOptions(strategy="tap", head=register, ratio=1.0 - rho).resolve(shape)
        pruned = torch.cat([backbone.reduced(reduction, images[i:i + 1])["embedding"] for i in range(images.shape[0])]).double()
    cos = (pruned * full).sum(-1) / (pruned.norm(dim=-1) * full.norm(dim=-1))
    return float(100 * (1 - cos).mean())
