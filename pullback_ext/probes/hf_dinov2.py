"""Probe maps of Hugging Face DINOv2 models (``Dinov2Model``, ``Dinov2WithRegistersModel``, or
the ``*ForImageClassification`` model around one).

F = tokens after encoder layer ℓ (CLS, registers, patches); ψ runs layers ℓ+1.., the final
layer norm and reads out

- ``cls``: the CLS embedding (the model's ``pooler_output``), M = D;
- ``tokens``: every token, M = N·D;
- ``pooled``: the mean of the patch tokens, M = D.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from pullback_ext.probes.base import Probe
from pullback_ext.probes.features import Features
from pullback_ext.probes.modes import evaluation, jvp_friendly
from pullback_ext.errors import PullbackError

OUTPUTS = ("cls", "tokens", "pooled")
_BASE_MODELS = ("Dinov2Model", "Dinov2WithRegistersModel")


def _base_model(model: torch.nn.Module) -> torch.nn.Module:
    if type(model).__name__ in _BASE_MODELS:
        return model
    inner = getattr(model, "dinov2", None)
    if inner is not None and type(inner).__name__ in _BASE_MODELS:
        return inner
    raise TypeError(f"model: expected transformers' Dinov2Model, Dinov2WithRegistersModel or an image classifier "
                    f"around one, got {type(model).__name__}")


class HFDinov2Probe(Probe):
    """Probe of a DINOv2 model (see module docstring)."""

    def __init__(self, model: torch.nn.Module, layer: int, output: str = "cls",
                 image_size: Optional[Sequence[int]] = None, output_transform: Optional[Tensor] = None) -> None:
        base = _base_model(model)
        depth = len(base.encoder.layer)
        if not isinstance(layer, int) or isinstance(layer, bool) or not 0 <= layer < depth:
            raise PullbackError(f"layer: expected an int in [0, {depth - 1}] (the encoder has {depth} layers), got {layer!r}")
        if output not in OUTPUTS:
            raise PullbackError(f"output: expected one of {', '.join(OUTPUTS)}, got {output!r}")
        config = base.config
        if image_size is None:
            size = config.image_size
            image_size = (size, size) if isinstance(size, int) else tuple(size)
        if len(image_size) != 2 or min(image_size) < 1:
            raise PullbackError(f"image_size: expected (H, W), got {tuple(image_size)!r}")
        grid = (int(image_size[0]) // config.patch_size, int(image_size[1]) // config.patch_size)
        prefix = 1 + int(getattr(config, "num_register_tokens", 0) or 0)
        super().__init__(layer, grid[0] * grid[1] + prefix, config.hidden_size, prefix, output_transform)
        self.model = base
        self.output = output
        self.image_size = (int(image_size[0]), int(image_size[1]))
        self.grid_size = grid

    @torch.no_grad()
    def features(self, images: Tensor) -> Features:
        """images[B,3,H,W] -> F[B,N,D] after encoder layer ℓ (no context)."""
        if not isinstance(images, Tensor) or images.dim() != 4 or images.shape[1] != 3:
            raise PullbackError("images: expected a tensor [B,3,H,W], got "
                             + (str(tuple(images.shape)) if isinstance(images, Tensor) else type(images).__name__))
        if tuple(images.shape[-2:]) != self.image_size:
            raise PullbackError(f"images: expected spatial size {self.image_size} (the probe's image_size), "
                             f"got {tuple(images.shape[-2:])}")
        with evaluation(self.model):
            return Features(self.model(pixel_values=images, output_hidden_states=True).hidden_states[self.layer + 1])

    def outputs(self, F: Tensor) -> Tensor:
        with jvp_friendly(self.model):
            h = F
            for block in self.model.encoder.layer[self.layer + 1:]:
                h = block(h)
            h = self.model.layernorm(h)
        if self.output == "cls":
            return h[:, 0]
        if self.output == "pooled":
            return h[:, self.num_prefix_tokens:].mean(dim=1)
        return h.reshape(h.shape[0], -1)


def from_hf_dinov2(model: torch.nn.Module, layer: int, output: str = "cls", image_size: Optional[Sequence[int]] = None,
                   output_transform: Optional[Tensor] = None) -> HFDinov2Probe:
    """Probe ψ_ℓ of a Hugging Face DINOv2 model: F after encoder layer ``layer`` -> ``output``
    (``cls``, ``tokens`` or ``pooled``); ``image_size`` (H, W) defaults to the config's."""
    return HFDinov2Probe(model, layer, output, image_size, output_transform)
