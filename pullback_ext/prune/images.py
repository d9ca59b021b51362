"""Image sets for the evaluation: a folder of images, or held-out demo scenes."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from pullback_ext.errors import PullbackError


def load_folder(directory: str, preprocess: Callable, limit: int | None = None) -> dict:
    """Images of ``directory`` through ``preprocess`` (see :mod:`pullback_ext.images`).

    A folder of class subfolders gives labels (the subfolder's index in sorted order); a flat
    folder has none. Files come in a fixed pseudo-random order (seed 0), so that a ``limit`` or a
    split into seeds mixes the classes. Returns ``{"images": [n, 3, H, W], "labels": [n] or None}``.
    """
    from pullback_ext.images import IMAGE_EXTENSIONS, list_images, load_images

    root = Path(directory)
    if not root.is_dir():
        raise PullbackError(f"--images: {directory!r} is not a folder")
    classes = sorted(p for p in root.iterdir() if p.is_dir() and any(f.suffix.lower() in IMAGE_EXTENSIONS for f in p.iterdir()))
    if classes:
        files = [(path, label) for label, folder in enumerate(classes) for path in list_images(folder)]
    else:
        files = [(path, None) for path in list_images(root)]
    order = torch.randperm(len(files), generator=torch.Generator().manual_seed(0)).tolist()
    files = [files[i] for i in order][:limit]
    images = load_images([path for path, _ in files], preprocess)
    labels = torch.tensor([label for _, label in files]) if classes else None
    return {"images": images, "labels": labels}


def demo_scenes(n: int, seed: int, size: int) -> dict:
    """``n`` held-out demo scenes of seed ``seed`` (images in [0, 1] and class labels)."""
    from pullback_ext.embedded import heldout

    data = heldout(n, seed, size)
    return {"images": data["images"], "labels": data["labels"]}
