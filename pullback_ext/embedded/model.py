"""The demo backbone–decoder pair: a small timm ViT with a CLS head and a DPT-style depth decoder.

Backbone: timm ``VisionTransformer`` at 112×112, patch 8 (14×14 = 196 patch tokens + CLS),
width 192, 8 blocks, 3 heads. Decoders:

- ``cls_head``: final-norm CLS token -> ``embedding`` (Linear D->E) -> ``classifier`` (Linear E->C).
- ``depth_head``: DPT-style. Reads the outputs of the four ``hook_layers`` blocks (each passed
  through the backbone's final norm), reassembles each into a 14×14 map resampled to 56/28/14/7,
  fuses them coarse-to-fine with residual conv units, and predicts log-depth at 56×56, upsampled
  bilinearly to 112×112. Output: metric depth in metres.
"""

from __future__ import annotations

from typing import Sequence

import torch.nn.functional as Fn
from torch import Tensor, nn

from pullback_ext.embedded.scenes import CLASS_NAMES
from pullback_ext.errors import PullbackError

IMAGE_SIZE = 112
PATCH_SIZE = 8
WIDTH = 192
DEPTH = 8
HEADS = 3
EMBED_DIM = 128
HOOK_LAYERS = (1, 3, 5, 7)
# Images are in [0, 1]; the backbone sees (x - 0.5) / 0.25.
PIXEL_MEAN, PIXEL_STD = 0.5, 0.25
# Log-depth offset so that a zero head output predicts a typical scene depth (metres).
LOG_DEPTH_BIAS = 1.8


def build_backbone() -> nn.Module:
    """The timm VisionTransformer of the demo (random weights)."""
    from timm.models.vision_transformer import VisionTransformer

    return VisionTransformer(
        img_size=IMAGE_SIZE, patch_size=PATCH_SIZE, embed_dim=WIDTH, depth=DEPTH, num_heads=HEADS,
        mlp_ratio=4.0, num_classes=0, global_pool="token", class_token=True,
    )


class ClsHead(nn.Module):
    """CLS token[B,D] -> (embedding[B,E], logits[B,C])."""

    def __init__(self, dim: int, embed_dim: int, num_classes: int) -> None:
        super().__init__()
        self.embedding = nn.Linear(dim, embed_dim)
        self.classifier = nn.Linear(embed_dim, num_classes)

    def forward(self, cls_token: Tensor) -> tuple[Tensor, Tensor]:
        embedding = self.embedding(cls_token)
        return embedding, self.classifier(embedding)


class ResidualConvUnit(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.conv2(Fn.relu(self.conv1(Fn.relu(x))))


class FusionBlock(nn.Module):
    """DPT fusion: (coarser path, skip) -> refined map at twice the resolution."""

    def __init__(self, channels: int, upsample: bool = True) -> None:
        super().__init__()
        self.skip_unit = ResidualConvUnit(channels)
        self.unit = ResidualConvUnit(channels)
        self.project = nn.Conv2d(channels, channels, 1)
        self.upsample = upsample

    def forward(self, skip: Tensor, path: Tensor | None = None) -> Tensor:
        x = skip if path is None else path + self.skip_unit(skip)
        x = self.unit(x)
        if self.upsample:
            x = Fn.interpolate(x, scale_factor=2, mode="bilinear", align_corners=False)
        return self.project(x)


class DepthHead(nn.Module):
    """DPT-style decoder: four token maps [B,N,D] -> depth[B,H,W] (metres).

    Reassemble: drop prefix tokens, reshape to [B,D,14,14], 1×1 conv, resample to
    4×/2×/1×/0.5× (transpose conv, transpose conv, identity, strided conv), 3×3 conv to
    ``features`` channels. Fusion from the coarsest map up, then the head.
    """

    def __init__(self, dim: int, grid: int, num_prefix_tokens: int, features: int = 32,
                 channels: Sequence[int] = (32, 64, 96, 128)) -> None:
        super().__init__()
        self.grid = grid
        self.num_prefix_tokens = num_prefix_tokens
        self.project = nn.ModuleList(nn.Conv2d(dim, c, 1) for c in channels)
        self.resample = nn.ModuleList([
            nn.ConvTranspose2d(channels[0], channels[0], 4, stride=4),
            nn.ConvTranspose2d(channels[1], channels[1], 2, stride=2),
            nn.Identity(),
            nn.Conv2d(channels[3], channels[3], 3, stride=2, padding=1),
        ])
        self.to_features = nn.ModuleList(nn.Conv2d(c, features, 3, padding=1, bias=False) for c in channels)
        # The finest fusion stays at 56×56; the head upsamples the prediction bilinearly.
        self.fusion = nn.ModuleList([FusionBlock(features), FusionBlock(features), FusionBlock(features),
                                     FusionBlock(features, upsample=False)])
        self.head = nn.Sequential(nn.Conv2d(features, features, 3, padding=1), nn.ReLU(), nn.Conv2d(features, 1, 1))

    def reassemble(self, index: int, tokens: Tensor) -> Tensor:
        patches = tokens[:, self.num_prefix_tokens:]
        b, n, d = patches.shape
        x = patches.transpose(1, 2).reshape(b, d, self.grid, self.grid)
        return self.to_features[index](self.resample[index](self.project[index](x)))

    def forward(self, hooked: Sequence[Tensor], image_size: int = IMAGE_SIZE) -> Tensor:
        maps = [self.reassemble(i, t) for i, t in enumerate(hooked)]
        path = self.fusion[0](maps[3])
        path = self.fusion[1](maps[2], path)
        path = self.fusion[2](maps[1], path)
        path = self.fusion[3](maps[0], path)
        log_depth = self.head(path) + LOG_DEPTH_BIAS
        log_depth = Fn.interpolate(log_depth, size=(image_size, image_size), mode="bilinear", align_corners=False)
        return log_depth.squeeze(1).exp()


class DemoModel(nn.Module):
    """Backbone + CLS head + DPT depth head. ``forward(images[B,3,112,112] in [0,1])`` returns
    dict(logits[B,C], embedding[B,E], depth[B,112,112])."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = build_backbone()
        self.hook_layers = HOOK_LAYERS
        self.class_names = CLASS_NAMES
        self.num_classes = len(CLASS_NAMES)
        self.image_size = IMAGE_SIZE
        self.cls_head = ClsHead(WIDTH, EMBED_DIM, self.num_classes)
        self.depth_head = DepthHead(WIDTH, IMAGE_SIZE // PATCH_SIZE, self.backbone.num_prefix_tokens)

    def check_images(self, images: Tensor) -> None:
        if not isinstance(images, Tensor):
            raise TypeError(f"images: expected a torch.Tensor, got {type(images).__name__}")
        expected = (3, self.image_size, self.image_size)
        if images.dim() != 4 or tuple(images.shape[1:]) != expected:
            raise PullbackError(f"images: expected shape [B,{','.join(map(str, expected))}], got {tuple(images.shape)}")
        if not images.is_floating_point():
            raise TypeError(f"images: expected a floating-point tensor in [0,1], got dtype {images.dtype}")

    def embed(self, images: Tensor) -> Tensor:
        """images[B,3,H,W] in [0,1] -> tokens[B,N,D] entering block 0."""
        self.check_images(images)
        bb = self.backbone
        x = bb.patch_embed((images - PIXEL_MEAN) / PIXEL_STD)
        x = bb._pos_embed(x)
        return bb.norm_pre(bb.patch_drop(x))

    def run_blocks(self, x: Tensor, start: int, stop: int, hooked: dict | None = None) -> Tensor:
        """Run blocks ``start..stop-1`` on tokens x[B,N,D]; record hooked block outputs in ``hooked``."""
        for i in range(start, stop):
            x = self.backbone.blocks[i](x)
            if hooked is not None and i in self.hook_layers:
                hooked[i] = x
        return x

    def decode(self, final: Tensor, hooked: dict) -> dict:
        """Final block output[B,N,D] and raw hooked block outputs -> model outputs."""
        norm = self.backbone.norm
        embedding, logits = self.cls_head(norm(final)[:, 0])
        depth = self.depth_head([norm(hooked[i]) for i in self.hook_layers], self.image_size)
        return {"logits": logits, "embedding": embedding, "depth": depth}

    def forward(self, images: Tensor) -> dict:
        hooked: dict = {}
        final = self.run_blocks(self.embed(images), 0, len(self.backbone.blocks), hooked)
        return self.decode(final, hooked)
