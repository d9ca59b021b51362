"""A folder of images as an image source.

Training and held-out images are the folder's files in name order (training first). Seed sets
take class subfolders as labels (the subfolder's index in sorted order; a flat folder has none)
and the files in a fixed pseudo-random order (seed 0), so that a split into seeds mixes the classes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

import torch

from pullback_ext.errors import DataError
from pullback_ext.sources.image_files import check_folder, check_readable, has_images, list_images, load_images
from pullback_ext.sources.image_sets import ImageSet, ImageSource
from pullback_ext.sources.preprocess import Preprocess


class FolderImages(ImageSet):
    """Image files of ``folder`` through ``preprocess``, with optional class ``labels`` (one per file)."""

    def __init__(self, folder: Path, paths: Sequence[Path], preprocess: Preprocess, labels: Optional[Sequence[int]] = None,
                 flag: str = "--images") -> None:
        self.folder, self.paths, self.preprocess, self.labels, self.flag = folder, list(paths), preprocess, labels, flag

    def __len__(self) -> int:
        return len(self.paths)

    def load(self, indices: Optional[Sequence[int]] = None) -> dict:
        chosen = range(len(self.paths)) if indices is None else list(indices)
        images = load_images([self.paths[i] for i in chosen], self.preprocess, flag=self.flag)
        labels = None if self.labels is None else torch.tensor([self.labels[i] for i in chosen])
        return {"images": images, "labels": labels}

    def names(self) -> list[str]:
        return [p.name for p in self.paths]

    def describe(self) -> dict:
        return {"folder": str(self.folder.resolve()), "files": self.names()}


class FolderSource(ImageSource):
    """The images of one folder; DataError naming ``flag`` when it is missing or not a folder."""

    def __init__(self, folder: str | Path, flag: str = "--images") -> None:
        self.path, self.flag, self.spec = check_folder(folder, flag), flag, str(folder)

    def training(self, preprocess: Preprocess, count: int) -> FolderImages:
        return self._files(preprocess, count, 0, False, f"{count} training")

    def heldout(self, preprocess: Preprocess, count: int, after: int = 0, partial: bool = False) -> FolderImages:
        return self._files(preprocess, count, after, partial, f"{after} training + {count} held-out" if after else f"{count} held-out")

    def _files(self, preprocess: Preprocess, count: int, after: int, partial: bool, wanted: str) -> FolderImages:
        """Files ``after`` .. ``after + count - 1`` in name order, checked to be readable."""
        files = list_images(self.path, flag=self.flag)
        chosen = files[after : after + count]
        if not chosen or (not partial and len(chosen) < count):
            raise DataError(f"{self.flag}: expected at least {after + count} images in {self.spec!r} ({wanted}), found {len(files)}")
        check_readable(chosen, self.flag)
        return FolderImages(self.path, chosen, preprocess, flag=self.flag)

    def seed_sets(self, preprocess: Preprocess, per_seed: int, seeds: int) -> list[FolderImages]:
        """The folder's files in a fixed shuffled order, ``per_seed * seeds`` at most, split evenly."""
        classes = sorted(p for p in self.path.iterdir() if p.is_dir() and has_images(p))
        if classes:
            files = [(path, label) for label, folder in enumerate(classes) for path in list_images(folder, flag=self.flag)]
        else:
            files = [(path, None) for path in list_images(self.path, flag=self.flag)]
        order = torch.randperm(len(files), generator=torch.Generator().manual_seed(0)).tolist()
        files = [files[i] for i in order][: per_seed * seeds]
        per = len(files) // seeds
        if per < 2:
            raise DataError(f"{self.flag}: {len(files)} images in {self.spec!r} cannot fill {seeds} seeds of at least 2 images")
        parts = [files[s * per : (s + 1) * per] for s in range(seeds)]
        return [FolderImages(self.path, [p for p, _ in part], preprocess, [label for _, label in part] if classes else None, self.flag)
                for part in parts]
