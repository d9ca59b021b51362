"""Quality of a reduced model, always relative to the unpruned model on the same input."""

from __future__ import annotations

import math
from typing import Optional

import torch

from pullback_ext.errors import PullbackError


def _same_shape(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    if a.shape != b.shape:
        raise PullbackError(f"{what}: reduced and full outputs must have one shape; got {tuple(a.shape)} and {tuple(b.shape)}")


def cosine_x100(reduced: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """``100 · (1 − cos(e_reduced, e_full))`` per image: embeddings ``[B, E]`` -> ``[B]``.

    Computed as ``½ ‖â − ê‖²`` of the unit vectors: no cancellation for nearly equal embeddings,
    and exactly 0 for equal ones.
    """
    _same_shape(reduced, full, "cosine")
    a = torch.nn.functional.normalize(reduced.double().flatten(1), dim=1)
    b = torch.nn.functional.normalize(full.double().flatten(1), dim=1)
    return 50.0 * (a - b).square().sum(dim=1)


def silog_x100(reduced: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """Additional SILog ×100 per image: ``g = log d_reduced − log d_full``,
    ``100 · sqrt(mean g² − (mean g)²)``; depth maps ``[B, H, W]`` (> 0) -> ``[B]``."""
    _same_shape(reduced, full, "silog")
    if not (bool((reduced > 0).all()) and bool((full > 0).all())):
        raise PullbackError("silog: depth maps must be strictly positive")
    g = (reduced.double().log() - full.double().log()).flatten(1)
    var = (g.square().mean(1) - g.mean(1).square()).clamp_min(0.0)
    return 100.0 * var.sqrt()


def pixel_kl_x100(reduced: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """Per-pixel KL divergence of the class distributions, ×100, per image: logits
    ``[B, C, H, W]`` -> ``[B]``, ``100 · mean over pixels of KL(p_full ‖ p_reduced)`` (nats), the
    softmaxes over ``C`` taken in float64. Exactly 0 for equal logits."""
    _same_shape(reduced, full, "pixel_kl")
    if reduced.dim() != 4:
        raise PullbackError(f"pixel_kl: expected logits [B, C, H, W], got shape {tuple(reduced.shape)}")
    log_p = torch.log_softmax(full.double(), dim=1)
    log_q = torch.log_softmax(reduced.double(), dim=1)
    kl = (log_p.exp() * (log_p - log_q)).sum(dim=1).clamp_min(0.0)
    return 100.0 * kl.flatten(1).mean(dim=1)


def confusion_matrices(pred: torch.Tensor, target: torch.Tensor, num_classes: int) -> torch.Tensor:
    """Per-image confusion counts: class maps ``pred``, ``target`` ``[B, H, W]`` (ints in
    ``[0, num_classes)``) -> int64 ``[B, C, C]``, entry ``[b, t, p]`` = pixels of image b with
    target class t predicted as p. Sum over the batch for a data set's matrix."""
    _same_shape(pred, target, "confusion")
    if pred.dim() != 3:
        raise PullbackError(f"confusion: expected class maps [B, H, W], got shape {tuple(pred.shape)}")
    pred, target = pred.long(), target.long()
    for what, values in (("pred", pred), ("target", target)):
        if values.numel() and (int(values.min()) < 0 or int(values.max()) >= num_classes):
            raise PullbackError(f"confusion: {what} classes must lie in [0, {num_classes}), got {int(values.min())}..{int(values.max())}")
    b = pred.shape[0]
    cell = (torch.arange(b)[:, None] * num_classes + target.flatten(1)) * num_classes + pred.flatten(1)
    return torch.bincount(cell.flatten(), minlength=b * num_classes * num_classes).reshape(b, num_classes, num_classes)


def class_iou(confusion: torch.Tensor) -> torch.Tensor:
    """IoU of each class from a confusion matrix ``[..., C, C]`` -> float64 ``[..., C]``:
    ``tp / (tp + fp + fn)``; NaN for a class absent from both maps."""
    confusion = confusion.double()
    tp = confusion.diagonal(dim1=-2, dim2=-1)
    union = confusion.sum(dim=-1) + confusion.sum(dim=-2) - tp
    return torch.where(union > 0, tp / union.clamp_min(1.0), torch.full_like(tp, math.nan))


def mean_iou(confusion: torch.Tensor) -> torch.Tensor:
    """Mean IoU over the classes present in either map: confusion ``[..., C, C]`` -> float64 ``[...]``."""
    return class_iou(confusion).nanmean(dim=-1)


def argmax_miou(reduced: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """Agreement of the argmax class maps, per image: logits ``[B, C, H, W]`` -> mIoU ``[B]`` of
    the reduced model's map against the unreduced one's (classes present in either map of that
    image; 1 for identical maps)."""
    _same_shape(reduced, full, "argmax_miou")
    if reduced.dim() != 4:
        raise PullbackError(f"argmax_miou: expected logits [B, C, H, W], got shape {tuple(reduced.shape)}")
    return mean_iou(confusion_matrices(reduced.argmax(dim=1), full.argmax(dim=1), reduced.shape[1]))


def miou_gap_x100(reduced: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """``100 · (1 − argmax_miou)`` per image: the argmax agreement as an error (0 when equal)."""
    return 100.0 * (1.0 - argmax_miou(reduced, full))


def knn_top1(
    bank: torch.Tensor,
    bank_labels: torch.Tensor,
    queries: torch.Tensor,
    query_labels: torch.Tensor,
    k: int = 10,
    exclude_self: bool = False,
) -> float:
    """Top-1 accuracy of a cosine k-NN classifier (votes weighted ``1 + 1e-6 · similarity``, so
    ties go to the nearer neighbours): ``bank [M, E]``, ``bank_labels [M]``, ``queries [Q, E]``,
    ``query_labels [Q]``. ``exclude_self``: query i is image i of the bank (leave-one-out)."""
    if bank.shape[0] != bank_labels.shape[0] or queries.shape[0] != query_labels.shape[0]:
        raise PullbackError("knn: each embedding needs one label")
    if exclude_self and bank.shape[0] != queries.shape[0]:
        raise PullbackError("knn: exclude_self needs one query per bank entry")
    available = bank.shape[0] - (1 if exclude_self else 0)
    if available < 1:
        raise PullbackError("knn: the bank needs at least one image besides the query")
    k = max(1, min(int(k), available))
    sim = torch.nn.functional.normalize(queries.double(), dim=1) @ torch.nn.functional.normalize(bank.double(), dim=1).T
    if exclude_self:
        sim.fill_diagonal_(-math.inf)
    top = sim.topk(k, dim=1)
    num_classes = int(max(bank_labels.max(), query_labels.max())) + 1
    votes = torch.zeros(queries.shape[0], num_classes, dtype=torch.float64)
    votes.scatter_add_(1, bank_labels[top.indices], 1.0 + 1e-6 * top.values)
    return float((votes.argmax(dim=1) == query_labels).double().mean())


def wilcoxon_p(ours: torch.Tensor, baseline: torch.Tensor) -> Optional[float]:
    """One-sided Wilcoxon signed-rank p-value that ``ours`` (per-image errors) is lower than
    ``baseline`` on the same images; None when every pair is tied."""
    from scipy.stats import wilcoxon

    a, b = ours.double().flatten().numpy(), baseline.double().flatten().numpy()
    if a.shape != b.shape:
        raise PullbackError(f"wilcoxon: paired samples must match; got {a.shape} and {b.shape}")
    if not (a != b).any():
        return None
    p = float(wilcoxon(a, b, alternative="less").pvalue)
    return None if math.isnan(p) else p
