"""Probe maps for Hugging Face dense-prediction models: DPTForDepthEstimation and
DepthAnythingForDepthEstimation.

The probe replaces the output of encoder layer(s) by F through a forward hook and runs the model's
own forward, so the neck and head are exactly the library's. Two kinds:

- single-layer: F = tokens after encoder layer ℓ; ψ runs layers ℓ+1.., neck and head. Hooked
  layers before ℓ that the neck reads are constants of the image: ``features(images)`` returns the
  images as context (``"images"``), and ``bind(context)`` gives the map of those images.
- multi-layer (decoder input): F = the hooked layer outputs the neck reads, concatenated along
  channels, [B, N, K·D]; ψ is neck + head only and depends on F alone.

Output: predicted depth [B,H,W], optionally bilinearly resized to s×s, flattened to y[B,M].
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional, Sequence

import torch
import torch.nn.functional as TF
from torch import Tensor

from pullback_ext.probes.modes import evaluation, jvp_friendly
from pullback_ext.probes.base import Probe
from pullback_ext.probes.features import Features, context_rows
from pullback_ext.errors import PullbackError


def _encoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    dpt = getattr(model, "dpt", None)
    if dpt is not None and getattr(model, "backbone", None) is None:
        if getattr(model.config, "is_hybrid", False):
            raise PullbackError("model: hybrid DPT (convolutional stem) is not supported; use a ViT-backbone DPT")
        return dpt.encoder.layer
    backbone = getattr(model, "backbone", None)
    if backbone is not None and hasattr(backbone, "encoder") and hasattr(backbone.encoder, "layer"):
        return backbone.encoder.layer
    raise TypeError(
        f"model: expected transformers' DPTForDepthEstimation or DepthAnythingForDepthEstimation, got {type(model).__name__}"
    )


def _hooked_indices(model: torch.nn.Module) -> list[int]:
    """0-based encoder layers whose outputs the neck reads."""
    if getattr(model, "backbone", None) is None:
        return [int(i) for i in model.config.backbone_out_indices]
    backbone = model.backbone
    names = list(backbone.stage_names)
    return [names.index(s) - 1 for s in backbone.out_features]


def _patch_size(model: torch.nn.Module) -> int:
    config = model.config.backbone_config if getattr(model, "backbone", None) is not None else model.config
    return int(config.patch_size)


@contextlib.contextmanager
def _replace_outputs(layers: torch.nn.ModuleList, replacements: dict[int, Tensor]) -> Iterator[None]:
    handles = [
        # prepend: run before the library's own output-capturing hooks so they record the replacement
        layers[i].register_forward_hook(lambda _m, _inp, _out, new=new: new, prepend=True)
        for i, new in replacements.items()
    ]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


class HFDepthProbe(Probe):
    """Depth probe of a DPT / Depth Anything model (see module docstring)."""

    def __init__(
        self,
        model: torch.nn.Module,
        layer: int,
        image_size: Sequence[int],
        output_size: Optional[int] = None,
        multi_layer: bool = False,
        output_transform: Optional[Tensor] = None,
    ) -> None:
        layers = _encoder_layers(model)
        depth = len(layers)
        hooks = _hooked_indices(model)
        if not multi_layer and (not isinstance(layer, int) or isinstance(layer, bool) or not 0 <= layer < depth):
            raise PullbackError(f"layer: expected an int in [0, {depth - 1}] (the encoder has {depth} layers), got {layer!r}")
        if output_size is not None and (not isinstance(output_size, int) or output_size < 1):
            raise PullbackError(f"output_size: expected a positive int or None, got {output_size!r}")
        if len(image_size) != 2 or min(image_size) < 1:
            raise PullbackError(f"image_size: expected (H, W), got {tuple(image_size)!r}")
        patch = _patch_size(model)
        grid = (int(image_size[0]) // patch, int(image_size[1]) // patch)
        hidden = int(model.config.backbone_config.hidden_size if getattr(model, "backbone", None) is not None else model.config.hidden_size)
        num_tokens = grid[0] * grid[1] + 1
        super().__init__(
            layer=max(hooks) if multi_layer else layer,
            num_tokens=num_tokens,
            dim=hidden * (len(hooks) if multi_layer else 1),
            num_prefix_tokens=1,
            output_transform=output_transform,
        )
        self.model = model
        self.layers = layers
        self.hooks = hooks
        self.multi_layer = multi_layer
        self.output_size = output_size
        self.image_size = (int(image_size[0]), int(image_size[1]))
        self.grid_size = grid
        self.hidden = hidden

    def _check_images(self, images: Tensor) -> None:
        if not isinstance(images, Tensor) or images.dim() != 4 or images.shape[1] != 3:
            raise PullbackError(
                "images: expected a tensor [B,3,H,W], got "
                + (str(tuple(images.shape)) if isinstance(images, Tensor) else type(images).__name__)
            )
        if tuple(images.shape[-2:]) != self.image_size:
            raise PullbackError(f"images: expected spatial size {self.image_size} (the probe's image_size), got {tuple(images.shape[-2:])}")

    @torch.no_grad()
    def features(self, images: Tensor) -> Features:
        """images[B,3,H,W] -> F: [B,N,D] after layer ℓ, or [B,N,K·D] (hooked layers) when multi-layer;
        context ``"images"`` (the images themselves) when hooks before ℓ are read."""
        self._check_images(images)
        wanted = self.hooks if self.multi_layer else [self.layer]
        captured: dict[int, Tensor] = {}
        handles = [
            self.layers[i].register_forward_hook(lambda _m, _inp, out, i=i: captured.__setitem__(i, out)) for i in wanted
        ]
        try:
            with evaluation(self.model):
                self.model(pixel_values=images)
        finally:
            for h in handles:
                h.remove()
        context = {"images": images.detach()} if self.context_keys else {}
        return Features(torch.cat([captured[i] for i in wanted], dim=-1), context)

    def _depth(self, images: Tensor, F: Tensor) -> Tensor:
        if self.multi_layer:
            replacements = dict(zip(self.hooks, F.split(self.hidden, dim=-1)))
        else:
            replacements = {self.layer: F}
        with jvp_friendly(self.model), _replace_outputs(self.layers, replacements):
            depth = self.model(pixel_values=images).predicted_depth
        if self.output_size is not None:
            depth = TF.interpolate(depth.unsqueeze(1), size=(self.output_size, self.output_size), mode="bilinear", align_corners=False)
        return depth.reshape(F.shape[0], -1)

    @property
    def output_dim(self) -> int:
        """M = s² with ``output_size`` s, else the number of pixels of the model's depth map."""
        if self._output_dim is None:
            if self.output_size is not None and self.output_transform is None:
                self._output_dim = self.output_size**2
            else:
                param = next(self.model.parameters())
                F = torch.zeros(1, self.num_tokens, self.dim, dtype=param.dtype, device=param.device)
                with torch.no_grad():
                    image = torch.zeros(1, 3, *self.image_size, dtype=param.dtype, device=param.device)
                    self._output_dim = int(self.apply_output_transform(self._depth(image, F)).shape[-1])
        return self._output_dim

    @property
    def context_keys(self) -> tuple[str, ...]:
        """("images",) when ψ reads hooked layers before ℓ (constants of the image), else ()."""
        return ("images",) if not self.multi_layer and any(h < self.layer for h in self.hooks) else ()

    def outputs(self, F: Tensor) -> Tensor:
        if self.context_keys:
            raise PullbackError(
                "F: this probe also reads decoder hooks before layer ℓ from the images; bind it to them first: "
                "probe.bind(features.context) with the Features of probe.features(images)"
            )
        # ψ does not depend on the image; any input of the right size drives the earlier layers
        images = torch.zeros(F.shape[0], 3, *self.image_size, dtype=F.dtype, device=F.device)
        return self._depth(images, F)

    def _bind(self, context: dict[str, Tensor]) -> Probe:
        return _BoundDepthProbe(self, context["images"])


class _BoundDepthProbe(Probe):
    """An ``HFDepthProbe`` with the images whose constants it reads fixed, [1 or B,3,H,W]."""

    def __init__(self, parent: HFDepthProbe, images: Tensor) -> None:
        super().__init__(parent.layer, parent.num_tokens, parent.dim, parent.num_prefix_tokens, parent.output_transform)
        self.parent = parent
        self.grid_size = parent.grid_size
        self.register_buffer("images", images, persistent=False)

    def outputs(self, F: Tensor) -> Tensor:
        images = context_rows({"images": self.images}, F.shape[0])["images"]
        return self.parent._depth(images.to(F.dtype), F)


def from_hf_dpt(
    model: torch.nn.Module,
    layer: Optional[int] = None,
    output_size: Optional[int] = None,
    image_size: Optional[Sequence[int]] = None,
    multi_layer: bool = False,
    output_transform: Optional[Tensor] = None,
) -> HFDepthProbe:
    """Depth probe of ``DPTForDepthEstimation`` / ``DepthAnythingForDepthEstimation``.

    layer: encoder layer ℓ (0-based) for the single-layer probe; ignored when ``multi_layer``.
    output_size: resize the predicted depth to s×s (M = s²); None keeps the model's resolution.
    image_size: (H, W) of the inputs; defaults to the config's image size.
    """
    _encoder_layers(model)
    if not multi_layer and layer is None:
        raise PullbackError("layer: required for the single-layer probe (or pass multi_layer=True)")
    if image_size is None:
        config = model.config.backbone_config if getattr(model, "backbone", None) is not None else model.config
        size = config.image_size
        image_size = (size, size) if isinstance(size, int) else tuple(size)
    return HFDepthProbe(model, layer if layer is not None else 0, image_size, output_size, multi_layer, output_transform)
