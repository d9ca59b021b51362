"""The image interface every source implements: an :class:`ImageSource` hands out
:class:`ImageSet` s, ordered finite sets of model-ready images addressed by index."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Optional, Sequence

from torch import Tensor

from pullback_ext.sources.preprocess import Preprocess


class ImageSet(ABC):
    """Images prepared by one :class:`Preprocess`, addressed by index 0..len-1."""

    preprocess: Preprocess

    @abstractmethod
    def __len__(self) -> int:
        ...

    @abstractmethod
    def load(self, indices: Optional[Sequence[int]] = None) -> dict:
        """The images at ``indices`` (default: all): ``{"images": [n,3,H,W] float32, "labels": [n]
        int64 or None}``, plus ``"depth": [n,H,W]`` (metres) where the source knows it."""

    def images(self, indices: Sequence[int]) -> Tensor:
        """images[len(indices),3,H,W] (float32)."""
        return self.load(indices)["images"]

    @abstractmethod
    def names(self) -> list[str]:
        """One name per image, for reports (a file name, a scene id)."""

    @abstractmethod
    def describe(self) -> dict:
        """JSON-able identity of the images (part of the target cache's key)."""


class ImageSource(ABC):
    """Where images come from: a folder or a built-in set (see :mod:`pullback_ext.sources.images`).

    ``training`` and ``heldout`` are disjoint: a folder's training images are its first files,
    its held-out images the ones after them; a built-in set draws them from separate ranges.
    """

    spec: str  # as the user names it: a folder path or builtin:NAME

    @abstractmethod
    def training(self, preprocess: Preprocess, count: int) -> ImageSet:
        """``count`` images to train on; DataError when the source has fewer."""

    @abstractmethod
    def heldout(self, preprocess: Preprocess, count: int, after: int = 0, partial: bool = False) -> ImageSet:
        """``count`` images to evaluate or diagnose, disjoint from ``training(p, after)``; with
        ``partial`` a source with fewer gives what it has, else that is a DataError."""

    @abstractmethod
    def seed_sets(self, preprocess: Preprocess, per_seed: int, seeds: int) -> list[ImageSet]:
        """``seeds`` disjoint sets of up to ``per_seed`` images each, labelled where the source
        knows labels: independent repetitions of an evaluation."""

