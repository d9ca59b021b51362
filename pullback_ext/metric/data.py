"""Probes and images for the training and evaluation commands.

A probe is described by a JSON-able ``ProbeSpec`` (stored in every checkpoint's config, so
``pullback eval-head`` rebuilds exactly the probe a head was trained on). Images come from a folder
or from the demo scene renderer, addressed by index so that any range can be (re)loaded.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor

from pullback_ext.errors import PullbackError
from pullback_ext.probes.features import Features

DEMO_TRAIN_SEED = 1_000
DEMO_BLOCK = 32


@dataclass(frozen=True)
class ProbeSpec:
    """The exact probe definition: ``model`` timm:NAME | hf:DIR | demo, local ``weights``, ``layer``,
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


def build_probe(spec: ProbeSpec, dtype: torch.dtype = torch.float32):
    """(probe, preprocess) for ``spec``; the probe is cast to ``dtype``."""
    from pullback_ext.model_loading import build

    setup = build(spec.model, spec.weights, spec.layer, spec.decoder, spec.output_size, spec.img_size)
    probe, preprocess = setup.probe, setup.preprocess
    if spec.vae is not None:
        from pullback_ext.metric.checkpoint import load_model
        from pullback_ext.metric.vae import LatentProbe

        vae, _ = load_model(spec.vae, kind="vae")
        probe = LatentProbe(probe, vae.requires_grad_(False))
    return probe.to(dtype), preprocess


class ImageSource:
    """Images by index: the first ``count`` files of a folder after skipping ``offset``, or demo
    scenes (training scenes rendered in fixed blocks of 32 from a seed range, or ``heldout``)."""

    def __init__(self, count: int, folder: Optional[str] = None, preprocess=None, offset: int = 0, heldout: bool = False) -> None:
        self.count, self.folder, self.preprocess, self.heldout = count, folder, preprocess, heldout
        if folder is not None:
            from pullback_ext.images import check_readable, list_images

            paths = list_images(folder)
            if len(paths) < offset + count:
                raise PullbackError(f"--images: expected at least {offset + count} images in {folder!r} (training + held-out), found {len(paths)}")
            self.paths = paths[offset : offset + count]
            check_readable(self.paths)

    def __len__(self) -> int:
        return self.count

    def describe(self) -> dict:
        """What identifies image i (part of the target cache's key). Rendered training scenes come
        in fixed blocks, so scene i does not depend on ``count`` and a larger run reuses the
        shards of a smaller one; folders and held-out scenes are described by their full set."""
        if self.folder is not None:
            return {"folder": str(Path(self.folder).resolve()), "files": [p.name for p in self.paths]}
        if self.heldout:
            return {"demo": "heldout", "seed": 0, "count": self.count}
        return {"demo": "render", "seed": DEMO_TRAIN_SEED, "block": DEMO_BLOCK}

    def images(self, start: int, stop: int) -> Tensor:
        """images[stop-start,3,H,W] (float32)."""
        if self.folder is not None:
            from pullback_ext.images import load_images

            return load_images(self.paths[start:stop], self.preprocess)
        from pullback_ext.embedded import heldout
        from pullback_ext.embedded.scenes import render

        if self.heldout:
            return heldout(stop, 0)["images"][start:stop]
        blocks = range(start // DEMO_BLOCK, (stop - 1) // DEMO_BLOCK + 1)
        rendered = torch.cat([render(DEMO_BLOCK, DEMO_TRAIN_SEED + b)["images"] for b in blocks])
        first = blocks[0] * DEMO_BLOCK
        return rendered[start - first : stop - first]


def features(probe, source: ImageSource, start: int, stop: int) -> Features:
    """The ``Features`` of images start..stop-1 (F[stop-start,N,D] and their per-image context), in
    the probe's dtype."""
    dtype = next(iter(probe.parameters())).dtype
    return probe.features(source.images(start, stop).to(dtype)).detach()


def image_sources(images: Optional[str], demo: bool, num_images: int, num_heldout: int, preprocess) -> tuple[ImageSource, ImageSource]:
    """(training, held-out) images: a folder split in two (training first), or demo scenes."""
    if images is not None:
        return ImageSource(num_images, images, preprocess), ImageSource(num_heldout, images, preprocess, offset=num_images)
    if not demo:
        raise PullbackError("--images: required unless --demo (rendered demo scenes)")
    return ImageSource(num_images), ImageSource(num_heldout, heldout=True)
