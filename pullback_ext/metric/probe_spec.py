"""The probe definition of the training and evaluation commands, and its features.

A probe is described by a JSON-able ``ProbeSpec`` (stored in every checkpoint's config, so
``pullback eval-head`` rebuilds exactly the probe a head was trained on).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional

import torch
from torch import Tensor

from pullback_ext.probes.features import Features
from pullback_ext.sources.image_sets import ImageSet
from pullback_ext.sources.preprocess import Preprocess


@dataclass(frozen=True)
class ProbeSpec:
    """The exact probe definition: ``model`` demo | timm:NAME | hf:DIR, local ``weights``, ``layer``,
    ``decoder``, dense ``output_size``, timm ``img_size``, and the ``vae`` checkpoint whose latent
    the probe is taken at (None: the features themselves)."""

    model: str
    layer: int
    decoder: str = "cls"
    weights: Optional[str] = None
    output_size: Optional[int] = None
    img_size: Optional[int] = None
    vae: Optional[str] = None

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ProbeSpec":
        known = {k: d[k] for k in cls.__dataclass_fields__ if k in d}
        return cls(**known)


def build_probe(spec: ProbeSpec, dtype: torch.dtype = torch.float32) -> tuple[torch.nn.Module, Preprocess]:
    """(probe, preprocess) for ``spec``; the probe is cast to ``dtype``."""
    from pullback_ext.sources.models import parse_model
    from pullback_ext.sources.probe_setup import build_probe_setup

    setup = build_probe_setup(parse_model(spec.model), spec.weights, spec.layer, spec.decoder, spec.output_size, spec.img_size)
    probe, preprocess = setup.probe, setup.preprocess
    if spec.vae is not None:
        from pullback_ext.metric.checkpoint import load_model
        from pullback_ext.metric.vae import LatentProbe

        vae, _ = load_model(spec.vae, kind="vae")
        probe = LatentProbe(probe, vae.requires_grad_(False))
    return probe.to(dtype), preprocess


def features(probe, images: ImageSet, start: int, stop: int) -> Features:
    """The ``Features`` of images start..stop-1 (F[stop-start,N,D] and their per-image context), in
    the probe's dtype."""
    dtype = next(iter(probe.parameters())).dtype
    return probe.features(images.images(range(start, stop)).to(dtype)).detach()
