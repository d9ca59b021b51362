"""``diagnose``: the diagnostic of a probe map at every feature map of a batch."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Callable, Optional, Sequence, Union

from torch import Tensor

from pullback_ext.diagnostics.config import DiagnoseConfig
from pullback_ext.diagnostics.image import diagnose_one
from pullback_ext.diagnostics.results import Diagnosis, ImageDiagnosis
from pullback_ext.errors import PullbackError
from pullback_ext.probes.features import Features, image_map


def _config(config: DiagnoseConfig, overrides: dict[str, Any]) -> DiagnoseConfig:
    if not isinstance(config, DiagnoseConfig):
        raise PullbackError(f"config: expected a DiagnoseConfig, got {type(config).__name__}")
    return dataclasses.replace(config, **overrides) if overrides else config


def _features(probe: Callable[[Tensor], Tensor], F: Union[Tensor, Features]) -> Features:
    """F as ``Features`` [B,N,D] after the checks of its type, shape and dtype (and the probe's own)."""
    if isinstance(F, Features):
        features = F
    elif not isinstance(F, Tensor):
        raise TypeError(f"F: expected a torch.Tensor [B,N,D] or [N,D] or Features, got {type(F).__name__}")
    else:
        if F.dim() == 2:
            F = F.unsqueeze(0)
        if F.dim() != 3 or F.shape[0] < 1:
            raise PullbackError(f"F: expected shape [B,N,D] or [N,D], got {tuple(F.shape)}")
        features = Features(F)
    if not features.F.is_floating_point():
        raise TypeError(f"F: expected a floating-point tensor, got dtype {features.F.dtype}")
    check = getattr(probe, "check_features", None)
    if check is not None:
        check(features.F)
    return features


class RankCappedWarning(UserWarning):
    """The requested rank r exceeds the output dimension M and the diagnosis uses r = M (its
    settings record ``rank`` and ``rank_requested``)."""


def _warn_if_capped(config: DiagnoseConfig, images: Sequence[ImageDiagnosis]) -> None:
    M = images[0].M
    if config.rank > M:
        message = (f"rank: r = {config.rank} exceeds the output dimension M = {M}; the diagnosis uses r = {M} "
                   "(its settings record rank and rank_requested)")
        warnings.warn(message, RankCappedWarning, stacklevel=3)


def diagnose(
    probe: Callable[[Tensor], Tensor],
    F: Union[Tensor, Features],
    config: DiagnoseConfig = DiagnoseConfig(),
    *,
    indices: Optional[Sequence[int]] = None,
    progress: bool = False,
    keep_vectors: bool = True,
    **overrides: Any,
) -> Diagnosis:
    """Matrix-free diagnostic of the probe map ψ (F[B,N,D] -> y[B,M]) at each feature map.

    Args:
        probe: a ``Probe`` (bound to image i's context for image i, ``Probe.bind``) or any callable
            F[B,N,D] -> y[B,M].
        F: ``probe.features(images)`` (``Features``), or feature maps [B,N,D] / [N,D] of a probe
            whose ψ depends on F alone.
        config: the settings (``DiagnoseConfig``); keyword ``overrides`` replace some of its fields,
            e.g. ``diagnose(probe, F, rank=8)``.
        indices: global image indices (default 0..B-1): image i draws from the stream (seed,
            indices[i]), so shards reproduce the single-run streams.
        progress: show a progress bar.
        keep_vectors: keep V[r,N,D] of every image (r·N·D numbers each).

    A rank above M is capped at M (with a warning); the result's settings record both.
    """
    from pullback_ext.progress import progress_bar

    config = _config(config, overrides)
    features = _features(probe, F)
    B = len(features)
    indices = list(range(B)) if indices is None else list(indices)
    if len(indices) != B:
        raise PullbackError(f"indices: expected {B} indices (one per feature map), got {len(indices)}")
    per_image = [
        diagnose_one(image_map(probe, features, b), features.F[b], int(indices[b]), config, keep_vectors)
        for b in progress_bar(range(B), desc="diagnose", unit="image", enabled=progress)
    ]
    _warn_if_capped(config, per_image)
    return Diagnosis.from_images(per_image, config)
