"""Image files: listing a folder, checking and decoding the files (PIL) into model-ready tensors."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch
from torch import Tensor

from pullback_ext.errors import DataError, PullbackError

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff", ".ppm")


def check_folder(folder: str | Path, flag: str = "--images") -> Path:
    """``folder`` as a Path; DataError naming ``flag`` when it is missing or not a folder."""
    path = Path(folder)
    if not path.exists():
        raise DataError(f"{flag}: folder {str(path)!r} does not exist")
    if not path.is_dir():
        raise DataError(f"{flag}: {str(path)!r} is not a folder")
    return path


def has_images(folder: Path) -> bool:
    """Whether ``folder`` holds image files directly (by extension)."""
    return any(p.suffix.lower() in IMAGE_EXTENSIONS for p in folder.iterdir())


def list_images(folder: str | Path, limit: Optional[int] = None, flag: str = "--images") -> list[Path]:
    """Sorted image files directly in ``folder`` (by extension), at most ``limit`` of them."""
    path = check_folder(folder, flag)
    if limit is not None and (not isinstance(limit, int) or limit < 1):
        raise PullbackError(f"--num-images: expected a positive int, got {limit!r}")
    files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS)
    if not files:
        raise DataError(f"{flag}: no image files ({', '.join(IMAGE_EXTENSIONS)}) in {str(path)!r}")
    return files[:limit] if limit is not None else files


def check_readable(paths: Sequence[Path], flag: str = "--images") -> None:
    """Open and verify every file (headers and structure) before any work starts."""
    from PIL import Image, UnidentifiedImageError

    for path in paths:
        try:
            with Image.open(path) as image:
                image.verify()
        except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as exc:
            raise DataError(f"{flag}: cannot read image {str(path)!r} ({exc.__class__.__name__})") from exc


def load_images(paths: Sequence[Path], preprocess: Callable, dtype: torch.dtype = torch.float32, flag: str = "--images") -> Tensor:
    """Decode and preprocess ``paths`` into images[B,3,H,W]; an unreadable file is a DataError
    naming it, and images smaller than the preprocessing's ``resize`` side get one warning (they
    are upscaled)."""
    from PIL import Image, UnidentifiedImageError

    out, small = [], []
    for path in paths:
        try:
            with Image.open(path) as image:
                image.load()
                decoded = image.copy()
        except (UnidentifiedImageError, OSError, ValueError) as exc:
            raise DataError(f"{flag}: cannot read image {str(path)!r} ({exc.__class__.__name__}: {exc})") from exc
        if min(decoded.size) < getattr(preprocess, "resize", 0):
            small.append((path, decoded.size))
        out.append(preprocess(decoded))  # outside the try: a preprocessing error is not this file's
    if small:
        path, (w, h) = small[0]
        warnings.warn(f"{flag}: {len(small)} of {len(paths)} images are smaller than the model's input and are upscaled "
                      f"(e.g. {str(path)!r}, {w}×{h} to a shorter side of {preprocess.resize} px)", stacklevel=2)
    return torch.stack(out).to(dtype)
