"""Folders of random images for the command-line tests."""

from __future__ import annotations

from pathlib import Path

import torch


def random_image_folder(folder: Path, count: int, size: int, seed: int = 0) -> Path:
    """``count`` random RGB PNGs of ``size``×``size`` pixels, ``0.png`` … in ``folder`` (created)."""
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    for i in range(count):
        Image.fromarray((torch.rand(size, size, 3, generator=g) * 255).to(torch.uint8).numpy()).save(folder / f"{i}.png")
    return folder
