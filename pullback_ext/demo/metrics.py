"""Held-out quality of the demo model: classification top-1, depth AbsRel / δ1 and, with its
segmentation head, the segmentation mIoU and pixel accuracy against the renderer's classes."""

from __future__ import annotations

import torch
from torch import Tensor


def depth_errors(pred: Tensor, target: Tensor) -> dict[str, float]:
    """pred, target: depth[B,H,W] in metres (target > 0). AbsRel = mean |p - t| / t;
    δ1 = fraction of pixels with max(p/t, t/p) < 1.25."""
    ratio = torch.maximum(pred / target, target / pred)
    return {
        "abs_rel": float(((pred - target).abs() / target).mean()),
        "delta1": float((ratio < 1.25).float().mean()),
    }


@torch.no_grad()
def evaluate(model: torch.nn.Module, data: dict, segmentation_head: torch.nn.Module | None = None,
             batch_size: int = 64) -> dict[str, float]:
    """Top-1, AbsRel and δ1 of ``model`` on rendered ``data`` (images, depth, labels); with a
    ``segmentation_head``, ``miou`` and ``pixel_accuracy`` of its argmax maps against ``data``'s
    ``classes [n, H, W]`` too (over the data set's confusion matrix, as the head's record states them)."""
    images, depth, labels = data["images"], data["depth"], data["labels"]
    correct, abs_rel, delta1 = 0, 0.0, 0.0
    for start in range(0, images.shape[0], batch_size):
        stop = min(start + batch_size, images.shape[0])
        out = model(images[start:stop].float())
        correct += int((out["logits"].argmax(-1) == labels[start:stop]).sum())
        errors = depth_errors(out["depth"].float(), depth[start:stop].float())
        abs_rel += errors["abs_rel"] * (stop - start)
        delta1 += errors["delta1"] * (stop - start)
    n = images.shape[0]
    quality = {"top1": correct / n, "abs_rel": abs_rel / n, "delta1": delta1 / n, "num_images": n}
    if segmentation_head is None:
        return quality
    from pullback_ext.demo.train_segmentation import evaluate_segmentation

    segmented = evaluate_segmentation(model, segmentation_head, data, batch_size)
    return quality | {"miou": segmented["miou"], "pixel_accuracy": segmented["pixel_accuracy"]}
