"""Probe maps of Hugging Face DINOv2 models (``Dinov2Model``, ``Dinov2WithRegistersModel``, or
the ``*ForImageClassification`` model around one): the DINOv2 family of
:mod:`pullback_ext.probes.hf_vision`.

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

from pullback_ext.probes.hf_vision import HFVisionProbe


class HFDinov2Probe(HFVisionProbe):
    """Probe of a DINOv2 model (see module docstring)."""

    def __init__(self, model: torch.nn.Module, layer: int, output: str = "cls",
                 image_size: Optional[Sequence[int]] = None, output_transform: Optional[Tensor] = None) -> None:
        super().__init__(model, layer, output, image_size, output_transform, families=("dinov2",))


def from_hf_dinov2(model: torch.nn.Module, layer: int, output: str = "cls", image_size: Optional[Sequence[int]] = None,
                   output_transform: Optional[Tensor] = None) -> HFDinov2Probe:
    """Probe ψ_ℓ of a Hugging Face DINOv2 model: F after encoder layer ``layer`` -> ``output``
    (``cls``, ``tokens`` or ``pooled``); ``image_size`` (H, W) defaults to the config's."""
    return HFDinov2Probe(model, layer, output, image_size, output_transform)
