"""``builtin:scenes``: scenes rendered by the embedded demo renderer, as an image source.

Held-out scenes are ``pullback_ext.embedded.heldout(count, seed)`` (seed 0 for ``heldout``, seeds
0..k-1 for ``seed_sets``); training scenes are rendered in fixed blocks of 32 from a seed range
of their own, so scene i does not depend on how many are asked for. Scenes are rendered at the
preprocessing's resize side (no resampling), then centre-cropped and normalised as it says; they
carry class labels, metric depth and the per-pixel semantic classes (``classes [n, H, W]``, uint8, cropped
as the images are: what the segmentation task is scored against).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from pullback_ext.sources.image_sets import ImageSet, ImageSource
from pullback_ext.sources.preprocess import Preprocess

TRAINING_SEED = 1_000
TRAINING_BLOCK = 32


KEYS = ("images", "labels", "depth", "classes")  # what a loaded set of scenes holds


def _prepared(scenes: dict, preprocess: Preprocess) -> dict:
    images = preprocess.from_unit_tensor(scenes["images"])
    h, w = images.shape[-2:]
    top, left = (scenes["classes"].shape[-2] - h) // 2, (scenes["classes"].shape[-1] - w) // 2
    return {"images": images, "labels": scenes["labels"], "depth": scenes["depth"],
            "classes": scenes["classes"][:, top:top + h, left:left + w].to(torch.uint8)}  # 11 classes: a byte each


def _select(scenes: dict, indices: Sequence[int]) -> dict:
    index = torch.as_tensor(list(indices), dtype=torch.long)
    return {key: value[index] for key, value in scenes.items()}


class HeldoutScenes(ImageSet):
    """``count`` held-out scenes of seed ``seed`` (rendered once, on first use)."""

    def __init__(self, count: int, seed: int, preprocess: Preprocess) -> None:
        self.count, self.seed, self.preprocess = count, seed, preprocess
        self._rendered: Optional[dict] = None

    def __len__(self) -> int:
        return self.count

    def load(self, indices: Optional[Sequence[int]] = None) -> dict:
        from pullback_ext.embedded import heldout

        if self._rendered is None:
            scenes = heldout(self.count, self.seed, self.preprocess.resize, classes=True)
            self._rendered = _prepared({k: scenes[k] for k in KEYS}, self.preprocess)
        return dict(self._rendered) if indices is None else _select(self._rendered, indices)

    def names(self) -> list[str]:
        return [f"heldout-scene-{self.seed}-{i}" for i in range(self.count)]

    def describe(self) -> dict:
        return {"demo": "heldout", "seed": self.seed, "count": self.count}


class TrainingScenes(ImageSet):
    """The first ``count`` training scenes, rendered block by block as they are asked for."""

    def __init__(self, count: int, preprocess: Preprocess) -> None:
        self.count, self.preprocess = count, preprocess

    def __len__(self) -> int:
        return self.count

    def load(self, indices: Optional[Sequence[int]] = None) -> dict:
        from pullback_ext.embedded.scenes import render

        wanted = list(range(self.count)) if indices is None else list(indices)
        blocks = sorted({i // TRAINING_BLOCK for i in wanted})
        parts = [render(TRAINING_BLOCK, TRAINING_SEED + b, self.preprocess.resize, classes=True) for b in blocks]
        rendered = {key: torch.cat([part[key] for part in parts]) for key in KEYS}
        position = {b: n * TRAINING_BLOCK for n, b in enumerate(blocks)}
        chosen = _select(rendered, [position[i // TRAINING_BLOCK] + i % TRAINING_BLOCK for i in wanted])
        return _prepared(chosen, self.preprocess)

    def names(self) -> list[str]:
        return [f"training-scene-{i}" for i in range(self.count)]

    def describe(self) -> dict:
        # rendered in fixed blocks: scene i does not depend on ``count``, so a larger run reuses
        # the target shards of a smaller one
        return {"demo": "render", "seed": TRAINING_SEED, "block": TRAINING_BLOCK}


class SceneSource(ImageSource):
    """Rendered demo scenes; any number of them (``after`` and ``partial`` do not apply)."""

    spec = "builtin:scenes"

    def training(self, preprocess: Preprocess, count: int) -> TrainingScenes:
        return TrainingScenes(count, preprocess)

    def heldout(self, preprocess: Preprocess, count: int, after: int = 0, partial: bool = False) -> HeldoutScenes:
        return HeldoutScenes(count, 0, preprocess)

    def seed_sets(self, preprocess: Preprocess, per_seed: int, seeds: int) -> list[HeldoutScenes]:
        return [HeldoutScenes(per_seed, seed, preprocess) for seed in range(seeds)]
