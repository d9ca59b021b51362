"""Per-model image preprocessing: resize, centre crop, [0, 1] scaling and normalisation."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import torch
from torch import Tensor

from pullback_ext.errors import CheckpointError, PullbackError

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


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
        return self._normalised(TF.to_dtype(x, torch.float32, scale=True))

    def from_unit_tensor(self, images: Tensor) -> Tensor:
        """images[B,3,S,S] in [0, 1], rendered with side S = ``resize`` -> images[B,3,H,W] (centre
        crop, normalisation): what ``__call__`` does to a decoded image, without resampling it."""
        import torchvision.transforms.v2.functional as TF

        if tuple(images.shape[-2:]) != (self.resize, self.resize):
            raise PullbackError(f"images: expected a side of {self.resize} (the resize), got {tuple(images.shape[-2:])}")
        if tuple(images.shape[-2:]) != self.size:
            images = TF.center_crop(images, list(self.size))
        return self._normalised(images)

    def _normalised(self, x: Tensor) -> Tensor:
        import torchvision.transforms.v2.functional as TF

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


def processor_config(config_dir: Optional[str | Path]) -> tuple[dict, Optional[Path]]:
    """``(settings, file)`` of the image processor's ``config_dir/preprocessor_config.json``
    (``({}, None)`` when there is none); a file that is not a JSON object is a CheckpointError
    naming it, before any image is read."""
    import json

    cfg_file = Path(config_dir) / "preprocessor_config.json" if config_dir is not None else None
    if cfg_file is None or not cfg_file.is_file():
        return {}, None
    try:
        cfg = json.loads(cfg_file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{cfg_file}: not valid JSON ({exc})") from None
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{cfg_file}: expected a JSON object, got {type(cfg).__name__}")
    return cfg, cfg_file


def _channel_values(cfg: dict, key: str, default: tuple, cfg_file: Optional[Path]) -> tuple:
    value = cfg.get(key, default)
    if not (isinstance(value, (list, tuple)) and len(value) == 3 and all(isinstance(v, (int, float)) for v in value)):
        raise CheckpointError(f"{cfg_file}: {key} must be 3 numbers (one per RGB channel), got {value!r}")
    return tuple(float(v) for v in value)


def hf_preprocess(image_size: Sequence[int], config_dir: Optional[str | Path] = None) -> Preprocess:
    """Resize to ``image_size`` and normalise with the image processor's mean/std found in
    ``config_dir/preprocessor_config.json`` (DPT's 0.5/0.5 when there is none)."""
    cfg, cfg_file = processor_config(config_dir)
    mean = _channel_values(cfg, "image_mean", (0.5, 0.5, 0.5), cfg_file)
    std = _channel_values(cfg, "image_std", (0.5, 0.5, 0.5), cfg_file)
    size = (int(image_size[0]), int(image_size[1]))
    return Preprocess(size=size, resize=min(size), mean=mean, std=std, interpolation="bicubic")


def hf_crop_preprocess(default_size: Sequence[int], config_dir: Optional[str | Path] = None) -> Preprocess:
    """The resize-and-centre-crop of an image processor that crops (DINOv2's: shorter side to 256,
    crop 224), read from ``config_dir/preprocessor_config.json``; :func:`hf_preprocess` at
    ``default_size`` when there is no such file or it does not crop."""
    cfg, cfg_file = processor_config(config_dir)
    crop = cfg.get("crop_size") if cfg.get("do_center_crop") else None
    if not crop:
        return hf_preprocess(default_size, config_dir)
    try:
        size = (int(crop["height"]), int(crop["width"])) if isinstance(crop, dict) else (int(crop), int(crop))
        shortest = cfg.get("size", {})
        resize = int(shortest.get("shortest_edge", min(size))) if isinstance(shortest, dict) else int(shortest)
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{cfg_file}: crop_size / size must be sizes in pixels ({type(exc).__name__}: {exc})") from None
    base = hf_preprocess(size, config_dir)
    return Preprocess(size=size, resize=resize, mean=base.mean, std=base.std, interpolation="bicubic")


def unit_range_preprocess(size: int) -> Preprocess:
    """Resize/crop to size×size, values in [0,1], no normalisation (models that normalise inside)."""
    return Preprocess(size=(size, size), resize=size, mean=None, std=None, interpolation="bilinear")
