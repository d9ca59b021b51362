"""The demo backbone–decoder pair: a small timm ViT with a CLS head and a DPT-style depth decoder.

Backbone: timm ``VisionTransformer`` at 112×112, patch 8 (14×14 = 196 patch tokens + CLS),
width 192, 8 blocks, 3 heads. Decoders:

- ``cls_head``: final-norm CLS token -> ``embedding`` (Linear D->E) -> ``classifier`` (Linear E->C).
- ``depth_head``: DPT-style. Reads the outputs of the four ``hook_layers`` blocks (each passed
  through the backbone's final norm), reassembles each into a 14×14 map resampled to 56/28/14/7,
  fuses them coarse-to-fine with residual conv units, and predicts log-depth at 56×56, upsampled
  bilinearly to 112×112. Output: metric depth in metres.
- ``SegmentationHead`` (separate weights, trained on the frozen backbone): the same DPT trunk
  (:class:`DPTDecoder`) on the same hooks, predicting per-pixel logits over ground, wall and the
  nine object classes at 56×56, upsampled bilinearly to 112×112.
"""

from __future__ import annotations

from typing import Sequence

import torch.nn.functional as Fn
from torch import Tensor, nn

from pullback_ext.embedded.scenes import CLASS_NAMES, SEGMENT_CLASS_NAMES
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
# The segmentation head: one class per renderer surface kind (see ``scenes.SEGMENT_CLASS_NAMES``).
NUM_SEGMENT_CLASSES = len(SEGMENT_CLASS_NAMES)
SEGMENTATION_FEATURES = 32
SEGMENTATION_CHANNELS = (32, 48, 64, 96)


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


class DPTDecoder(nn.Module):
    """The DPT trunk shared by the dense heads: four token maps [B,N,D] -> fused map [B,F,4g,4g].

    Reassemble: drop prefix tokens, reshape to [B,D,g,g] (g = ``grid``), 1×1 conv, resample to
    4×/2×/1×/0.5× (transpose conv, transpose conv, identity, strided conv), 3×3 conv to
    ``features`` channels. Fusion from the coarsest map up; the finest fusion stays at 4g×4g
    (56×56 for the demo). A subclass adds its ``head`` on the fused map.
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
        self.fusion = nn.ModuleList([FusionBlock(features), FusionBlock(features), FusionBlock(features),
                                     FusionBlock(features, upsample=False)])

    def reassemble(self, index: int, tokens: Tensor) -> Tensor:
        patches = tokens[:, self.num_prefix_tokens:]
        b, n, d = patches.shape
        x = patches.transpose(1, 2).reshape(b, d, self.grid, self.grid)
        return self.to_features[index](self.resample[index](self.project[index](x)))

    def fuse(self, hooked: Sequence[Tensor]) -> Tensor:
        """The four hooked token maps (shallowest first) -> the fused map [B,F,4g,4g]."""
        maps = [self.reassemble(i, t) for i, t in enumerate(hooked)]
        path = self.fusion[0](maps[3])
        path = self.fusion[1](maps[2], path)
        path = self.fusion[2](maps[1], path)
        return self.fusion[3](maps[0], path)


class DepthHead(DPTDecoder):
    """DPT-style depth decoder: four token maps [B,N,D] -> depth[B,H,W] (metres).

    The :class:`DPTDecoder` trunk, then 3×3 conv, ReLU, 1×1 conv to log-depth at 56×56 (plus
    ``LOG_DEPTH_BIAS``), upsampled bilinearly to ``image_size`` and exponentiated.
    """

    def __init__(self, dim: int, grid: int, num_prefix_tokens: int, features: int = 32,
                 channels: Sequence[int] = (32, 64, 96, 128)) -> None:
        super().__init__(dim, grid, num_prefix_tokens, features, channels)
        self.head = nn.Sequential(nn.Conv2d(features, features, 3, padding=1), nn.ReLU(), nn.Conv2d(features, 1, 1))

    def forward(self, hooked: Sequence[Tensor], image_size: int = IMAGE_SIZE) -> Tensor:
        log_depth = self.head(self.fuse(hooked)) + LOG_DEPTH_BIAS
        log_depth = Fn.interpolate(log_depth, size=(image_size, image_size), mode="bilinear", align_corners=False)
        return log_depth.squeeze(1).exp()


class SegmentationHead(DPTDecoder):
    """DPT-style segmentation decoder: four token maps [B,N,D] -> class logits[B,C,H,W].

    The :class:`DPTDecoder` trunk (narrower by default than the depth head's: reassemble
    channels 32/48/64/96), then 3×3 conv, ReLU, 1×1 conv to ``num_classes`` logits at 56×56,
    upsampled bilinearly to ``image_size``. Classes: :data:`SEGMENT_CLASS_NAMES` (ground, wall
    and the nine object classes).
    """

    def __init__(self, dim: int = WIDTH, grid: int = IMAGE_SIZE // PATCH_SIZE, num_prefix_tokens: int = 1,
                 num_classes: int = NUM_SEGMENT_CLASSES, features: int = SEGMENTATION_FEATURES,
                 channels: Sequence[int] = SEGMENTATION_CHANNELS) -> None:
        super().__init__(dim, grid, num_prefix_tokens, features, channels)
        self.num_classes = num_classes
        self.head = nn.Sequential(nn.Conv2d(features, features, 3, padding=1), nn.ReLU(), nn.Conv2d(features, num_classes, 1))

    def forward(self, hooked: Sequence[Tensor], image_size: int = IMAGE_SIZE) -> Tensor:
        logits = self.head(self.fuse(hooked))
        return Fn.interpolate(logits, size=(image_size, image_size), mode="bilinear", align_corners=False)


class DemoModel(nn.Module):
    """Backbone + CLS head + DPT depth head. ``forward(images[B,3,112,112] in [0,1])`` returns
    dict(logits[B,C], embedding[B,E], depth[B,112,112]). The segmentation head is kept apart (its
    own weights file, not in this state dict): ``segment(images, head)``."""

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

    def hook_maps(self, hooked: dict) -> list[Tensor]:
        """Raw hooked block outputs {layer: [B,N,D]} -> what the DPT heads read: each through the
        final norm, in ``hook_layers`` order."""
        return [self.backbone.norm(hooked[i]) for i in self.hook_layers]

    def decode(self, final: Tensor, hooked: dict) -> dict:
        """Final block output[B,N,D] and raw hooked block outputs -> model outputs."""
        embedding, logits = self.cls_head(self.backbone.norm(final)[:, 0])
        depth = self.depth_head(self.hook_maps(hooked), self.image_size)
        return {"logits": logits, "embedding": embedding, "depth": depth}

    def segment(self, images: Tensor, head: "SegmentationHead") -> Tensor:
        """images[B,3,H,W] in [0,1] -> class logits[B,C,H,W] of ``head`` (see
        ``pullback_ext.embedded.load_segmentation_head``), reading the hooked blocks."""
        hooked: dict = {}
        self.run_blocks(self.embed(images), 0, max(self.hook_layers) + 1, hooked)
        return head(self.hook_maps(hooked), self.image_size)

    def forward(self, images: Tensor) -> dict:
        hooked: dict = {}
        final = self.run_blocks(self.embed(images), 0, len(self.backbone.blocks), hooked)
        return self.decode(final, hooked)
