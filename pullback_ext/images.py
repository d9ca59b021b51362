"""Image folders -> model-ready tensors: listing, decoding (PIL) and per-model preprocessing."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch
from torch import Tensor

from pullback_ext.errors import PullbackError

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff", ".ppm")
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def list_images(folder: str | Path, limit: Optional[int] = None) -> list[Path]:
    """Sorted image files directly in ``folder`` (by extension), at most ``limit`` of them."""
    path = Path(folder)
    if not path.exists():
        raise PullbackError(f"--images: folder {str(path)!r} does not exist")
    if not path.is_dir():
        raise PullbackError(f"--images: {str(path)!r} is not a folder")
    if limit is not None and (not isinstance(limit, int) or limit < 1):
        raise PullbackError(f"--num-images: expected a positive int, got {limit!r}")
    files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS)
    if not files:
        raise PullbackError(f"--images: no image files ({', '.join(IMAGE_EXTENSIONS)}) in {str(path)!r}")
    return files[:limit] if limit is not None else files


@dataclass(frozen=True)
class Preprocess:
    """Resize the shorter side to ``resize``, centre-crop ``size`` (H, W), scale to [0,1], then
    normalise with ``mean`` / ``std`` (None: keep [0,1])."""

    size: tuple[int, int]
    resize: int
    mean: Optional[tuple[float, float, float]] = IMAGENET_MEAN
    std: Optional[tuple[float, float, float]] = IMAGENET_STD
    interpolation: str = "bicubic"

    def __call__(self, image) -> Tensor:
        import torchvision.transforms.v2.functional as TF
        from torchvision.transforms import InterpolationMode

        mode = InterpolationMode.BICUBIC if self.interpolation == "bicubic" else InterpolationMode.BILINEAR
        x = TF.to_image(image.convert("RGB"))
        x = TF.resize(x, self.resize, interpolation=mode, antialias=True)
        x = TF.center_crop(x, list(self.size))
        x = TF.to_dtype(x, torch.float32, scale=True)
        if self.mean is not None and self.std is not None:
            x = TF.normalize(x, list(self.mean), list(self.std))
        return x


def timm_preprocess(model: torch.nn.Module) -> Preprocess:
    """The evaluation transform a timm model expects (its pretrained config, at its own input size)."""
    cfg = dict(getattr(model, "pretrained_cfg", None) or {})
    size = tuple(int(s) for s in model.patch_embed.img_size)
    crop_pct = float(cfg.get("crop_pct", 0.875) or 0.875)
    return Preprocess(
        size=size,
        resize=int(round(min(size) / crop_pct)),
        mean=tuple(cfg.get("mean", IMAGENET_MEAN)),
        std=tuple(cfg.get("std", IMAGENET_STD)),
        interpolation=str(cfg.get("interpolation", "bicubic")),
    )


def hf_preprocess(image_size: Sequence[int], config_dir: Optional[str | Path] = None) -> Preprocess:
    """Resize to ``image_size`` and normalise with the image processor's mean/std found in
    ``config_dir/preprocessor_config.json`` (DPT's 0.5/0.5 when there is none)."""
    import json

    mean, std = (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)
    if config_dir is not None:
        cfg_file = Path(config_dir) / "preprocessor_config.json"
        if cfg_file.is_file():
            cfg = json.loads(cfg_file.read_text())
            mean = tuple(cfg.get("image_mean", mean))
            std = tuple(cfg.get("image_std", std))
    size = (int(image_size[0]), int(image_size[1]))
    return Preprocess(size=size, resize=min(size), mean=mean, std=std, interpolation="bicubic")


def hf_crop_preprocess(default_size: Sequence[int], config_dir: Optional[str | Path] = None) -> Preprocess:
    """The resize-and-centre-crop of an image processor that crops (DINOv2's: shorter side to 256,
    crop 224), read from ``config_dir/preprocessor_config.json``; :func:`hf_preprocess` at
    ``default_size`` when there is no such file or it does not crop."""
    import json

    cfg_file = Path(config_dir) / "preprocessor_config.json" if config_dir is not None else None
    cfg = json.loads(cfg_file.read_text()) if cfg_file is not None and cfg_file.is_file() else {}
    crop = cfg.get("crop_size") if cfg.get("do_center_crop") else None
    if not crop:
        return hf_preprocess(default_size, config_dir)
    size = (int(crop["height"]), int(crop["width"])) if isinstance(crop, dict) else (int(crop), int(crop))
    shortest = cfg.get("size", {})
    resize = int(shortest.get("shortest_edge", min(size))) if isinstance(shortest, dict) else int(shortest)
    base = hf_preprocess(size, config_dir)
    return Preprocess(size=size, resize=resize, mean=base.mean, std=base.std, interpolation="bicubic")


def unit_range_preprocess(size: int) -> Preprocess:
    """Resize/crop to size×size, values in [0,1], no normalisation (models that normalise inside)."""
    return Preprocess(size=(size, size), resize=size, mean=None, std=None, interpolation="bilinear")


def check_readable(paths: Sequence[Path]) -> None:
    """Open and verify every file (headers and structure) before any work starts."""
    from PIL import Image, UnidentifiedImageError

    for path in paths:
        try:
            with Image.open(path) as image:
                image.verify()
        except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as exc:
            raise PullbackError(f"--images: cannot read image {str(path)!r} ({exc.__class__.__name__})") from exc


def load_images(paths: Sequence[Path], preprocess: Callable, dtype: torch.dtype = torch.float32) -> Tensor:
    """Decode and preprocess ``paths`` into images[B,3,H,W]; an unreadable file is a PullbackError naming it."""
    from PIL import Image, UnidentifiedImageError

    out = []
    for path in paths:
        try:
            with Image.open(path) as image:
                image.load()
                out.append(preprocess(image))
        except (UnidentifiedImageError, OSError, ValueError) as exc:
            raise PullbackError(f"--images: cannot read image {str(path)!r} ({exc.__class__.__name__}: {exc})") from exc
    return torch.stack(out).to(dtype)
