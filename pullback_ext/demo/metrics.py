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
    segmented = evaluate_segmentation(model, segmentation_head, data, batch_size)
    return quality | {"miou": segmented["miou"], "pixel_accuracy": segmented["pixel_accuracy"]}


def evaluate_segmentation(model, head, data: dict, batch_size: int = 32) -> dict:
    """Held-out pixel accuracy, mIoU (over the data set's confusion matrix) and per-class IoU of
    ``head`` on rendered ``data`` (images, classes), in float32."""
    from pullback_ext.comparison.quality import class_iou, confusion_matrices
    from pullback_ext.embedded.scenes import SEGMENT_CLASS_NAMES

    confusion = torch.zeros(head.num_classes, head.num_classes, dtype=torch.int64)
    with torch.no_grad():
        for start in range(0, data["images"].shape[0], batch_size):
            images = data["images"][start:start + batch_size].float()
            pred = model.segment(images, head).argmax(dim=1)
            confusion += confusion_matrices(pred, data["classes"][start:start + batch_size], head.num_classes).sum(0)
    iou = class_iou(confusion)
    return {
        "pixel_accuracy": float(confusion.diagonal().sum() / confusion.sum()),
        "miou": float(iou.nanmean()),
        "class_iou": {name: (None if value != value else float(value)) for name, value in zip(SEGMENT_CLASS_NAMES, iou.tolist())},
        "class_pixel_fraction": {name: float(v) for name, v in zip(SEGMENT_CLASS_NAMES, (confusion.sum(1) / confusion.sum()).tolist())},
        "num_images": int(data["images"].shape[0]),
    }
